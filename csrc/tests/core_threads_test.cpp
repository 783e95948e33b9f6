// Threads against one KVCacheCore on the host backend, built under ThreadSanitizer and
// AddressSanitizer/UBSan by `make sanitize` (no Python: the sanitizers see only our code).
//
// Four threads alloc/step/prefetch/free/reclaim/stats concurrently with the prefetch thread, then
// the invariants must hold and close() must leave nothing behind. Also exercises rollback paths
// through the host backend's fault hook, and OutOfPages under a budget.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/kv_cache.h"
#include "host/host_backend.h"
#include "tests/harness.h"

using namespace vattention;
using vattention::testing::check;

namespace {

std::unique_ptr<KVCacheCore> make_core(bool mega, int64_t budget, ReclaimPolicy policy,
                                       int64_t page_bytes = 64 << 10) {
  CacheGeometry g = testing::small_geometry(4, 16, 4096, mega);
  g.page_bytes = page_bytes;
  return testing::host_core(g, budget, policy);
}

void hammer(KVCacheCore& core, unsigned seed, const std::atomic<bool>& stop,
            std::atomic<long>& steps) {
  std::mt19937 rng(seed);
  const int64_t B = core.geometry().max_batch;
  std::vector<std::pair<int, int64_t>> mine;
  auto lens_of = [&](int64_t extra) {
    std::vector<int64_t> lens(static_cast<size_t>(B), KVCacheCore::kUnlisted);
    for (auto& [s, n] : mine) lens[static_cast<size_t>(s)] = std::min<int64_t>(4096, n + extra);
    return lens;
  };
  while (!stop) {
    const unsigned op = rng() % 100;
    try {
      if (op < 20 && mine.size() < 4) {
        mine.emplace_back(core.alloc(), 0);
      } else if (op < 60 && !mine.empty()) {
        const int64_t extra = 1 + static_cast<int64_t>(rng() % 300);
        std::vector<int64_t> lens = lens_of(extra);
        core.step(lens, {}, 0);
        for (auto& [s, n] : mine) n = lens[static_cast<size_t>(s)];
        ++steps;
      } else if (op < 75 && !mine.empty()) {
        core.prefetch(lens_of(64), -1);
      } else if (op < 85 && !mine.empty()) {
        core.free(mine.back().first, 0);
        mine.pop_back();
      } else if (op < 90) {
        core.reclaim();
      } else {
        core.stats();
        core.wait();
      }
    } catch (const Error& e) {
      if (e.kind() == Error::Kind::OutOfPages && !mine.empty()) {
        core.free(mine.back().first, 0);
        mine.pop_back();
      } else if (e.kind() != Error::Kind::InvalidSlot && e.kind() != Error::Kind::OutOfPages) {
        check(false, std::string("unexpected error: ") + e.what());
      }
    }
  }
  for (auto& [s, n] : mine) core.free(s, 0);
}

// page_bytes 2 MB: pages created in 2 MB huge pages where this kernel collapses them
// (HostBackend::instantiate from the stepping and prefetching threads at once).
void test_threads(bool mega, ReclaimPolicy policy, int64_t page_bytes = 64 << 10) {
  auto core = make_core(mega, page_bytes > (64 << 10) ? 64 << 20 : 24 << 20, policy, page_bytes);
  std::atomic<long> steps{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (unsigned i = 0; i < 4; ++i)
    threads.emplace_back(hammer, std::ref(*core), i, std::cref(stop), std::ref(steps));
  // 1.5 s and 100 steps at the least (a 2-core VM steps thousands of times in 1.5 s)
  const bool ok =
      testing::run_until(stop, std::chrono::milliseconds(1500), [&] { return steps >= 100; });
  for (auto& t : threads) t.join();
  core->wait();
  check(ok, "a hang: " + std::to_string(steps.load()) + " steps in 120 s");
  check(core->check_invariants().empty(), "invariants: " + core->check_invariants());
  if (page_bytes > (64 << 10) && policy == ReclaimPolicy::Deferred && HostBackend::huge_unit()) {
    // the freed rows' pages wait in the pool: some of them must be huge
    const auto& host = static_cast<const HostBackend&>(core->backend());
    check(host.huge_page_bytes() > 0, "no page was created in huge pages");
  }
  core->close();
  core->close();
}

void test_rollback_through_faults() {
  for (const char* op : {"map", "set_access", "create_page", "unmap"}) {
    auto core = make_core(false, -1, ReclaimPolicy::Deferred);
    auto& host = static_cast<HostBackend&>(core->backend());
    std::vector<int64_t> lens(16, KVCacheCore::kUnlisted);
    const int a = core->alloc(), b = core->alloc();
    lens[static_cast<size_t>(a)] = 600;
    core->step(lens, {}, 0);
    core->free(a, 0);
    host.inject_fault(op, 2, false);
    lens.assign(16, KVCacheCore::kUnlisted);
    lens[static_cast<size_t>(b)] = 3000;
    try {
      core->step(lens, {}, 0);
      core->reclaim();
    } catch (const Error& e) {
      check(e.kind() == Error::Kind::Driver, std::string("fault kind for ") + op);
    }
    check(core->check_invariants().empty(),
          std::string("invariants after ") + op + ": " + core->check_invariants());
    host.inject_fault(op, 0, false);
    core->step(lens, {}, 0);
    core->close();
  }
}

}  // namespace

int main() {
  test_threads(false, ReclaimPolicy::Deferred);
  test_threads(true, ReclaimPolicy::Deferred);
  test_threads(false, ReclaimPolicy::Eager);
  test_threads(true, ReclaimPolicy::Deferred, 2 << 20);
  test_threads(false, ReclaimPolicy::Eager, 2 << 20);
  test_rollback_through_faults();
  return vattention::testing::report("core thread/rollback tests");
}
