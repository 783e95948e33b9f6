// CacheParts: the parts of one cache that both coordinators share and that their features
// (window release, prefix sharing, swap, engine block tables) work on. The coordinator owns
// every part and hands its features this one struct of references, so a feature names what it
// touches instead of reaching into the coordinator. Everything here is guarded by the cache
// mutex.
#pragma once

#include "core/backend.h"
#include "core/geometry.h"
#include "core/page_pool.h"
#include "core/page_supply.h"
#include "core/scrubber.h"
#include "core/slot_mapper.h"
#include "core/slot_memory.h"
#include "core/slot_table.h"
#include "core/stats.h"

namespace vattention {

struct CacheParts {
  const CacheGeometry& geo;
  Backend& backend;
  const SlotMapper& mapper;
  PagePool& pool;
  SlotTable& slots;  // its records are read-only to features; who holds a row changes through it
  CacheCounters& counters;
  SlotMemory& memory;  // the only way to change what a row maps
  PageSupply& supply;
  Scrubber& scrubber;

  // VMM driver calls so far (map, set_access, unmap, and the pool's creations and destructions).
  uint64_t driver_calls() const {
    return counters.driver_calls(pool.pages_created(), pool.pages_destroyed());
  }
};

}  // namespace vattention
