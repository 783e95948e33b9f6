// BlockUpdate: one row's change of its engine block table in a step (KVCacheCore::step; applied
// by BlockTables, block_tables.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace vattention {

// ids[g] replace group g's table from page index `start` on (start == the table's length appends;
// 0 replaces it). The first `cached` of them are cache hits (blocks whose pages exist; kNoBlock:
// the engine's null block, a hole, only as a prefix of a group's table), the rest are fresh
// blocks.
struct BlockUpdate {
  int slot = -1;
  size_t start = 0;
  std::vector<std::vector<int64_t>> ids;
  size_t cached = 0;
};

}  // namespace vattention
