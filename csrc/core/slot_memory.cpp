#include "core/slot_memory.h"

#include <algorithm>
#include <vector>

#include "core/retry.h"

namespace vattention {
namespace {

class NoObserver final : public RowObserver {
 public:
  void grown(int /*slot*/, size_t /*mapped*/) override {}
  void cut(int /*slot*/, size_t /*keep*/) override {}
  void released(int /*slot*/, int /*tensor*/, size_t /*from*/, size_t /*to*/) override {}
};

}  // namespace

RowObserver& RowObserver::none() {
  static NoObserver none;
  return none;
}

SlotMemory::SlotMemory(const CacheGeometry& geometry, Backend& backend, const SlotMapper& mapper,
                       PagePool& pool, SlotTable& slots, CacheCounters& counters)
    : geo_(geometry),
      backend_(backend),
      mapper_(mapper),
      pool_(pool),
      slots_(slots),
      counters_(counters) {
  // A window's first release point depends on the geometry alone while nothing is released.
  for (size_t i = 0; i < slots_.size(); ++i) row(static_cast<int>(i)).refresh_release_at(geo_);
}

void SlotMemory::append(SlotPages& s, size_t from, size_t to, const PageHandle* pages,
                        const std::vector<size_t>& first) {
  const size_t T = static_cast<size_t>(geo_.num_tensors());
  s.handles_.insert(s.handles_.end(), pages, pages + (to - from) * geo_.columns());
  bool holes = false;
  for (size_t t = 0; t < T; ++t) holes = holes || first[t] > from;
  if (holes) {
    // Holes only extend a prefix that is already all holes (from == head(t), e.g. a fresh row).
    if (s.head_.empty()) s.head_.assign(T, 0);
    for (size_t t = 0; t < T; ++t) {
      if (first[t] > from) s.head_[t] = first[t];
    }
  }
  s.mapped_ = to;
  s.backed_ = geo_.tokens_in(to);
  s.refresh_ready(geo_);
  if (holes) s.refresh_release_at(geo_);
}

void SlotMemory::map(int slot, size_t from, size_t to, const PageHandle* pages) {
  const int T = geo_.num_tensors();
  const std::vector<size_t> first = mapper_.first_pages(from, to, pages);
  mapper_.map_pages(slot, from, to, pages);
  for (int t = 0; t < T; ++t) {
    const size_t begin = first[static_cast<size_t>(t)];
    if (begin == to) continue;
    const size_t mapped = (to - begin) * geo_.index_pages(t);
    counters_.map_calls += mapped;
    counters_.step_map_calls += mapped;
    ++counters_.set_access_calls;
    backend_.prefault(mapper_.page_va(t, slot, begin), (to - begin) * geo_.index_bytes(t));
  }
  append(row(slot), from, to, pages, first);
  observer_->grown(slot, to);
}

void SlotMemory::publish(int slot, size_t from, size_t to, const std::vector<PageHandle>& pages,
                         size_t driver_calls) {
  // Fresh pages from the pool: no holes.
  append(row(slot), from, to, pages.data(),
         std::vector<size_t>(static_cast<size_t>(geo_.num_tensors()), from));
  observer_->grown(slot, to);
  const size_t mapped = (to - from) * geo_.columns();
  counters_.map_calls += mapped;
  counters_.prefetch_map_calls += mapped;
  counters_.set_access_calls += static_cast<uint64_t>(geo_.num_tensors());
  counters_.prefetch_driver_calls += driver_calls;
}

size_t SlotMemory::unmap_tail(int slot, size_t keep) {
  SlotPages& s = row(slot);
  if (keep >= s.mapped_) return 0;
  const int T = geo_.num_tensors();
  const size_t C = geo_.columns();
  // Idle or active: a row alloc() handed to a new request still maps the old request's pages.
  wait_fence(slot);
  // Tensor t maps [max(keep, head(t)), mapped): released window pages are not unmapped again.
  auto begin = [&](int t) { return std::max(keep, s.head(static_cast<size_t>(t))); };
  int t = 0;
  try {
    for (; t < T; ++t) {
      if (begin(t) >= s.mapped_) continue;
      mapper_.unmap_run(t, slot, begin(t), s.mapped_);
      ++counters_.unmap_calls;
    }
  } catch (...) {
    // Put back what this call unmapped so the record stays true, then report.
    try {
      for (int u = 0; u < t; ++u) {
        size_t mapped = 0;
        if (begin(u) < s.mapped_) {
          mapper_.map_run(u, slot, begin(u), s.mapped_, &s.handles_[begin(u) * C], mapped);
        }
      }
    } catch (...) {
    }
    throw;
  }
  observer_->cut(slot, keep);
  // A shared page only loses a reference; count the pages that really reached the free list.
  const size_t free_before = pool_.free();
  for (size_t i = keep * C; i < s.handles_.size(); ++i) {
    if (s.handles_[i] != kNoPage) pool_.release(s.handles_[i]);
  }
  s.handles_.resize(keep * C);
  s.mapped_ = keep;
  s.backed_ = geo_.tokens_in(keep);
  s.finite_ = std::min(s.finite_, s.backed_);
  s.refresh_ready(geo_);
  if (!s.head_.empty()) {
    bool any = false;
    for (size_t& h : s.head_) {
      h = std::min(h, keep);
      any = any || h > 0;
    }
    if (!any) s.head_.clear();
    s.refresh_release_at(geo_);
  }
  return pool_.free() - free_before;
}

void SlotMemory::release_front(int slot, int tensor, size_t to) {
  SlotPages& s = row(slot);
  const size_t t = static_cast<size_t>(tensor);
  const size_t from = s.head(t);
  if (to <= from) return;
  wait_fence(slot);
  mapper_.unmap_run(tensor, slot, from, to);
  ++counters_.unmap_calls;
  const size_t C = geo_.columns();
  const size_t first = geo_.first_column(tensor), n = geo_.index_pages(tensor);
  for (size_t p = from; p < to; ++p) {
    for (size_t j = 0; j < n; ++j) {
      PageHandle& page = s.handles_[p * C + first + j];
      pool_.release(page);
      page = kNoPage;
    }
  }
  if (s.head_.empty()) s.head_.assign(static_cast<size_t>(geo_.num_tensors()), 0);
  s.head_[t] = to;
  s.refresh_release_at(geo_);
  observer_->released(slot, tensor, from, to);
}

PageHandle SlotMemory::replace_page(int slot, size_t k, PageHandle page) {
  SlotPages& s = row(slot);
  const size_t C = geo_.columns(), P = geo_.page_bytes;
  const uintptr_t va = mapper_.column_va(k % C, slot, k / C);
  const PageHandle old = s.handles_[k];
  wait_fence(slot);
  backend_.unmap(va, P);  // on failure nothing changed: `old` is still mapped at va
  ++counters_.unmap_calls;
  bool mapped = false;
  try {
    backend_.map(va, page);
    mapped = true;
    backend_.set_access(va, P);
  } catch (...) {
    // Undo exactly what was done, so the row maps `old` again as its record says.
    try {
      if (mapped) retry_once([&] { backend_.unmap(va, P); });
      retry_once([&] { backend_.map(va, old); });
      retry_once([&] { backend_.set_access(va, P); });
    } catch (...) {
    }
    throw;
  }
  counters_.map_calls += 1;
  counters_.set_access_calls += 1;
  s.handles_[k] = page;
  pool_.release(old);
  return old;
}

void SlotMemory::set_finite(int slot, int64_t tokens) {
  SlotPages& s = row(slot);
  s.finite_ = std::min(tokens, s.backed_);
  s.refresh_ready(geo_);
}

void SlotMemory::set_read_only(int slot, size_t pages) { row(slot).read_only_ = pages; }

std::string SlotMemory::check_read_only(const std::map<PageHandle, uint32_t>& seen) const {
  const size_t C = geo_.columns();
  for (size_t i = 0; i < slots_.size(); ++i) {
    const SlotPages& s = slots_[i].pages;
    const std::vector<PageHandle>& pages = s.handles();
    for (size_t k = s.read_only() * C; k < pages.size(); ++k) {
      if (pages[k] == kNoPage) continue;
      const auto held = seen.find(pages[k]);
      if (held != seen.end() && held->second > 1) {
        return "slot " + std::to_string(i) + " maps shared page " + std::to_string(pages[k]) +
               " at page index " + std::to_string(k / C) + ", outside its read-only prefix of " +
               std::to_string(s.read_only()) + " pages";
      }
    }
  }
  return "";
}

void SlotMemory::fence_on_free(int slot, uintptr_t stream) {
  SlotPages& s = row(slot);
  if (s.mapped_ == 0) return;
  const uint64_t fence = backend_.record_fence(stream);  // may throw: before any state change
  // Older fences (the row was reused before an unmapping waited for them): those that completed
  // guard nothing any more. One that cannot be polled or released now stays, as if pending.
  size_t kept = 0;
  for (const uint64_t old : s.fences_) {
    bool done = false;
    try {
      if (backend_.fence_done(old)) {
        backend_.fence_release(old);
        done = true;
      }
    } catch (...) {
    }
    if (!done) s.fences_[kept++] = old;
  }
  s.fences_.resize(kept);
  s.fences_.push_back(fence);  // no allocation after the row's first free(): the capacity stays
}

bool SlotMemory::fence_pending(int slot) const {
  for (uint64_t fence : slots_[static_cast<size_t>(slot)].pages.fences_) {
    if (!backend_.fence_done(fence)) return true;
  }
  return false;
}

void SlotMemory::wait_fence(int slot) {
  SlotPages& s = row(slot);
  if (s.fences_.empty()) return;  // the common case: no event query
  bool waited = false;
  for (uint64_t fence : s.fences_) {
    if (backend_.fence_done(fence)) continue;
    if (!waited) ++counters_.fence_waits;  // one unmapping that had to wait
    waited = true;
    backend_.fence_wait(fence);  // on failure the row keeps its fences: nothing is unmapped
  }
  forget_fence(slot);
}

void SlotMemory::forget_fence(int slot) {
  SlotPages& s = row(slot);
  // From the back, so a failed release leaves the fences not yet released with the row.
  while (!s.fences_.empty()) {
    backend_.fence_release(s.fences_.back());
    s.fences_.pop_back();
  }
}

void SlotMemory::sync_stream(uintptr_t stream) {
  const uint64_t fence = backend_.record_fence(stream);
  try {
    backend_.fence_wait(fence);
  } catch (...) {
    backend_.fence_release(fence);
    throw;
  }
  backend_.fence_release(fence);
}

}  // namespace vattention
