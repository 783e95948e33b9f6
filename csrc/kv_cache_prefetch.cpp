// KVCacheCore, background pre-mapping: prefetch() queues the next iteration's lengths (plus
// look-ahead) for the Prefetcher thread, which maps them slot by slot. Running dry there is not an
// error (step() raises only if the current need cannot be met); any other failure is kept and
// raised, typed, by the next call on the cache.
//
// Why the driver calls run without the cache mutex (issue 13): on a GPU, mapping one slot's
// crossing is T x (cuMemMap + cuMemSetAccess), ~40 us each on an A100; holding mu_ meanwhile made
// every step() that arrived wait behind the driver. So each slot goes through three phases:
//   1. plan (locked): take the pages from the pool and mark page indices [from, to) of the slot
//      "in flight" (inflight_), where from == slot.mapped;
//   2. map (unlocked): cuMemMap each page and cuMemSetAccess each tensor's run (map_pages);
//   3. publish (locked): append the pages to the slot, clear inflight_, notify settled_.
// Pages the pool lacks are created before phase 1 takes them, also without the lock
// (create_unlocked: counted against the budget first, added to the free list after).
// The argument that nothing else can go wrong meanwhile is one rule, kept by every path that maps
// or unmaps slot memory:
//   R. While a slot is in flight, only the prefetch thread maps or unmaps inside it at or above
//      `from`, and nothing shrinks the slot below `from` (so slot.mapped == from at publish).
// Who would break R, and what each does instead:
//   - step() growing that slot waits for that publish only (it needs those pages: not a wasted
//     wait; await_publish, so the thread going on to the next slot does not hold it up);
//     step() growing other slots maps them in parallel, unlocked driver calls are independent.
//   - reclaiming/trimming (obtain -> release_spare, drain_eager) skips the slot in flight, and
//     spare_pages()/freeable_spare() do not count its pages; reclaim() and set_memory_budget()
//     settle first (they are not on the decode path).
//   - fork, share_prefix, ensure_private, swap_out, swap_in settle first (they may map, unmap or
//     pick that slot); alloc() waits for the publish when the slot in flight was freed (it may
//     pick it; the thread never starts mapping a slot that is not active).
//   - free() only changes the slot's state: a range published onto an idle slot is idle memory
//     (reclaimed later behind the free() fence, as any idle page), onto a free one makes it idle.
//     No stream can read the in-flight pages before publish (step() never reported them backed),
//     so the fence rule ("never unmap what a stream may still read") is not at stake in phase 2.
//   - close() stops the prefetcher (joins the thread) before it takes mu_: nothing is in flight.
// So no range is mapped twice (the emulation would count a violation), every in-flight page is
// either published into the slot or, on a driver error, unmapped by map_pages and returned to the
// pool, and check_invariants() counts in-flight pages as in use.
#include <algorithm>

#include "kv_cache.h"

namespace vattention {

void KVCacheCore::prefetch(const std::vector<int64_t>& lens, int64_t lookahead_tokens) {
  Prefetcher::Job job(lens.size(), kUnlisted);
  {
    Lock lock(mu_);
    check_open();
    rethrow_background_error();
    validate_lens(lens, true);
    if (lookahead_tokens < -1) {
      throw Error(Error::Kind::Config, "lookahead_tokens=" + std::to_string(lookahead_tokens) +
                                           " must be >= 0");
    }
    const int64_t ahead = lookahead_tokens < 0 ? lookahead_tokens_ : lookahead_tokens;
    for (size_t i = 0; i < lens.size(); ++i) {
      if (lens[i] != kUnlisted) job[i] = std::min(geo_.max_seq, lens[i] + ahead);
    }
  }
  prefetcher_->submit(std::move(job));
}

void KVCacheCore::run_prefetch(const Prefetcher::Job& job) {
  backend_->bind_thread();
  for (size_t i = 0; i < job.size(); ++i) {
    if (job[i] == kUnlisted) continue;
    if (!prefetch_slot(static_cast<int>(i), job[i])) return;
  }
}

bool KVCacheCore::prefetch_slot(int slot, int64_t target_tokens) {
  const size_t T = static_cast<size_t>(geo_.num_tensors());
  const size_t C = geo_.columns();  // pages per page index
  Slot& s = slots_[static_cast<size_t>(slot)];
  size_t from = 0, to = 0;
  bool scrub = false;             // scrub_, read under the lock
  std::vector<PageHandle> pages;  // this thread's copy of inflight_.pages, read unlocked
  // 1. plan, under the lock.
  {
    Lock lock(mu_);  // per slot, so callers interleave with a long prefetch
    if (closed_ || background_error_) return false;
    if (s.state != Slot::State::Active) return true;
    to = geo_.pages_for(target_tokens);
    from = s.mapped;
    if (to <= from) return true;
    if (pool_->free() < (to - from) * C && !create_unlocked(lock, (to - from) * C - pool_->free())) {
      return false;
    }
    // The lock was dropped while creating: everything may have changed.
    if (closed_ || background_error_) return false;
    if (s.state != Slot::State::Active) return true;
    from = s.mapped;
    if (to <= from) return true;
    const std::vector<Growth> plan = {Growth{slot, from, to}};
    const uint64_t calls_before = vmm_calls();
    scrub = scrub_;
    try {
      if (scrub) prepare_scrub();
      // Creates pages itself only if another caller took the ones just created.
      inflight_.pages = obtain((to - from) * C, plan, false);
    } catch (const Error& e) {
      counters_.prefetch_driver_calls += vmm_calls() - calls_before;
      if (e.kind() == Error::Kind::OutOfPages) {
        // Not an error yet: step() raises only if the current need cannot be met.
        counters_.prefetch_shortfall_pages += (to - from) * C;
      } else {
        record_background_error(std::current_exception());
      }
      return false;
    } catch (...) {
      record_background_error(std::current_exception());
      return false;
    }
    counters_.prefetch_driver_calls += vmm_calls() - calls_before;
    inflight_.slot = slot;
    inflight_.from = from;
    inflight_.to = to;
    pages = inflight_.pages;
  }
  // 2. map, without the lock: rule R (top of file) makes [from, to) of this slot ours alone.
  size_t calls = 0;
  std::exception_ptr error;
  try {
    calls = map_pages(slot, from, to, pages.data());
  } catch (...) {
    error = std::current_exception();  // map_pages unmapped what it mapped
  }
  if (!error && scrub) {
    // The pages may hold a previous owner's K/V: zero them before anyone can see them, still
    // without the lock (rule R), so step() never waits behind the zeroing.
    try {
      zero_pages(slot, from, to);
    } catch (...) {
      error = std::current_exception();
      try {
        for (int t = 0; t < geo_.num_tensors(); ++t) {
          backend_->unmap(page_va(t, slot, from), (to - from) * geo_.index_bytes(t));
        }
      } catch (...) {
        // Secondary failure while undoing: the first error is the one to report.
      }
    }
  }
  // 3. publish (or give the pages back), under the lock.
  Lock lock(mu_);
  inflight_ = InFlight{};
  ++publishes_;
  settled_.notify_all();
  if (error) {
    for (PageHandle p : pages) pool_->release(p);
    record_background_error(error);
    return false;
  }
  // Rule R: nothing grew or shrank the slot meanwhile; only its state may have changed (free()).
  s.pages.insert(s.pages.end(), pages.begin(), pages.end());
  s.mapped = to;
  s.backed = geo_.tokens_in(to);
  if (s.state == Slot::State::Free) {
    // Freed with no pages while its first pages were being mapped: now it holds idle memory.
    s.state = Slot::State::Idle;
    if (policy_ == ReclaimPolicy::Eager) eager_pending_.push_back(slot);
  }
  counters_.map_calls += (to - from) * C;
  counters_.prefetch_map_calls += (to - from) * C;
  counters_.set_access_calls += T;
  counters_.prefetch_driver_calls += calls;
  if (scrub) scrubbed_pages_ += (to - from) * C;
  const bool keep_going = !closed_;
  lock.unlock();
  // Populating is the slow part on the host (~0.5 ms per 2 MB page) and needs no cache state:
  // do it unlocked so step() never waits behind it. The range may be unmapped by then; the
  // backend tolerates that.
  for (int t = 0; t < geo_.num_tensors(); ++t) {
    backend_->prefault(page_va(t, slot, from), (to - from) * geo_.index_bytes(t));
  }
  return keep_going;
}

bool KVCacheCore::create_unlocked(Lock& lock, size_t n) {
  // cuMemCreate is the slowest VMM call (~193 us per 2 MB page on an A100): made under the lock it
  // would stall every step() behind it. The pages are counted against the budget first
  // (begin_create), so no caller can overshoot it meanwhile; they touch no cache state.
  const size_t allowed = pool_->begin_create(n);
  if (allowed == 0) return true;  // budget: obtain() reclaims or reports the shortfall
  lock.unlock();
  std::vector<PageHandle> made;
  std::exception_ptr error;
  try {
    while (made.size() < allowed) made.push_back(backend_->create_page());
  } catch (const Error& e) {
    if (e.kind() != Error::Kind::OutOfPages) error = std::current_exception();
  } catch (...) {
    error = std::current_exception();
  }
  lock.lock();
  pool_->end_create(allowed, made);
  counters_.prefetch_driver_calls += made.size();
  ++publishes_;  // wakes await_publish()/settle() callers waiting for pages
  settled_.notify_all();
  if (error) {
    record_background_error(error);
    return false;
  }
  return true;
}

void KVCacheCore::record_background_error(std::exception_ptr error) {
  background_error_ = error;
  ++counters_.prefetch_errors;
}

void KVCacheCore::wait() {
  prefetcher_->wait();
  Lock lock(mu_);
  check_open();
  rethrow_background_error();
}

void KVCacheCore::set_lookahead(int64_t tokens) {
  if (tokens < 0) {
    throw Error(Error::Kind::Config, "lookahead_tokens=" + std::to_string(tokens) + " must be >= 0");
  }
  std::lock_guard<std::mutex> lock(mu_);
  lookahead_tokens_ = tokens;
}

}  // namespace vattention
