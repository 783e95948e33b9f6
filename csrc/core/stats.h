// Counters of one cache. Monotonic COUNTs only; sizes are computed from state when asked.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace vattention {

// stats(): named integers, in a fixed order (sizes in bytes, counts in pages or calls).
using Stats = std::vector<std::pair<std::string, int64_t>>;

struct CacheCounters {
  uint64_t map_calls = 0;          // backend map() calls (one per page)
  uint64_t unmap_calls = 0;        // backend unmap() calls (one per contiguous run)
  uint64_t set_access_calls = 0;   // backend set_access() calls (one per contiguous run)
  uint64_t step_map_calls = 0;     // map() calls made synchronously inside step()
  uint64_t prefetch_map_calls = 0; // map() calls made by the background prefetch thread
  uint64_t steps = 0;
  // VMM driver calls (cuMemCreate/Release/Map/SetAccess/Unmap) made synchronously inside step(),
  // and by the prefetch thread: step_driver_calls / steps is what a decode step pays inline.
  uint64_t step_driver_calls = 0;
  uint64_t prefetch_driver_calls = 0;
  uint64_t prefetch_errors = 0;  // failures of the prefetch thread (each raised by a later call)
  uint64_t oom_events = 0;  // OutOfPagesError raised
  uint64_t reclaimed_pages = 0;  // pages unmapped from idle slots or trimmed from active ones
  uint64_t prefetch_shortfall_pages = 0;  // pages the prefetch thread could not get
  uint64_t fence_waits = 0;  // unmaps that had to wait for a free()'s event
  // What page creation cost where: pages step() created itself (its free list was short: on the
  // critical path) and the nanoseconds that took; pages the prefetch thread created (for
  // prefetch() and to keep the headroom) and its nanoseconds.
  uint64_t step_pages_created = 0;
  uint64_t step_page_create_ns = 0;
  uint64_t background_pages_created = 0;
  uint64_t background_page_create_ns = 0;
  // The tile rule (read_tail.h): Backend::zero calls made past rows' lengths (by steps, fork and
  // the prefetch thread) and the bytes they zeroed.
  uint64_t tail_zero_calls = 0;
  uint64_t tail_zeroed_bytes = 0;

  // VMM driver calls so far: map, set_access, unmap here, create/destroy from the pool's counts.
  uint64_t driver_calls(uint64_t pages_created, uint64_t pages_destroyed) const {
    return map_calls + set_access_calls + unmap_calls + pages_created + pages_destroyed;
  }
};

}  // namespace vattention
