#include "core/preemption.h"

#include <algorithm>
#include <unordered_map>

namespace vattention {

std::vector<int> pick_victims(const SlotTable& slots, const PagePool& pool, size_t page_bytes,
                              size_t bytes_needed) {
  std::vector<int> order = slots.active();
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    const SlotUse& x = slots[static_cast<size_t>(a)].use;
    const SlotUse& y = slots[static_cast<size_t>(b)].use;
    if (x.last_step() != y.last_step()) return x.last_step() < y.last_step();
    return x.seq_len() < y.seq_len();
  });
  // References that would be gone: idle mappings (reclaimed on demand) plus the victims'.
  std::unordered_map<PageHandle, uint32_t> dropped;
  for (const Slot& s : slots) {
    if (s.state() != Slot::State::Idle) continue;
    for (PageHandle p : s.pages.handles()) {
      if (p != kNoPage) ++dropped[p];
    }
  }
  std::vector<int> victims;
  size_t freed_bytes = 0;
  for (int v : order) {
    if (freed_bytes >= bytes_needed) break;
    victims.push_back(v);
    for (PageHandle p : slots[static_cast<size_t>(v)].pages.handles()) {
      if (p != kNoPage && ++dropped[p] == pool.refs(p)) freed_bytes += page_bytes;
    }
  }
  return victims;
}

}  // namespace vattention
