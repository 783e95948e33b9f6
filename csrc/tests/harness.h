// The C++ tests' shared harness: checks that count failures (from any thread) and the exit code
// that reports them. Each test binary is built under ThreadSanitizer and AddressSanitizer/UBSan
// by `make sanitize`; a failure or a sanitizer report fails the run.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>

#include "core/kv_cache.h"
#include "host/host_backend.h"
#include "tests/sanitizer.h"

namespace vattention {
namespace testing {

inline std::atomic<int>& failures() {
  static std::atomic<int> count{0};
  return count;
}

// Records a failure (and prints it) unless ok.
inline void check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
    ++failures();
  }
}

// The tests' usual shape: 2 layers of fp16 64-dim heads, 64 KB pages; the rest is the caller's.
inline CacheGeometry small_geometry(int64_t kv_heads, int64_t max_batch, int64_t max_seq,
                                    bool mega = false) {
  CacheGeometry g;
  g.num_layers = 2;
  g.num_kv_heads = kv_heads;
  g.head_dim = 64;
  g.element_bytes = 2;
  g.max_batch = max_batch;
  g.max_seq = max_seq;
  g.page_bytes = 64 << 10;
  g.mega = mega;
  return g;
}

// A cache of geometry g on the host backend (no look-ahead); num_blocks > 0: pages named by an
// engine's blocks (cache_blocks: kept for its prefix cache).
inline std::unique_ptr<KVCacheCore> host_core(const CacheGeometry& g, int64_t budget_bytes,
                                              ReclaimPolicy policy, int64_t num_blocks = 0,
                                              bool cache_blocks = false) {
  CacheOptions options;
  options.budget_bytes = budget_bytes;
  options.policy = policy;
  options.num_blocks = num_blocks;
  options.block_cache = cache_blocks;
  return make_cache(std::make_unique<HostBackend>(g.page_bytes), g, options);
}

// How long the hammer tests' threads run: counted, not timed. Called on the main thread while the
// workers loop until `stop`: sets `stop` once at least `min_time` has passed and `enough()` holds
// (events counted by the caller: steps, copies, swaps), polled every 10 ms; so a slow machine, a
// loaded one or a sanitizer's 5-15x slowdown runs longer instead of checking less. `hang` only
// guards against a hang (no normal run comes near it): false when it stopped the run.
template <class Enough>
bool run_until(std::atomic<bool>& stop, std::chrono::milliseconds min_time, Enough enough,
               std::chrono::seconds hang = std::chrono::seconds(120)) {
  const auto give_up = std::chrono::steady_clock::now() + hang;
  std::this_thread::sleep_for(min_time);
  bool ok = enough();
  while (!ok && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    ok = enough();
  }
  stop = true;
  return ok;
}

// main()'s return value: prints the outcome of the binary named `suite`, and its sanitizer.
inline int report(const char* suite) {
  if (failures() != 0) {
    std::fprintf(stderr, "%s [%s]: %d failure(s)\n", suite, sanitizer_name(), failures().load());
    return 1;
  }
  std::printf("%s [%s]: all passed\n", suite, sanitizer_name());
  return 0;
}

}  // namespace testing
}  // namespace vattention
