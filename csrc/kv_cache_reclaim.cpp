// KVCacheCore, physical memory: where a step's pages come from and how they go back.
//
// Order of supply (DESIGN.md section 3, issue 4): the pool's free list, new pages within the
// budget, then idle slots' pages (least recently freed first), then look-ahead pages of active
// slots beyond their lengths. Nothing is taken from a slot before the whole need is known to be
// satisfiable, so OutOfPages leaves every slot as it was. Unmapping waits for the fence recorded
// at free(): unmapping is not stream-ordered on CUDA.
#include <algorithm>
#include <limits>

#include "kv_cache.h"

namespace vattention {
namespace {

Error out_of_pages(const std::string& what, size_t needed, size_t available, size_t page_bytes) {
  return Error(Error::Kind::OutOfPages,
               what + " needs " + std::to_string(needed) + " more pages of " +
                   std::to_string(page_bytes) + " bytes, but only " + std::to_string(available) +
                   " can be had (free, creatable within the budget, or reclaimable); nothing was "
                   "mapped: preempt a request or raise the memory budget")
      .with("pages_needed", static_cast<int64_t>(needed))
      .with("pages_available", static_cast<int64_t>(available));
}

}  // namespace

void KVCacheCore::drain_eager() {
  if (eager_pending_.empty()) return;
  std::vector<int> still;
  for (int i : eager_pending_) {
    Slot& s = slots_[static_cast<size_t>(i)];
    if (s.state != Slot::State::Idle) continue;  // reallocated meanwhile: nothing to reclaim
    if (in_flight(static_cast<size_t>(i)) || (s.has_fence && !backend_->fence_done(s.fence))) {
      // In flight: the prefetch thread is mapping above its pages (rule R, kv_cache_prefetch.cpp).
      still.push_back(i);
      continue;
    }
    counters_.reclaimed_pages += unmap_tail(s, i, 0);
  }
  eager_pending_.swap(still);
}

size_t KVCacheCore::spare_pages(const std::vector<Growth>& plan, bool allow_trim) const {
  if (any_sharing()) return freeable_spare(plan, allow_trim);
  const size_t C = geo_.columns();
  size_t spare = 0;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    if (in_flight(i)) continue;  // never shrunk while mapped outside the lock (rule R)
    if (s.state == Slot::State::Idle) {
      spare += s.live_pages(geo_);
    } else if (allow_trim && s.state == Slot::State::Active) {
      bool growing = std::any_of(plan.begin(), plan.end(),
                                 [&](const Growth& g) { return g.slot == static_cast<int>(i); });
      const size_t keep = geo_.pages_for(s.seq_len);
      if (!growing && s.mapped > keep) spare += (s.mapped - keep) * C;
    }
  }
  return spare;
}

size_t KVCacheCore::release_spare(size_t n, const std::vector<Growth>& plan, bool allow_trim) {
  const size_t C = geo_.columns();
  size_t released = 0;
  while (released < n) {
    // Idle slots first, least recently freed first.
    int victim = -1;
    for (size_t i = 0; i < slots_.size(); ++i) {
      const Slot& s = slots_[i];
      if (in_flight(i)) continue;  // rule R, kv_cache_prefetch.cpp
      if (s.state == Slot::State::Idle && s.mapped > 0 &&
          (victim < 0 || s.freed_at < slots_[static_cast<size_t>(victim)].freed_at)) {
        victim = static_cast<int>(i);
      }
    }
    size_t keep_floor = 0;
    if (victim < 0 && allow_trim) {
      // Then look-ahead of active slots beyond their length, largest excess first.
      size_t best_excess = 0;
      for (size_t i = 0; i < slots_.size(); ++i) {
        const Slot& s = slots_[i];
        if (s.state != Slot::State::Active || in_flight(i)) continue;
        if (std::any_of(plan.begin(), plan.end(),
                        [&](const Growth& g) { return g.slot == static_cast<int>(i); })) {
          continue;
        }
        const size_t keep = geo_.pages_for(s.seq_len);
        if (s.mapped > keep && s.mapped - keep > best_excess) {
          best_excess = s.mapped - keep;
          victim = static_cast<int>(i);
          keep_floor = keep;
        }
      }
    }
    if (victim < 0) break;
    Slot& s = slots_[static_cast<size_t>(victim)];
    const size_t want = (n - released + C - 1) / C;
    const size_t keep = std::max(keep_floor, s.mapped > want ? s.mapped - want : 0);
    released += unmap_tail(s, victim, keep);
  }
  counters_.reclaimed_pages += released;
  return released;
}

std::vector<PageHandle> KVCacheCore::obtain(size_t n, const std::vector<Growth>& plan, bool allow_trim) {
  // Counting reclaimable pages walks every mapping, so it is done only when the free list and the
  // budget fall short (never without a budget until the backend itself refuses pages).
  const size_t headroom = pool_->headroom();
  if (headroom != std::numeric_limits<size_t>::max() && pool_->free() + headroom < n) {
    const size_t spare = spare_pages(plan, allow_trim);
    if (pool_->free() + headroom + spare < n) {
      throw out_of_pages("this call", n, pool_->free() + headroom + spare, geo_.page_bytes);
    }
  }
  const uint64_t created_before = pool_->pages_created();
  std::vector<PageHandle> got = pool_->take(n);
  if (got.size() < n) {
    const size_t missing = n - got.size();
    const size_t spare = spare_pages(plan, allow_trim);
    if (missing > spare) {
      pool_->untake(got, static_cast<size_t>(pool_->pages_created() - created_before));
      throw out_of_pages("this call", n, got.size() + spare, geo_.page_bytes);
    }
    release_spare(missing, plan, allow_trim);
    std::vector<PageHandle> more = pool_->take(missing);
    got.insert(got.end(), more.begin(), more.end());
    if (got.size() < n) {
      pool_->untake(got, 0);
      throw out_of_pages("this call", n, got.size(), geo_.page_bytes);
    }
  }
  return got;
}

void KVCacheCore::wait_fence(Slot& s) {
  if (!s.has_fence) return;
  if (!backend_->fence_done(s.fence)) {
    ++counters_.fence_waits;
    backend_->fence_wait(s.fence);
  }
  backend_->fence_release(s.fence);
  s.has_fence = false;
}

size_t KVCacheCore::unmap_tail(Slot& s, int index, size_t keep) {
  if (keep >= s.mapped) return 0;
  const int T = geo_.num_tensors();
  const size_t C = geo_.columns();
  if (s.state == Slot::State::Idle) wait_fence(s);
  // Tensor t maps [max(keep, head[t]), mapped): released window pages are not unmapped again.
  auto begin = [&](int t) { return std::max(keep, head_of(s, static_cast<size_t>(t))); };
  int t = 0;
  try {
    for (; t < T; ++t) {
      if (begin(t) >= s.mapped) continue;
      backend_->unmap(page_va(t, index, begin(t)), (s.mapped - begin(t)) * geo_.index_bytes(t));
      ++counters_.unmap_calls;
    }
  } catch (...) {
    // Put back what this call unmapped so the slot's record stays true, then report.
    try {
      for (int u = 0; u < t; ++u) {
        size_t mapped = 0;
        if (begin(u) < s.mapped) map_run(u, index, begin(u), s.mapped, &s.pages[begin(u) * C], mapped);
      }
    } catch (...) {
    }
    throw;
  }
  // A shared page only loses a reference; count the pages that really reached the free list.
  const size_t free_before = pool_->free();
  for (size_t i = keep * C; i < s.pages.size(); ++i) {
    if (s.pages[i] != kNoPage) pool_->release(s.pages[i]);
  }
  s.pages.resize(keep * C);
  s.mapped = keep;
  s.backed = geo_.tokens_in(keep);
  if (!s.head.empty()) {
    bool any = false;
    for (size_t& h : s.head) {
      h = std::min(h, keep);
      any = any || h > 0;
    }
    if (!any) s.head.clear();
    refresh_release_at(s);
  }
  if (s.state == Slot::State::Idle && keep == 0) s.state = Slot::State::Free;
  return pool_->free() - free_before;
}

// ---- pool management ----------------------------------------------------------------------------

void KVCacheCore::reserve(size_t bytes) {
  Lock lock(mu_);
  check_open();
  rethrow_background_error();
  // Overflow-safe rounding up; no cache can use more pages than its virtual tensors hold.
  const size_t pages = bytes / geo_.page_bytes + (bytes % geo_.page_bytes != 0 ? 1 : 0);
  const size_t usable = geo_.virtual_bytes() / geo_.page_bytes;
  if (pages > usable) {
    throw Error(Error::Kind::Config,
                "reserve of " + std::to_string(bytes) + " bytes (" + std::to_string(pages) +
                    " pages) exceeds what this cache can ever map: " + std::to_string(usable) +
                    " pages of " + std::to_string(geo_.page_bytes) + " bytes (its virtual size, " +
                    std::to_string(usable * geo_.page_bytes) + " bytes)")
        .with("bytes", static_cast<int64_t>(bytes > INT64_MAX ? INT64_MAX : bytes))
        .with("pages_possible", static_cast<int64_t>(usable));
  }
  try {
    pool_->reserve(pages);
  } catch (const Error& e) {
    if (e.kind() == Error::Kind::OutOfPages) ++counters_.oom_events;
    throw;
  }
}

size_t KVCacheCore::reclaim() {
  Lock lock(mu_);
  settle(lock);  // a slot freed while being mapped is reclaimed too (rule R)
  check_open();
  rethrow_background_error();
  size_t released = 0;
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    if (s.state != Slot::State::Idle) continue;
    released += s.live_pages(geo_);  // mappings, as documented
    counters_.reclaimed_pages += unmap_tail(s, static_cast<int>(i), 0);
  }
  return released;
}

size_t KVCacheCore::shrink(size_t keep_bytes) {
  Lock lock(mu_);
  check_open();
  rethrow_background_error();
  return pool_->shrink(keep_bytes);
}

int64_t KVCacheCore::set_memory_budget(int64_t budget_bytes) {
  Lock lock(mu_);
  settle(lock);  // pages in flight count against the budget and cannot be trimmed until published
  check_open();
  rethrow_background_error();
  const int64_t old_budget = pool_->budget_bytes();
  pool_->set_budget(budget_bytes);
  if (budget_bytes < 0) return 0;
  const size_t budget = static_cast<size_t>(budget_bytes);
  try {
    pool_->shrink(budget);
    while (pool_->total() * geo_.page_bytes > budget) {
      const size_t over_pages = (pool_->total() * geo_.page_bytes - budget + geo_.page_bytes - 1) / geo_.page_bytes;
      if (release_spare(over_pages, {}, true) == 0) break;
      pool_->shrink(budget);
    }
  } catch (...) {
    pool_->set_budget(old_budget);  // reclaimed idle/look-ahead pages stay free: invisible state
    throw;
  }
  const size_t held = pool_->total() * geo_.page_bytes;
  return held > budget ? static_cast<int64_t>(held - budget) : 0;
}

}  // namespace vattention
