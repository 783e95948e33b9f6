#include "core/background_mapper.h"

#include <chrono>
#include <exception>

namespace vattention {

void BackgroundMapper::record_error(std::exception_ptr error) {
  guard_.record_background_error(error);
  ++parts_.counters.prefetch_errors;
}

void BackgroundMapper::run(const Prefetcher::Job& job) {
  parts_.backend.bind_thread();
  for (size_t i = 0; i < job.size(); ++i) {
    if (job[i] == SlotTable::kUnlisted) continue;
    if (!map_slot(static_cast<int>(i), job[i])) return;
  }
  refill();
}

void BackgroundMapper::top_up(Lock& lock, Prefetcher& prefetcher) {
  if (parts_.pool.free_shortfall() == 0) return;
  lock.unlock();
  prefetcher.request_refill();
}

void BackgroundMapper::refill() {
  PagePool& pool = parts_.pool;
  Lock lock(guard_.mutex());
  // One page a round, and none while a caller waits for the thread (a step() that settles, or
  // set_memory_budget()): it waits for one page at most, and asks for the rest when it is done.
  while (!guard_.closed() && !guard_.failed() && !gate_.awaited() && pool.free_shortfall() > 0) {
    const uint64_t before = pool.pages_created();
    // No progress: the budget or the backend refused (not an error: step() raises only if its
    // own need cannot be met).
    if (!create_unlocked(lock, 1) || pool.pages_created() == before) return;
  }
}

bool BackgroundMapper::map_slot(int slot, int64_t target_tokens) {
  const CacheGeometry& geo = parts_.geo;
  CacheCounters& counters = parts_.counters;
  const Slot& s = parts_.slots[static_cast<size_t>(slot)];
  const size_t C = geo.columns();  // pages per page index
  size_t from = 0, to = 0;
  bool scrub = false;             // scrubber.enabled(), read under the lock
  bool tail = false;  // the tile rule: zero the new pages, the row's tail (read_tail.h)
  std::vector<PageHandle> pages;  // this thread's copy of the flight's pages, read unlocked
  // 1. plan, under the lock.
  {
    Lock lock(guard_.mutex());  // per slot, so callers interleave with a long prefetch
    if (guard_.closed() || guard_.failed()) return false;
    if (!s.use.active()) return true;
    to = geo.read_pages(target_tokens);  // the target's read end (read_tail.h)
    from = s.pages.mapped();
    if (to <= from) return true;
    const size_t free_pages = parts_.pool.free();
    if (free_pages < (to - from) * C && !create_unlocked(lock, (to - from) * C - free_pages)) {
      return false;
    }
    // The lock was dropped while creating: everything may have changed.
    if (guard_.closed() || guard_.failed()) return false;
    if (!s.use.active()) return true;
    from = s.pages.mapped();
    if (to <= from) return true;
    const std::vector<Growth> plan = {Growth{slot, from, to}};
    const uint64_t calls_before = parts_.driver_calls();
    scrub = parts_.scrubber.enabled();
    // Under the tile rule, pages past a row that is finite up to its mapped end are its tail to
    // be: zeroed here, without the lock, so the steps that reach them have nothing to zero. (A
    // token straddling the boundary into page `from` would be half zeroed: left to the step.)
    tail = geo.tile_tokens > 0 && s.pages.finite() == s.pages.backed() &&
           geo.first_token_at(from) == geo.tokens_in(from);
    const uint64_t created_before = parts_.pool.pages_created();
    const uint64_t ns_before = parts_.pool.create_ns();
    auto count = [&] {
      counters.prefetch_driver_calls += parts_.driver_calls() - calls_before;
      counters.background_pages_created += parts_.pool.pages_created() - created_before;
      counters.background_page_create_ns += parts_.pool.create_ns() - ns_before;
    };
    try {
      if (scrub || tail) parts_.scrubber.prepare(tail);
      // Creates pages itself only if another caller took the ones just created.
      pages = parts_.supply.obtain((to - from) * C, plan, false);
    } catch (const Error& e) {
      count();
      if (e.kind() == Error::Kind::OutOfPages) {
        // Not an error yet: step() raises only if the current need cannot be met.
        counters.prefetch_shortfall_pages += (to - from) * C;
      } else {
        record_error(std::current_exception());
      }
      return false;
    } catch (...) {
      count();
      record_error(std::current_exception());
      return false;
    }
    count();
    gate_.begin(slot, from, to, pages);
  }
  // 2. map, without the lock: rule R makes [from, to) of this slot ours alone.
  size_t calls = 0;
  std::exception_ptr error;
  try {
    calls = parts_.mapper.map_pages(slot, from, to, pages.data());
  } catch (...) {
    error = std::current_exception();  // map_pages unmapped what it mapped
  }
  if (!error && (scrub || tail)) {
    // The pages may hold a previous owner's K/V: zero them before anyone can see them, still
    // without the lock (rule R), so step() never waits behind the zeroing.
    try {
      parts_.scrubber.zero(slot, from, to);
    } catch (...) {
      error = std::current_exception();
      try {
        for (int t = 0; t < geo.num_tensors(); ++t) parts_.mapper.unmap_run(t, slot, from, to);
      } catch (...) {
        // Secondary failure while undoing: the first error is the one to report.
      }
    }
  }
  // 3. publish (or give the pages back), under the lock.
  Lock lock(guard_.mutex());
  gate_.publish();
  if (error) {
    for (PageHandle p : pages) parts_.pool.release(p);
    record_error(error);
    return false;
  }
  // Rule R: nothing grew or shrank the slot meanwhile; only its owner may have changed (free()).
  // A slot freed meanwhile now holds idle memory; free() queued it for eager reclamation if it
  // had pages then, else that is for now.
  parts_.memory.publish(slot, from, to, pages, calls);
  if (!s.use.active() && from == 0 && parts_.supply.policy() == ReclaimPolicy::Eager) {
    parts_.supply.queue_eager(slot);
  }
  if (scrub) parts_.scrubber.count((to - from) * C);
  // Nothing changed the row's finite tokens meanwhile (rule R; a step zeroes below `from`).
  if (tail && s.pages.finite() == geo.tokens_in(from)) {
    parts_.memory.set_finite(slot, s.pages.backed());
    for (int t = 0; t < geo.num_tensors(); ++t) {
      ++counters.tail_zero_calls;
      counters.tail_zeroed_bytes += (to - from) * geo.index_bytes(t);
    }
  }
  const bool keep_going = !guard_.closed();
  lock.unlock();
  // Populating is the slow part on the host (~0.5 ms per 2 MB page) and needs no cache state:
  // do it unlocked so step() never waits behind it. The range may be unmapped by then; the
  // backend tolerates that.
  parts_.mapper.prefault(slot, from, to);
  return keep_going;
}

bool BackgroundMapper::create_unlocked(Lock& lock, size_t n) {
  // cuMemCreate is the slowest VMM call (~193 us per 2 MB page on an A100): made under the lock it
  // would stall every step() behind it. The pages are counted against the budget first
  // (begin_create), so no caller can overshoot it meanwhile; they touch no cache state.
  PagePool& pool = parts_.pool;
  const size_t allowed = pool.begin_create(n);
  if (allowed == 0) return true;  // budget: obtain() reclaims or reports the shortfall
  lock.unlock();
  std::vector<PageHandle> made;
  std::exception_ptr error;
  const auto start = std::chrono::steady_clock::now();
  try {
    while (made.size() < allowed) made.push_back(parts_.backend.create_page());
  } catch (const Error& e) {
    if (e.kind() != Error::Kind::OutOfPages) error = std::current_exception();
  } catch (...) {
    error = std::current_exception();
  }
  const auto took = std::chrono::steady_clock::now() - start;
  lock.lock();
  pool.end_create(allowed, made);
  CacheCounters& counters = parts_.counters;
  counters.prefetch_driver_calls += made.size();
  counters.background_pages_created += made.size();
  counters.background_page_create_ns +=
      static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(took).count());
  gate_.created();
  if (error) {
    record_error(error);
    return false;
  }
  return true;
}

}  // namespace vattention
