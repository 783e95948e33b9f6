// PrefetchGate: the one slot range the prefetch thread maps outside the cache mutex, and the
// waits that keep everyone else out of it.
//
// Why the driver calls run without the cache mutex: on a GPU, mapping one slot's
// crossing is T x (cuMemMap + cuMemSetAccess), ~40 us each on an A100; holding the mutex meanwhile
// made every step() that arrived wait behind the driver. So the prefetch thread takes each slot
// through three phases:
//   1. plan (locked): take the pages from the pool and mark page indices [from, to) of the slot
//      in flight (begin()), where from == slot.mapped;
//   2. map (unlocked): cuMemMap each page and cuMemSetAccess each tensor's run (SlotMapper);
//   3. publish (locked): append the pages to the slot, clear the flight (publish()), wake waiters.
// Pages the pool lacks are created before phase 1 takes them, also without the lock
// (PagePool::begin_create/end_create; created() wakes waiters).
//
// The argument that nothing else can go wrong meanwhile is one rule, kept by every path that maps
// or unmaps slot memory:
//   R. While a slot is in flight, only the prefetch thread maps or unmaps inside it at or above
//      `from`, and nothing shrinks the slot below `from` (so slot.mapped == from at publish).
// Who would break R, and what each does instead:
//   - step() growing that slot waits for that publish only (await_publish: it needs those pages,
//     not a wasted wait; the thread going on to the next slot does not hold it up); step()
//     growing other slots maps them in parallel: unlocked driver calls are independent.
//   - reclaiming/trimming (PageSupply) skips the slot in flight and does not count its pages;
//     reclaim() and set_memory_budget() settle first (they are not on the decode path).
//   - fork, share_prefix, ensure_private, swap_out, swap_in settle first (they may map, unmap or
//     pick that slot); alloc() waits for the publish when the slot in flight was freed (it may
//     pick it; the thread never starts mapping a slot that is not active).
//   - free() only changes the slot's state: a range published onto an idle slot is idle memory
//     (reclaimed later behind the free() fence, as any idle page), onto a free one makes it idle.
//     No stream can read the in-flight pages before publish (step() never reported them backed),
//     so the fence rule ("never unmap what a stream may still read") is not at stake in phase 2.
//   - close() stops the prefetcher (joins the thread) before it takes the mutex: nothing is in
//     flight then.
// So no range is mapped twice (the emulation would count a violation), every in-flight page is
// either published into the slot or, on a driver error, unmapped and returned to the pool, and
// check_invariants() counts in-flight pages as in use.
//
// Every method runs under the cache mutex; the waits release it while they wait.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "core/backend.h"
#include "core/page_pool.h"

namespace vattention {

class PrefetchGate {
 public:
  using Lock = std::unique_lock<std::mutex>;

  struct Flight {
    int slot = -1;                   // -1: nothing in flight
    size_t from = 0, to = 0;         // page indices being mapped outside the lock
    std::vector<PageHandle> pages;   // taken from the pool (refcount 1), not yet in the slot
  };

  explicit PrefetchGate(const PagePool& pool) : pool_(pool) {}
  PrefetchGate(const PrefetchGate&) = delete;
  PrefetchGate& operator=(const PrefetchGate&) = delete;

  const Flight& flight() const { return flight_; }
  bool in_flight(size_t slot) const { return flight_.slot == static_cast<int>(slot); }
  // True while the prefetch thread maps or creates pages without the mutex.
  bool busy() const { return flight_.slot >= 0 || pool_.creating() > 0; }
  // True while a caller waits in settle() or await_publish(): the headroom's refill, which has
  // no deadline, gives way (background_mapper.h) instead of starting another page.
  bool awaited() const { return waiters_ > 0; }

  // Phase 1: [from, to) of `slot` is the prefetch thread's alone until publish().
  void begin(int slot, size_t from, size_t to, std::vector<PageHandle> pages);
  // Phase 3 (or its failure): nothing is in flight any more; wakes every waiter.
  void publish();
  // Pages created outside the lock reached the pool: wakes waiters short of pages.
  void created();
  // Waits (releasing the mutex) until nothing is in flight (no mapping, no page creation outside
  // the lock). Callers re-validate afterwards.
  void settle(Lock& lock);
  // Waits (releasing the mutex) until the work outside the lock now, if any, has published; the
  // prefetch thread may start another meanwhile. Callers re-validate afterwards.
  void await_publish(Lock& lock);

 private:
  const PagePool& pool_;
  Flight flight_;                   // at most one slot is mapped outside the lock at a time
  uint64_t publishes_ = 0;          // flights finished (published or given back), creations
  size_t waiters_ = 0;              // callers in settle() or await_publish()
  std::condition_variable settled_;
};

}  // namespace vattention
