// BlockTables: rows that follow an engine's block tables (DESIGN.md section 3, issue 19).
//
// Why: a block-based engine names the KV memory of a request by a table of block ids per KV cache
// group, fresh blocks for new tokens, and blocks of its prefix cache for a hit. With the pages of
// a block belonging to the block (block_pages.h), a request's contiguous row maps its table in
// order: page index p of group g maps the pages of table[g][p]. A hit maps the block's pages again
// (zero copy); a fresh block takes the anonymous pages already mapped there (prefetched
// look-ahead: no map call), else its own old pages (nobody maps them any more), else new pages.
// Kernels still see one dense row per request.
//
// A step with tables (apply):
//   1. records the tables and unmaps, per row, the tail from the first page index whose mapping
//      disagrees with its table (a replaced table: a resumed request, or a new request in a slot
//      an earlier one left idle). What agrees stays mapped: a new request whose hits an idle row
//      still maps (a shared system prompt) costs no map call for them;
//   2. frees every fresh id from earlier holders: an idle row mapping it is unmapped, an active row
//      keeps the pages as anonymous ones (the engine released the block from that row's window
//      before the row's own release: "detached"), and the block forgets them;
//   3. gets every page still missing (all or nothing: OutOfPages here leaves every row mapping all
//      its table still names; what went in 1 and 2 are pages no table names any more);
//   4. maps the new indices of every row (undoing itself on a driver error), then records which
//      block is where and counts hits, adoptions and reuses.
// The caller releases window pages before (the engine frees window blocks at the same point, and
// may hand them out fresh in this very step).
//
// Not thread-safe: the owning cache serializes calls under its mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/cache_parts.h"

namespace vattention {

// One row's table update in a step: ids[g] replace group g's table from page index `start` on
// (start == the table's length appends; 0 replaces it). The first `cached` of them are cache hits
// (blocks whose pages exist; kNoBlock: the engine's null block, a hole, only as a prefix of a
// group's table), the rest are fresh blocks.
struct BlockUpdate {
  int slot = -1;
  size_t start = 0;
  std::vector<std::vector<int64_t>> ids;
  size_t cached = 0;
};

class BlockTables {
 public:
  explicit BlockTables(CacheParts& parts) : parts_(parts) {}
  BlockTables(const BlockTables&) = delete;
  BlockTables& operator=(const BlockTables&) = delete;

  // Checks `updates` against the state and `lens` (every listed row's table, updated, names every
  // page index its length needs). Throws (Config, InvalidSlot, SequenceTooLong) naming the bad
  // value; changes nothing.
  void validate(const std::vector<int64_t>& lens, const std::vector<BlockUpdate>& updates) const;
  // Steps 1-4 above for the listed rows (validate() first). Throws OutOfPages/Driver: see 3.
  void apply(const std::vector<int64_t>& lens, const std::vector<BlockUpdate>& updates);
  // After a successful step: a row's full page indices are read-only (the engine never rewrites
  // tokens below a row's length), which is what lets two rows map one block.
  void commit(const std::vector<int64_t>& lens);

  // For alloc(hits): checks a new request's leading cache hits (ids[g] per group, kNoBlock for
  // the null block) against the cache (Config naming the bad value; changes nothing), and counts
  // the leading page indices a row already maps as they say: a new request in that row is served
  // those hits with no map call (step 1 keeps them).
  void validate_hits(const std::vector<std::vector<int64_t>>& ids) const;
  size_t kept_hits(const Slot& s, const std::vector<std::vector<int64_t>>& ids) const;

 private:
  // Step 2 for fresh id b (except for the row `slot` at page index `page`, group `group`).
  void free_fresh(int64_t b, int slot, size_t page, size_t group);
  // True when row `s` has no pages at (p, g): released, or the engine's null block.
  bool hole(const Slot& s, size_t p, size_t g) const;

  CacheParts& parts_;
};

}  // namespace vattention
