// BackgroundMapper: what the prefetch thread does with a job: maps each listed slot up to its
// target length, slot by slot, each in three phases (plan locked, map unlocked, publish locked;
// prefetch_gate.h gives rule R, which keeps the unlocked phase safe), and creates the pages the
// pool lacks without the lock first. Then it tops the pool's free pages up to the headroom
// (PagePool::free_target, KVCache.set_headroom), within the budget, one page at a time without
// the lock: a step() that arrives meanwhile finds those pages free instead of creating them on
// its critical path, and waits at most for the one creation under way (prefetch_gate.h): the
// refill stops while anyone waits for the thread, and the waiter's call asks for it again.
//
// Why: creating and mapping pages costs tens to hundreds of microseconds each on a GPU; done
// inline in step() it would stall every iteration that crosses a page boundary. While iteration N
// computes, this thread maps what iteration N+1 needs, so step() finds it already mapped.
//
// Running dry here is not an error (step() raises only if the current need cannot be met); any
// other failure is kept in the CacheGuard and raised, typed, by the next call on the cache. The
// rows it maps are published through SlotMemory, so a coordinator's own record of them follows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/cache_guard.h"
#include "core/cache_parts.h"
#include "core/prefetch_gate.h"
#include "core/prefetcher.h"

namespace vattention {

class BackgroundMapper {
 public:
  BackgroundMapper(CacheParts& parts, PrefetchGate& gate, CacheGuard& guard)
      : parts_(parts), gate_(gate), guard_(guard) {}
  BackgroundMapper(const BackgroundMapper&) = delete;
  BackgroundMapper& operator=(const BackgroundMapper&) = delete;

  using Lock = CacheGuard::Lock;

  // The job runner (the prefetch thread, without the cache mutex): every listed slot up to its
  // target tokens, then the headroom. Stops early when the cache closes, fails, or the pool runs
  // dry.
  void run(const Prefetcher::Job& job);
  // After a call that may leave the pool short of its headroom (step, free, prefetch, tune,
  // set_memory_budget), under the cache mutex: when it is short, releases the mutex and asks
  // `prefetcher` for a refill (kv_cache.h's lock order: never asked with the mutex held).
  void top_up(Lock& lock, Prefetcher& prefetcher);

 private:
  // One slot's three phases. Returns false when the job must stop.
  bool map_slot(int slot, int64_t target_tokens);
  // Creates up to n pages for the pool with the mutex released (held on entry and on return).
  // Returns false when the job must stop (a driver error, now the guard's background error).
  bool create_unlocked(Lock& lock, size_t n);
  // Creates free pages until the pool holds its headroom (or the budget, the backend, a close or
  // an error stops it).
  void refill();
  void record_error(std::exception_ptr error);

  CacheParts& parts_;
  PrefetchGate& gate_;
  CacheGuard& guard_;
};

}  // namespace vattention
