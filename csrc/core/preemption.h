// Which active requests to preempt when memory runs short (KVCacheCore::pick_victims).
//
// Why by the pages that would really come back: a page another row maps, or a swap handle or an
// engine block keeps, stays in use when a victim's row goes, so preempting for it frees nothing.
#pragma once

#include <cstddef>
#include <vector>

#include "core/page_pool.h"
#include "core/slot_table.h"

namespace vattention {

// Active slots to preempt, in order, until the pages that would really return to the pool reach
// bytes_needed: least recently stepped first, ties by fewest tokens, then lowest index. Idle
// rows' mappings count as already gone (they are reclaimed on demand).
std::vector<int> pick_victims(const SlotTable& slots, const PagePool& pool, size_t page_bytes,
                              size_t bytes_needed);

}  // namespace vattention
