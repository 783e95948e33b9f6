#include "core/page_supply.h"

#include <algorithm>
#include <limits>
#include <unordered_map>

namespace vattention {
namespace {

bool growing(const std::vector<Growth>& plan, size_t slot) {
  return std::any_of(plan.begin(), plan.end(),
                     [&](const Growth& g) { return g.slot == static_cast<int>(slot); });
}

}  // namespace

PageSupply::PageSupply(const CacheGeometry& geometry, PagePool& pool, const SlotTable& slots,
                       const PrefetchGate& gate, SlotMemory& memory, CacheCounters& counters,
                       ReclaimPolicy policy)
    : geo_(geometry),
      pool_(pool),
      slots_(slots),
      gate_(gate),
      memory_(memory),
      counters_(counters),
      policy_(policy) {}

Error PageSupply::out_of_pages(size_t needed, size_t available) const {
  return Error(Error::Kind::OutOfPages,
               "this call needs " + std::to_string(needed) + " more pages of " +
                   std::to_string(geo_.page_bytes) + " bytes, but only " +
                   std::to_string(available) +
                   " can be had (free, creatable within the budget, or reclaimable); nothing was "
                   "mapped: preempt a request or raise the memory budget")
      .with("pages_needed", static_cast<int64_t>(needed))
      .with("pages_available", static_cast<int64_t>(available));
}

void PageSupply::drain_eager() {
  if (eager_pending_.empty()) return;
  std::vector<int> still;
  for (int i : eager_pending_) {
    // Reallocated meanwhile (or its pages already went): nothing to reclaim.
    if (slots_[static_cast<size_t>(i)].state() != Slot::State::Idle) continue;
    if (gate_.in_flight(static_cast<size_t>(i)) || memory_.fence_pending(i)) {
      still.push_back(i);  // in flight: the prefetch thread maps above its pages (rule R)
      continue;
    }
    counters_.reclaimed_pages += memory_.unmap_tail(i, 0);
  }
  eager_pending_.swap(still);
}

size_t PageSupply::keep_pages(size_t i, const std::vector<int64_t>* lens) const {
  int64_t len = slots_[i].use.seq_len();
  if (lens != nullptr && (*lens)[i] != SlotTable::kUnlisted) len = std::max(len, (*lens)[i]);
  return geo_.read_pages(len);
}

size_t PageSupply::spare(const std::vector<Growth>& plan, bool allow_trim,
                         const std::vector<int64_t>* lens) const {
  if (pool_.extra_refs() > 0) return freeable_spare(plan, allow_trim, lens);
  const size_t C = geo_.columns();
  size_t spare = 0;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    if (gate_.in_flight(i)) continue;  // never shrunk while mapped outside the lock (rule R)
    if (s.state() == Slot::State::Idle) {
      spare += s.pages.live(geo_);
    } else if (allow_trim && s.use.active() && !growing(plan, i)) {
      const size_t keep = keep_pages(i, lens);
      if (s.pages.mapped() > keep) spare += (s.pages.mapped() - keep) * C;
    }
  }
  return spare;
}

size_t PageSupply::freeable_spare(const std::vector<Growth>& plan, bool allow_trim,
                                  const std::vector<int64_t>* lens) const {
  // A page returns to the pool only if every reference to it is a reclaimable mapping.
  const size_t C = geo_.columns();
  std::unordered_map<PageHandle, uint32_t> reclaimable;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    if (gate_.in_flight(i)) continue;  // never shrunk while mapped outside the lock (rule R)
    size_t from = s.pages.mapped();
    if (s.state() == Slot::State::Idle) {
      from = 0;
    } else if (allow_trim && s.use.active() && !growing(plan, i)) {
      from = std::min(s.pages.mapped(), keep_pages(i, lens));
    }
    const std::vector<PageHandle>& handles = s.pages.handles();
    for (size_t k = from * C; k < handles.size(); ++k) {
      if (handles[k] != kNoPage) ++reclaimable[handles[k]];
    }
  }
  size_t spare = 0;
  for (const auto& entry : reclaimable) {
    if (entry.second == pool_.refs(entry.first)) ++spare;
  }
  return spare;
}

size_t PageSupply::release_spare(size_t n, const std::vector<Growth>& plan, bool allow_trim) {
  const size_t C = geo_.columns();
  // While some page has a second reference, an idle row may hold only pages others hold too (an
  // engine's cached blocks, kept for a prefix hit in place): unmapping it frees nothing, so such
  // rows come last. Without one, every idle row frees what it maps.
  const bool shared = pool_.extra_refs() > 0;
  auto frees_alone = [&](const Slot& s) {
    if (!shared) return true;
    for (PageHandle h : s.pages.handles()) {
      if (h != kNoPage && pool_.refs(h) == 1) return true;
    }
    return false;
  };
  // The idle row least recently freed (of those that free pages alone, with `alone`).
  auto idle_victim = [&](bool alone) {
    int victim = -1;
    for (size_t i = 0; i < slots_.size(); ++i) {
      const Slot& s = slots_[i];
      if (gate_.in_flight(i)) continue;  // rule R
      if (s.state() == Slot::State::Idle &&
          (victim < 0 || s.use.freed_at() < slots_[static_cast<size_t>(victim)].use.freed_at()) &&
          (!alone || frees_alone(s))) {
        victim = static_cast<int>(i);
      }
    }
    return victim;
  };
  size_t released = 0;
  while (released < n) {
    // Idle slots first, least recently freed first.
    int victim = idle_victim(true);
    size_t keep_floor = 0;
    if (victim < 0 && allow_trim) {
      // Then look-ahead of active slots beyond their length, largest excess first.
      size_t best_excess = 0;
      for (size_t i = 0; i < slots_.size(); ++i) {
        const Slot& s = slots_[i];
        if (!s.use.active() || gate_.in_flight(i) || growing(plan, i)) continue;
        const size_t keep = geo_.read_pages(s.use.seq_len());
        const size_t mapped = s.pages.mapped();
        if (mapped > keep && mapped - keep > best_excess) {
          best_excess = mapped - keep;
          victim = static_cast<int>(i);
          keep_floor = keep;
        }
      }
    }
    // Last, idle rows whose pages are held elsewhere too: together they may free some.
    if (victim < 0) victim = idle_victim(false);
    if (victim < 0) break;
    const size_t mapped = slots_[static_cast<size_t>(victim)].pages.mapped();
    const size_t want = (n - released + C - 1) / C;
    const size_t keep = std::max(keep_floor, mapped > want ? mapped - want : 0);
    released += memory_.unmap_tail(victim, keep);
  }
  counters_.reclaimed_pages += released;
  return released;
}

std::vector<PageHandle> PageSupply::obtain(size_t n, const std::vector<Growth>& plan,
                                           bool allow_trim) {
  // Counting reclaimable pages walks every mapping, so it is done only when the free list and the
  // budget fall short (never without a budget until the backend itself refuses pages).
  const size_t headroom = pool_.headroom();
  if (headroom != std::numeric_limits<size_t>::max() && pool_.free() + headroom < n) {
    const size_t have = spare(plan, allow_trim);
    if (pool_.free() + headroom + have < n) {
      throw out_of_pages(n, pool_.free() + headroom + have);
    }
  }
  const uint64_t created_before = pool_.pages_created();
  std::vector<PageHandle> got = pool_.take(n);
  if (got.size() < n) {
    const size_t missing = n - got.size();
    const size_t have = spare(plan, allow_trim);
    if (missing > have) {
      pool_.untake(got, static_cast<size_t>(pool_.pages_created() - created_before));
      throw out_of_pages(n, got.size() + have);
    }
    release_spare(missing, plan, allow_trim);
    std::vector<PageHandle> more = pool_.take(missing);
    got.insert(got.end(), more.begin(), more.end());
    if (got.size() < n) {
      pool_.untake(got, 0);
      throw out_of_pages(n, got.size());
    }
  }
  return got;
}

}  // namespace vattention
