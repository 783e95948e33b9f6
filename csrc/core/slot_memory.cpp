#include "core/slot_memory.h"

#include <algorithm>
#include <vector>

namespace vattention {

void SlotMemory::map(Slot& s, int index, size_t from, size_t to, const PageHandle* pages,
                     bool from_prefetch) {
  const int T = geo_.num_tensors();
  const size_t count = to - from;
  const std::vector<size_t> first = mapper_.first_pages(from, to, pages);
  mapper_.map_pages(index, from, to, pages);
  bool holes = false;
  for (int t = 0; t < T; ++t) {
    const size_t begin = first[static_cast<size_t>(t)];
    holes = holes || begin > from;
    if (begin == to) continue;
    const size_t mapped = (to - begin) * geo_.index_pages(t);
    counters_.map_calls += mapped;
    (from_prefetch ? counters_.prefetch_map_calls : counters_.step_map_calls) += mapped;
    ++counters_.set_access_calls;
    // The prefetch thread populates after dropping the lock, not here.
    if (!from_prefetch) {
      backend_.prefault(mapper_.page_va(t, index, begin), (to - begin) * geo_.index_bytes(t));
    }
  }
  s.pages.insert(s.pages.end(), pages, pages + count * geo_.columns());
  if (holes) {
    // Holes only extend a prefix that is already all holes (from == head[t], e.g. a fresh slot).
    if (s.head.empty()) s.head.assign(static_cast<size_t>(T), 0);
    for (size_t t = 0; t < static_cast<size_t>(T); ++t) {
      if (first[t] > from) s.head[t] = first[t];
    }
  }
  s.mapped = to;
  s.backed = geo_.tokens_in(to);
  if (blocks_.enabled()) s.blocks.resize(to * static_cast<size_t>(geo_.num_groups()), kNoBlock);
  if (holes) s.refresh_release_at(geo_);
}

size_t SlotMemory::unmap_tail(Slot& s, int index, size_t keep) {
  if (keep >= s.mapped) return 0;
  const int T = geo_.num_tensors();
  const size_t C = geo_.columns();
  if (s.state == Slot::State::Idle) wait_fence(s);
  // Tensor t maps [max(keep, head[t]), mapped): released window pages are not unmapped again.
  auto begin = [&](int t) { return std::max(keep, s.head_of(static_cast<size_t>(t))); };
  int t = 0;
  try {
    for (; t < T; ++t) {
      if (begin(t) >= s.mapped) continue;
      mapper_.unmap_run(t, index, begin(t), s.mapped);
      ++counters_.unmap_calls;
    }
  } catch (...) {
    // Put back what this call unmapped so the slot's record stays true, then report.
    try {
      for (int u = 0; u < t; ++u) {
        size_t mapped = 0;
        if (begin(u) < s.mapped) {
          mapper_.map_run(u, index, begin(u), s.mapped, &s.pages[begin(u) * C], mapped);
        }
      }
    } catch (...) {
    }
    throw;
  }
  // The engine blocks mapped in the range lose this row's mapping (without caching a block forgets
  // its pages with its last one: the references released below are then their last).
  const size_t G = static_cast<size_t>(geo_.num_groups());
  for (size_t k = keep * G; k < s.blocks.size(); ++k) {
    if (s.blocks[k] != kNoBlock) blocks_.unmapped(s.blocks[k]);
  }
  if (!s.blocks.empty()) s.blocks.resize(keep * G);
  // A shared page only loses a reference; count the pages that really reached the free list.
  const size_t free_before = pool_.free();
  for (size_t i = keep * C; i < s.pages.size(); ++i) {
    if (s.pages[i] != kNoPage) pool_.release(s.pages[i]);
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
    s.refresh_release_at(geo_);
  }
  if (s.state == Slot::State::Idle && keep == 0) s.state = Slot::State::Free;
  return pool_.free() - free_before;
}

void SlotMemory::wait_fence(Slot& s) {
  if (!s.has_fence) return;
  if (!backend_.fence_done(s.fence)) {
    ++counters_.fence_waits;
    backend_.fence_wait(s.fence);
  }
  backend_.fence_release(s.fence);
  s.has_fence = false;
}

void SlotMemory::forget_fence(Slot& s) {
  if (!s.has_fence) return;
  backend_.fence_release(s.fence);
  s.has_fence = false;
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
