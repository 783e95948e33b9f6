// CacheParts: the parts of one cache that its features (window release, prefix sharing, swap,
// engine blocks) work on. The coordinator (KVCacheCore) owns every part and hands its features
// this one struct of references, so a feature names what it touches instead of reaching into the
// coordinator. Everything here is guarded by the cache mutex.
#pragma once

#include "core/backend.h"
#include "core/block_pages.h"
#include "core/geometry.h"
#include "core/page_pool.h"
#include "core/page_supply.h"
#include "core/scrubber.h"
#include "core/slot_mapper.h"
#include "core/slot_memory.h"
#include "core/slot_table.h"
#include "core/staging_page.h"
#include "core/stats.h"

namespace vattention {

struct CacheParts {
  const CacheGeometry& geo;
  Backend& backend;
  const SlotMapper& mapper;
  PagePool& pool;
  SlotTable& slots;
  CacheCounters& counters;
  SlotMemory& memory;
  PageSupply& supply;
  Scrubber& scrubber;
  StagingPage& staging;
  BlockPages& blocks;
};

}  // namespace vattention
