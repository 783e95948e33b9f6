// KVCacheCore, background pre-mapping: prefetch() queues the next iteration's lengths (plus
// look-ahead) for the Prefetcher thread, which maps them slot by slot, each in three phases (plan
// locked, map unlocked, publish locked; prefetch_gate.h gives rule R, which keeps the unlocked
// phase safe). Running dry there is not an error (step() raises only if the current need cannot be
// met); any other failure is kept and raised, typed, by the next call on the cache.
#include <algorithm>

#include "core/kv_cache.h"

namespace vattention {

void KVCacheCore::prefetch(const std::vector<int64_t>& lens, int64_t lookahead_tokens) {
  Prefetcher::Job job(lens.size(), kUnlisted);
  {
    Lock lock = enter();
    slots_.validate_lens(lens, true);
    if (lookahead_tokens < -1) {
      throw Error(Error::Kind::Config,
                  "lookahead_tokens=" + std::to_string(lookahead_tokens) + " must be >= 0");
    }
    const int64_t ahead = lookahead_tokens < 0 ? lookahead_tokens_ : lookahead_tokens;
    bool work = false;
    for (size_t i = 0; i < lens.size(); ++i) {
      if (lens[i] == kUnlisted) continue;
      job[i] = std::min(geo_.max_seq, lens[i] + ahead);
      const Slot& s = slots_[i];
      work = work || (s.state == Slot::State::Active && geo_.pages_for(job[i]) > s.mapped);
    }
    // Most decode steps need no new page: waking the thread for nothing would cost a context
    // switch per step on a machine whose cores the model's threads keep busy.
    if (!work) return;
  }
  prefetcher_->submit(std::move(job));
}

void KVCacheCore::wait() {
  prefetcher_->wait();
  Lock lock = enter();
}

void KVCacheCore::run_prefetch(const Prefetcher::Job& job) {
  backend_->bind_thread();
  for (size_t i = 0; i < job.size(); ++i) {
    if (job[i] == kUnlisted) continue;
    if (!prefetch_slot(static_cast<int>(i), job[i])) return;
  }
}

bool KVCacheCore::prefetch_slot(int slot, int64_t target_tokens) {
  const size_t C = geo_.columns();  // pages per page index
  Slot& s = slots_[static_cast<size_t>(slot)];
  size_t from = 0, to = 0;
  bool scrub = false;             // scrubber_.enabled(), read under the lock
  std::vector<PageHandle> pages;  // this thread's copy of the flight's pages, read unlocked
  // 1. plan, under the lock.
  {
    Lock lock(mu_);  // per slot, so callers interleave with a long prefetch
    if (closed_ || background_error_) return false;
    if (s.state != Slot::State::Active) return true;
    to = geo_.pages_for(target_tokens);
    from = s.mapped;
    if (to <= from) return true;
    if (pool_.free() < (to - from) * C && !create_unlocked(lock, (to - from) * C - pool_.free())) {
      return false;
    }
    // The lock was dropped while creating: everything may have changed.
    if (closed_ || background_error_) return false;
    if (s.state != Slot::State::Active) return true;
    from = s.mapped;
    if (to <= from) return true;
    const std::vector<Growth> plan = {Growth{slot, from, to}};
    const uint64_t calls_before = driver_calls();
    scrub = scrubber_.enabled();
    try {
      if (scrub) scrubber_.prepare();
      // Creates pages itself only if another caller took the ones just created.
      pages = supply_.obtain((to - from) * C, plan, false);
    } catch (const Error& e) {
      counters_.prefetch_driver_calls += driver_calls() - calls_before;
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
    counters_.prefetch_driver_calls += driver_calls() - calls_before;
    gate_.begin(slot, from, to, pages);
  }
  // 2. map, without the lock: rule R makes [from, to) of this slot ours alone.
  size_t calls = 0;
  std::exception_ptr error;
  try {
    calls = mapper_.map_pages(slot, from, to, pages.data());
  } catch (...) {
    error = std::current_exception();  // map_pages unmapped what it mapped
  }
  if (!error && scrub) {
    // The pages may hold a previous owner's K/V: zero them before anyone can see them, still
    // without the lock (rule R), so step() never waits behind the zeroing.
    try {
      scrubber_.zero(slot, from, to);
    } catch (...) {
      error = std::current_exception();
      try {
        for (int t = 0; t < geo_.num_tensors(); ++t) mapper_.unmap_run(t, slot, from, to);
      } catch (...) {
        // Secondary failure while undoing: the first error is the one to report.
      }
    }
  }
  // 3. publish (or give the pages back), under the lock.
  Lock lock(mu_);
  gate_.publish();
  if (error) {
    for (PageHandle p : pages) pool_.release(p);
    record_background_error(error);
    return false;
  }
  // Rule R: nothing grew or shrank the slot meanwhile; only its state may have changed (free()).
  s.pages.insert(s.pages.end(), pages.begin(), pages.end());
  s.mapped = to;
  s.backed = geo_.tokens_in(to);
  // Anonymous look-ahead: the engine's fresh blocks adopt these pages (block_tables.h).
  if (blocks_.enabled()) s.blocks.resize(to * static_cast<size_t>(geo_.num_groups()), kNoBlock);
  if (s.state == Slot::State::Free) {
    // Freed with no pages while its first pages were being mapped: now it holds idle memory.
    s.state = Slot::State::Idle;
    if (supply_.policy() == ReclaimPolicy::Eager) supply_.queue_eager(slot);
  }
  counters_.map_calls += (to - from) * C;
  counters_.prefetch_map_calls += (to - from) * C;
  counters_.set_access_calls += static_cast<uint64_t>(geo_.num_tensors());
  counters_.prefetch_driver_calls += calls;
  if (scrub) scrubber_.count((to - from) * C);
  const bool keep_going = !closed_;
  lock.unlock();
  // Populating is the slow part on the host (~0.5 ms per 2 MB page) and needs no cache state:
  // do it unlocked so step() never waits behind it. The range may be unmapped by then; the
  // backend tolerates that.
  mapper_.prefault(slot, from, to);
  return keep_going;
}

bool KVCacheCore::create_unlocked(Lock& lock, size_t n) {
  // cuMemCreate is the slowest VMM call (~193 us per 2 MB page on an A100): made under the lock it
  // would stall every step() behind it. The pages are counted against the budget first
  // (begin_create), so no caller can overshoot it meanwhile; they touch no cache state.
  const size_t allowed = pool_.begin_create(n);
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
  pool_.end_create(allowed, made);
  counters_.prefetch_driver_calls += made.size();
  gate_.created();
  if (error) {
    record_background_error(error);
    return false;
  }
  return true;
}

}  // namespace vattention
