// The prefetch thread maps outside the cache lock (rule R in core/prefetch_gate.h).
// Built under ThreadSanitizer and AddressSanitizer/UBSan by `make sanitize`.
//
// A GatedBackend wraps the host backend and can stop the Nth map() call, without any cache lock
// held, until the test opens the gate: a driver call "held open". While the prefetch thread is
// stopped there mapping slot A, the test steps other slots (must not wait), steps A itself (must
// wait, then see the pages), frees A (deferred and eager), forks A, swaps A out, reclaims and
// fails the mapping; afterwards the invariants hold, nothing is mapped twice (the host backend
// refuses a double map) and every page is either in the pool or owned by a slot. A last test
// hammers everything with random map latency to widen the windows.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <future>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/kv_cache.h"
#include "host/host_backend.h"
#include "tests/harness.h"

using namespace vattention;
using vattention::testing::check;
using namespace std::chrono_literals;

namespace {

// Host backend whose map() can be held open (gate) or slowed (latency). Everything else forwards.
class GatedBackend final : public Backend {
 public:
  explicit GatedBackend(size_t page_bytes) : inner_(page_bytes) {}
  HostBackend& inner() { return inner_; }

  // The nth next call of `op` ("map" or "create_page") stops before acting until open().
  void arm(int nth, const std::string& op = "map") {
    std::lock_guard<std::mutex> lock(mu_);
    countdown_ = nth;
    gated_op_ = op;
    open_ = false;
  }
  void open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  bool wait_held(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [this] { return held_; });
  }
  void set_latency_us(int us) { latency_us_ = us; }

  size_t granularity() const override { return inner_.granularity(); }
  size_t page_bytes() const override { return inner_.page_bytes(); }
  DeviceId device() const override { return inner_.device(); }
  std::string name() const override { return "gated-host"; }
  uintptr_t reserve(size_t bytes) override { return inner_.reserve(bytes); }
  void release_va(uintptr_t va, size_t bytes) override { inner_.release_va(va, bytes); }
  PageHandle create_page() override {
    gate("create_page");
    return inner_.create_page();
  }
  void destroy_page(PageHandle page) override { inner_.destroy_page(page); }
  void map(uintptr_t va, PageHandle page) override {
    gate("map");
    if (const int us = latency_us_.load())
      std::this_thread::sleep_for(std::chrono::microseconds(us));
    inner_.map(va, page);
  }
  void set_access(uintptr_t va, size_t bytes) override { inner_.set_access(va, bytes); }
  void prefault(uintptr_t va, size_t bytes) noexcept override { inner_.prefault(va, bytes); }
  void unmap(uintptr_t va, size_t bytes) override { inner_.unmap(va, bytes); }
  void bind_thread() override { inner_.bind_thread(); }
  uint64_t record_fence(uintptr_t stream) override { return inner_.record_fence(stream); }
  bool fence_done(uint64_t fence) override { return inner_.fence_done(fence); }
  void fence_wait(uint64_t fence) override { inner_.fence_wait(fence); }
  void fence_release(uint64_t fence) override { inner_.fence_release(fence); }
  void synchronize() override { inner_.synchronize(); }
  uintptr_t create_stream() override { return inner_.create_stream(); }
  void destroy_stream(uintptr_t stream) override { inner_.destroy_stream(stream); }
  void zero(uintptr_t va, size_t bytes, uintptr_t stream) override {
    inner_.zero(va, bytes, stream);
  }
  void release_physical() noexcept override { inner_.release_physical(); }
  int64_t committed_bytes() const override { return inner_.committed_bytes(); }
  int64_t huge_page_bytes() const override { return inner_.huge_page_bytes(); }
  std::unique_ptr<CacheRegistration> register_cache(const CacheGeometry& geometry,
                                                    const std::vector<uintptr_t>& bases) override {
    return inner_.register_cache(geometry, bases);
  }
  void copy(uintptr_t dst, uintptr_t src, size_t bytes, uintptr_t stream) override {
    inner_.copy(dst, src, bytes, stream);
  }
  void copy_to_host(void* dst, uintptr_t src, size_t bytes, uintptr_t stream) override {
    inner_.copy_to_host(dst, src, bytes, stream);
  }
  void copy_from_host(uintptr_t dst, const void* src, size_t bytes, uintptr_t stream) override {
    inner_.copy_from_host(dst, src, bytes, stream);
  }
  void* alloc_host(size_t bytes) override { return inner_.alloc_host(bytes); }
  void free_host(void* ptr) override { inner_.free_host(ptr); }

 private:
  void gate(const char* op) {
    std::unique_lock<std::mutex> lock(mu_);
    if (gated_op_ == op && countdown_ > 0 && --countdown_ == 0) {
      held_ = true;
      cv_.notify_all();
      cv_.wait(lock, [this] { return open_; });
      held_ = false;
    }
  }

  HostBackend inner_;
  std::string gated_op_ = "map";
  std::mutex mu_;
  std::condition_variable cv_;
  int countdown_ = 0;
  bool open_ = true;
  bool held_ = false;
  std::atomic<int> latency_us_{0};
};

constexpr int B = 8;

struct Fixture {
  std::unique_ptr<KVCacheCore> core;
  GatedBackend* gate = nullptr;
  int64_t tpp = 0;  // tokens per page

  // tile > 0: the tile rule (read_tail.h), whose zeroing the prefetch thread shares.
  explicit Fixture(ReclaimPolicy policy = ReclaimPolicy::Deferred, int64_t budget = -1,
                   int64_t tile = 0) {
    CacheGeometry g = testing::small_geometry(1, B, 8192);
    g.tile_tokens = tile;
    auto backend = std::make_unique<GatedBackend>(g.page_bytes);
    gate = backend.get();
    CacheOptions options;
    options.budget_bytes = budget;
    options.policy = policy;
    core = make_cache(std::move(backend), g, options);
    tpp = static_cast<int64_t>(g.tokens_per_page());
  }
  std::vector<int64_t> lens(std::initializer_list<std::pair<int, int64_t>> items) const {
    std::vector<int64_t> v(B, KVCacheCore::kUnlisted);
    for (auto& [s, n] : items) v[static_cast<size_t>(s)] = n;
    return v;
  }
  // Starts a prefetch of `slot` to `tokens` and returns once its first `op` call is held open.
  void hold_prefetch(int slot, int64_t tokens, const std::string& op = "map") {
    gate->arm(1, op);
    core->prefetch(lens({{slot, tokens}}), 0);
    check(gate->wait_held(5s), "the prefetch thread never reached map()");
  }
  int64_t stat(const std::string& key) const {
    for (auto& [k, v] : core->stats()) {
      if (k == key) return v;
    }
    return -1;
  }
  void finish(const std::string& what) {
    gate->open();
    try {
      core->wait();
    } catch (const std::exception& e) {
      check(false, what + ": unexpected background error: " + e.what());
    }
    const std::string inv = core->check_invariants();
    check(inv.empty(), what + ": invariants: " + inv);
  }
  // Every page back in the pool once all slots are freed and reclaimed.
  void expect_all_pages_return(const std::string& what) {
    for (int s : core->active_slots()) core->free(s, 0);
    core->reclaim();
    check(stat("pages_free") == stat("pages_total"),
          what + ": pages_free " + std::to_string(stat("pages_free")) + " != pages_total " +
              std::to_string(stat("pages_total")));
    check(stat("mappings") == 0, what + ": mappings left: " + std::to_string(stat("mappings")));
  }
};

// step() of another slot, and the fast path of the slot in flight, never wait for the held call.
void test_step_of_other_slots_does_not_wait() {
  Fixture f;
  const int a = f.core->alloc(), b = f.core->alloc();
  f.core->step(f.lens({{a, 1}, {b, 1}}), {}, 0);
  f.hold_prefetch(a, 5 * f.tpp);
  auto other = std::async(std::launch::async, [&] {
    f.core->step(f.lens({{b, 3 * f.tpp}}), {}, 0);  // maps b: its own driver calls only
    return f.core->try_step(f.lens({{a, 1}, {b, 3 * f.tpp}}));  // nothing to map
  });
  const bool done = other.wait_for(5s) == std::future_status::ready;
  check(done, "step() of other slots waited for the held prefetch map");
  if (done) check(other.get(), "fast path refused a step that needs no pages");
  check(f.core->mapped_tokens(b) >= 3 * f.tpp, "b not backed");
  f.finish("other slots");
  check(f.core->mapped_tokens(a) >= 5 * f.tpp, "a not backed after publish");
  f.expect_all_pages_return("other slots");
}

// step() needing the pages in flight waits for the publish, then finds them mapped.
void test_step_of_the_slot_in_flight_waits() {
  Fixture f;
  const int a = f.core->alloc();
  f.core->step(f.lens({{a, 1}}), {}, 0);
  f.hold_prefetch(a, 4 * f.tpp);
  const int64_t step_maps = f.stat("step_map_calls");
  auto st = std::async(std::launch::async, [&] { f.core->step(f.lens({{a, 4 * f.tpp}}), {}, 0); });
  check(st.wait_for(100ms) == std::future_status::timeout,
        "step() did not wait for the range in flight");
  f.gate->open();
  check(st.wait_for(5s) == std::future_status::ready, "step() never finished");
  st.get();
  check(f.stat("step_map_calls") == step_maps, "step() mapped pages the prefetch thread mapped");
  f.finish("same slot");
  f.expect_all_pages_return("same slot");
}

// free() (deferred and eager, with and without pages) while the slot's pages are being mapped.
void test_free_during_flight(ReclaimPolicy policy, bool had_pages) {
  const std::string what = std::string("free during flight (") +
                           (policy == ReclaimPolicy::Eager ? "eager" : "deferred") +
                           (had_pages ? ", had pages)" : ", no pages)");
  Fixture f(policy);
  const int a = f.core->alloc();
  if (had_pages) f.core->step(f.lens({{a, 1}}), {}, 0);
  f.hold_prefetch(a, 3 * f.tpp);
  f.core->free(a, 0);
  check(f.core->check_invariants().empty(),
        what + ": invariants in flight: " + f.core->check_invariants());
  auto rc = std::async(std::launch::async, [&] { return f.core->reclaim(); });  // settles first
  check(rc.wait_for(100ms) == std::future_status::timeout, what + ": reclaim() did not settle");
  f.gate->open();
  check(rc.get() == 3 * 4, what + ": reclaim() should unmap the published pages too");
  f.finish(what);
  f.core->reclaim();
  check(f.stat("pages_free") == f.stat("pages_total"), what + ": pages not back in the pool");
  // The slot is usable again.
  const int b = f.core->alloc();
  f.core->step(f.lens({{b, 2 * f.tpp}}), {}, 0);
  f.expect_all_pages_return(what);
}

// A step elsewhere frees (alloc picks) the slot in flight: alloc settles first.
void test_free_then_alloc_during_flight() {
  Fixture f;
  const int a = f.core->alloc();
  f.core->step(f.lens({{a, 1}}), {}, 0);
  f.hold_prefetch(a, 3 * f.tpp);
  f.core->free(a, 0);
  auto al = std::async(std::launch::async, [&] { return f.core->alloc(); });
  check(al.wait_for(100ms) == std::future_status::timeout,
        "alloc() did not settle the freed slot in flight");
  f.gate->open();
  const int b = al.get();
  check(b == a, "alloc() should prefer the idle slot holding pages");
  f.core->step(f.lens({{b, 3 * f.tpp}}), {}, 0);
  f.finish("free then alloc");
  f.expect_all_pages_return("free then alloc");
}

// fork / swap_out of the slot in flight settle first; results are consistent.
void test_fork_and_swap_during_flight() {
  Fixture f;
  f.core->set_swap_budget(int64_t{16} << 20);
  const int a = f.core->alloc();
  f.core->step(f.lens({{a, 2 * f.tpp + 3}}), {}, 0);
  f.hold_prefetch(a, 6 * f.tpp);
  auto fk = std::async(std::launch::async, [&] { return f.core->fork(a, -1, 0); });
  check(fk.wait_for(100ms) == std::future_status::timeout, "fork() did not settle");
  f.gate->open();
  const int c = fk.get();
  check(f.core->seq_len(c) == 2 * f.tpp + 3, "fork length");
  f.finish("fork");
  f.hold_prefetch(c, 6 * f.tpp);
  auto sw = std::async(std::launch::async, [&] { return f.core->swap_out(c, 0); });
  check(sw.wait_for(100ms) == std::future_status::timeout, "swap_out() did not settle");
  f.gate->open();
  const int64_t h = sw.get();
  f.finish("swap_out");
  const int d = f.core->swap_in(h, 0);
  check(f.core->seq_len(d) == 2 * f.tpp + 3, "swap_in length");
  f.expect_all_pages_return("fork and swap");
}

// A driver failure while mapping outside the lock: unmapped, pages back, error on the next call.
void test_map_failure_outside_the_lock() {
  Fixture f;
  const int a = f.core->alloc();
  f.core->step(f.lens({{a, 1}}), {}, 0);
  f.gate->inner().inject_fault("map", 3, false);
  f.core->prefetch(f.lens({{a, 4 * f.tpp}}), 0);
  bool raised = false;
  try {
    f.core->wait();
  } catch (const Error& e) {
    raised = e.kind() == Error::Kind::Driver;
  }
  check(raised, "map failure not reported by wait()");
  check(f.core->check_invariants().empty(),
        "invariants after failure: " + f.core->check_invariants());
  check(f.core->mapped_tokens(a) == f.tpp, "slot changed by a failed background mapping");
  f.core->step(f.lens({{a, 4 * f.tpp}}), {}, 0);  // the range is free to map again
  f.expect_all_pages_return("map failure");
}

// Under a budget, pages held in flight are waited for rather than reported missing.
void test_pool_dry_while_pages_in_flight() {
  Fixture f(ReclaimPolicy::Deferred, int64_t{12} * (64 << 10) * 4);  // 12 page indices x 4 tensors
  const int a = f.core->alloc(), b = f.core->alloc();
  f.core->step(f.lens({{a, 1}, {b, 1}}), {}, 0);
  f.hold_prefetch(a, 8 * f.tpp);  // 7 more page indices in flight; 3 left
  auto st = std::async(std::launch::async, [&] {
    // Needs 4 more for b: only after a's look-ahead is published can it be trimmed.
    f.core->step(f.lens({{a, 1}, {b, 5 * f.tpp}}), {}, 0);
  });
  check(st.wait_for(100ms) == std::future_status::timeout,
        "step() did not wait for pages in flight");
  f.gate->open();
  try {
    st.get();
  } catch (const std::exception& e) {
    check(false, std::string("step() failed although trimming look-ahead suffices: ") + e.what());
  }
  f.finish("pool dry");
  check(f.core->mapped_tokens(b) >= 5 * f.tpp, "b not backed");
  f.expect_all_pages_return("pool dry");
}

// Page creation (cuMemCreate) by the prefetch thread happens without the lock too: a step() that
// creates its own pages goes on meanwhile; under a budget, pages being created are counted.
void test_page_creation_outside_the_lock() {
  {
    Fixture f;
    const int a = f.core->alloc(), b = f.core->alloc();
    f.hold_prefetch(a, 3 * f.tpp, "create_page");
    auto st =
        std::async(std::launch::async, [&] { f.core->step(f.lens({{b, 2 * f.tpp}}), {}, 0); });
    check(st.wait_for(5s) == std::future_status::ready,
          "step() waited for the prefetch thread's cuMemCreate");
    st.get();
    f.finish("create, no budget");
    check(f.core->mapped_tokens(a) >= 3 * f.tpp,
          "a not backed after the created pages were mapped");
    f.expect_all_pages_return("create, no budget");
  }
  {
    Fixture f(ReclaimPolicy::Deferred, int64_t{6} * (64 << 10) * 4);  // 6 page indices x 4 tensors
    const int a = f.core->alloc(), b = f.core->alloc();
    f.hold_prefetch(a, 4 * f.tpp, "create_page");  // counts 16 of the 24 pages against the budget
    auto st =
        std::async(std::launch::async, [&] { f.core->step(f.lens({{b, 3 * f.tpp}}), {}, 0); });
    check(st.wait_for(100ms) == std::future_status::timeout,
          "step() did not wait for pages being created under the budget");
    f.gate->open();
    try {
      st.get();  // takes pages the thread created; the thread then falls short (not an error)
    } catch (const std::exception& e) {
      check(false, std::string("step() failed under the budget: ") + e.what());
    }
    f.finish("create, budget");
    check(f.stat("pages_total") <= 24, "budget exceeded: " + std::to_string(f.stat("pages_total")));
    f.expect_all_pages_return("create, budget");
  }
}

// Everything at once, with map() slowed so the prefetch thread is mostly outside the lock. With
// a tile (384: read ends cross the 512-token pages) the thread zeroes the tails of the pages it
// maps while steps, forks and swaps zero theirs; check_invariants() then also checks that every
// active row maps its read end and holds it finite.
void test_hammer_with_latency(int64_t tile) {
  Fixture f(ReclaimPolicy::Deferred, int64_t{4} << 20, tile);
  f.core->set_swap_budget(int64_t{4} << 20);
  f.gate->set_latency_us(150);
  std::atomic<long> ops{0};
  std::atomic<bool> stop{false};
  auto worker = [&](unsigned seed) {
    std::mt19937 rng(seed);
    std::vector<std::pair<int, int64_t>> mine;
    std::vector<int64_t> handles;
    auto lens_of = [&](int64_t extra) {
      std::vector<int64_t> v(B, KVCacheCore::kUnlisted);
      for (auto& [s, n] : mine) v[static_cast<size_t>(s)] = std::min<int64_t>(2048, n + extra);
      return v;
    };
    while (!stop) {
      const unsigned op = rng() % 100;
      try {
        if (op < 15 && mine.size() < 2) {
          mine.emplace_back(f.core->alloc(), 0);
        } else if (op < 45 && !mine.empty()) {
          auto v = lens_of(1 + static_cast<int64_t>(rng() % 200));
          if (rng() % 2 == 0) {
            f.core->try_step(v);  // the fast path: may refuse (nothing changed then)
          } else {
            f.core->step(v, {}, 0);
          }
          for (auto& [s, n] : mine) n = std::max(n, v[static_cast<size_t>(s)]);
        } else if (op < 70 && !mine.empty()) {
          f.core->prefetch(lens_of(static_cast<int64_t>(rng() % 300)), -1);
        } else if (op < 78 && !mine.empty()) {
          f.core->free(mine.back().first, 0);
          mine.pop_back();
        } else if (op < 83 && !mine.empty() && mine.size() < 3) {
          const int src = mine[rng() % mine.size()].first;
          const int c = f.core->fork(src, -1, 0);
          mine.emplace_back(c, f.core->seq_len(c));
        } else if (op < 88 && !mine.empty()) {
          handles.push_back(f.core->swap_out(mine.back().first, 0));
          mine.pop_back();
        } else if (op < 92 && !handles.empty()) {
          const int s = f.core->swap_in(handles.back(), 0);
          handles.pop_back();
          mine.emplace_back(s, f.core->seq_len(s));
        } else if (op < 95) {
          f.core->reclaim();
        } else {
          const std::string inv = f.core->check_invariants();
          check(inv.empty(), "hammer invariants: " + inv);
        }
        ++ops;
      } catch (const Error& e) {
        const auto k = e.kind();
        if (k == Error::Kind::OutOfPages && !mine.empty()) {
          f.core->free(mine.back().first, 0);
          mine.pop_back();
        } else if (k != Error::Kind::InvalidSlot && k != Error::Kind::OutOfPages &&
                   k != Error::Kind::SwapSpace) {
          check(false, std::string("hammer: unexpected error: ") + e.what());
        }
      }
    }
    for (auto& [s, n] : mine) f.core->free(s, 0);
    for (int64_t h : handles) f.core->swap_drop(h);
  };
  std::vector<std::thread> threads;
  for (unsigned i = 0; i < 3; ++i) threads.emplace_back(worker, i + 11);
  // 1.5 s, 200 operations and a mapping by the prefetch thread at the least
  const bool ok = testing::run_until(
      stop, 1500ms, [&] { return ops >= 200 && f.stat("prefetch_map_calls") > 0; });
  for (auto& t : threads) t.join();
  f.core->wait();
  check(ok, "hammer: a hang: " + std::to_string(ops.load()) + " operations in 120 s, " +
                std::to_string(f.stat("prefetch_map_calls")) + " mapped by the prefetch thread");
  const std::string inv = f.core->check_invariants();
  check(inv.empty(), "hammer: invariants: " + inv);
  if (tile > 0) check(f.stat("tail_zero_calls") > 0, "hammer: the tile rule zeroed nothing");
  f.core->reclaim();
  check(f.stat("pages_free") == f.stat("pages_total"), "hammer: pages not back in the pool");
  f.core->close();
}

}  // namespace

int main() {
  test_step_of_other_slots_does_not_wait();
  test_step_of_the_slot_in_flight_waits();
  test_free_during_flight(ReclaimPolicy::Deferred, true);
  test_free_during_flight(ReclaimPolicy::Deferred, false);
  test_free_during_flight(ReclaimPolicy::Eager, true);
  test_free_during_flight(ReclaimPolicy::Eager, false);
  test_free_then_alloc_during_flight();
  test_fork_and_swap_during_flight();
  test_map_failure_outside_the_lock();
  test_pool_dry_while_pages_in_flight();
  test_page_creation_outside_the_lock();
  test_hammer_with_latency(0);
  test_hammer_with_latency(384);
  return vattention::testing::report("prefetch race tests (map outside the lock)");
}
