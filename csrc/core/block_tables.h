// BlockTables: rows that follow an engine's block tables.
//
// Why: a block-based engine names the KV memory of a request by a table of block ids per KV cache
// group, fresh blocks for new tokens, and blocks of its prefix cache for a hit. With the pages of
// a block belonging to the block (block_pages.h), a request's contiguous row maps its table in
// order: page index p of group g maps the pages of table[g][p]. A hit maps the block's pages again
// (zero copy); a fresh block takes the anonymous pages already mapped there (prefetched
// look-ahead: no map call), else its own old pages (nobody maps them any more), else new pages.
// Kernels still see one dense row per request.
//
// It keeps, privately and per row, the engine's table, which block the row maps at each page
// index (kept true by SlotMemory's RowObserver calls on every unmapping), and where the row's
// fresh blocks start; it owns the blocks' pages (BlockPages).
//
// A step with tables (apply) runs five phases over one StepPlan:
//   1. record_tables: records the new tables; each row unmaps its tail from the first page index
//      whose mapping disagrees with its table (a replaced table: a resumed request, or a new
//      request in a row an earlier one left idle; the unmapping waits for the fence the earlier
//      request's free() recorded, which alloc() left with the row). What agrees stays mapped: a
//      new request whose hits an idle row still maps (a shared system prompt) costs no map call
//      for them;
//   2. plan_rows: per listed row, fresh ids the row already maps anonymous pages for adopt them
//      (where its table named them after it mapped them: prefetched look-ahead);
//      the page indices it must grow by are planned, each fresh id taken from its earlier
//      holders (an idle row mapping it is unmapped; an active row keeps the pages as anonymous
//      ones: the engine released the block from that row's window before the row's own release,
//      "detached") and marked as reusing its own old pages or missing pages;
//   3. take_pages: every missing page, all or nothing, and the pages each new block will name.
//      OutOfPages here leaves the new tables recorded and every row mapping all its table still
//      names; what went in 1 and 2 are pages no table names any more (a row whose replaced table
//      cut its tail gets its length lowered to what it still backs, by the caller);
//   4. map_rows: maps the new indices of every row (undoing itself on a driver error);
//   5. record_blocks: records which block is where, counts hits and reuses, scrubs fresh blocks.
// The caller releases window pages before (the engine frees window blocks at the same point, and
// may hand them out fresh in this very step).
//
// Between steps the engine may release blocks (release()): their pages go back to the pool, so
// that what the cache holds follows what the engine's scheduler keeps (live blocks, and cached
// ones up to its cap).
//
// Not thread-safe: the owning cache serializes calls under its mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/block_pages.h"
#include "core/block_update.h"
#include "core/cache_feature.h"
#include "core/cache_parts.h"
#include "core/page_supply.h"
#include "core/slot_memory.h"

namespace vattention {

class BlockTables final : public CacheFeature, public RowObserver {
 public:
  // Block ids [0, num_blocks); cache: a block keeps its pages after its last mapping, until the
  // engine hands the id out fresh (its prefix cache may hit it meanwhile).
  BlockTables(CacheParts& parts, int64_t num_blocks, bool cache);
  BlockTables(const BlockTables&) = delete;
  BlockTables& operator=(const BlockTables&) = delete;

  int64_t num_blocks() const { return pages_.num_blocks(); }
  bool caching() const { return pages_.caching(); }

  // Checks `updates` against the state and `lens` (every listed row's table, updated, names every
  // page index its length needs). Throws (Config, InvalidSlot, SequenceTooLong) naming the bad
  // value; changes nothing.
  void validate(const std::vector<int64_t>& lens, const std::vector<BlockUpdate>& updates) const;
  // The five phases above for the listed rows (validate() first); zeroing (scrub on) is ordered
  // on `stream`. Throws OutOfPages/Driver: see 3.
  void apply(const std::vector<int64_t>& lens, const std::vector<BlockUpdate>& updates,
             uintptr_t stream);
  // After a successful step: a row's full page indices are read-only (the engine never rewrites
  // tokens below a row's length), which is what lets two rows map one block.
  void commit(const std::vector<int64_t>& lens);
  // True when the page indices `len` tokens need are all mapped as row `slot`'s table names them
  // (the decode fast path: nothing to map).
  bool named(int slot, int64_t len) const;
  // The engine's block table of row `slot`, one list per group (kNoBlock: the null block).
  const std::vector<std::vector<int64_t>>& table(int slot) const;

  // For alloc(hits): checks a new request's leading cache hits (ids[g] per group, kNoBlock for
  // the null block) against the cache (Config naming the bad value; changes nothing), and counts
  // the leading page indices row `slot` already maps as they say: a new request in that row is
  // served those hits with no map call (phase 1 keeps them).
  void validate_hits(const std::vector<std::vector<int64_t>>& ids) const;
  size_t kept_hits(int slot, const std::vector<std::vector<int64_t>>& ids) const;
  // alloc(): the new request in `slot` brings its own table (the row keeps its mapping).
  void clear(int slot);

  // release_blocks(): checks the ids (each in [0, num_blocks); duplicates are fine): throws
  // Config naming the bad one and the limit, changing nothing.
  void validate_release(const std::vector<int64_t>& ids) const;
  // Each listed block with pages forgets them (a block without pages is skipped):
  //   - an idle row that maps one unmaps its tail from the first page index that does, once the
  //     fence its free() recorded completed (unmapping is not stream-ordered). That fence is the
  //     last use of every block the row maps: an idle row is read by no kernel queued after its
  //     free(), and a block's pages reach the free list only once no row maps them. So nothing
  //     waits for work queued since (under async scheduling, the step in flight): a row freed
  //     long ago costs no wait, one freed this step waits for its own last kernels only;
  //   - an active row that maps one keeps the pages as anonymous ones ("detached", as when the
  //     engine hands the id out fresh), until it unmaps them itself (window release, free);
  //   - the block drops its own references.
  // A page nobody maps any more goes back to the free list. Returns the pages that did (those of
  // the listed blocks, and any other the unmapped idle tails alone held). Unmaps only idle rows,
  // so the caller keeps the prefetch thread's slot out of them (rule R). On a driver error the
  // row that failed maps what it did (rows before it stay unmapped: idle memory, as reclaim()
  // would leave it) and no block forgot its pages.
  size_t release(const std::vector<int64_t>& ids);

  // RowObserver: SlotMemory mapped anonymous pages, or unmapped part of a row (the blocks there
  // lose this row's mapping).
  void grown(int slot, size_t mapped) override;
  void cut(int slot, size_t keep) override;
  void released(int slot, int tensor, size_t from, size_t to) override;

  void add_stats(Stats& out) const override;
  // Each row's record against its mapping, each block's mapping count against the rows, pages
  // two rows map inside both rows' read-only prefixes; adds the blocks' own references.
  std::string check(std::map<PageHandle, uint32_t>& seen) const override;
  void close() override;  // forgets every block (the pool destroys the pages next)

 private:
  struct Row {
    std::vector<std::vector<int64_t>> table;  // per group; possibly longer than what is mapped
    std::vector<int64_t> blocks;  // p * groups + g: the block mapped there (kNoBlock: anonymous
                                  // pages, e.g. prefetched look-ahead, or a hole); mapped * groups
    size_t fresh_from = 0;  // table entries from here on are fresh blocks (hits before)
    // Page indices below it were settled under the current table: they map the block it names,
    // a hole, or pages the row kept when their block left it (detached: handed out fresh, or
    // released). Phase 2 adopts anonymous pages from here on only, so a detached block never
    // comes back to the row that let it go.
    size_t settled = 0;
  };
  struct StepPlan;
  static size_t table_size(const Row& r);

  // The phases of apply().
  void record_tables(const std::vector<BlockUpdate>& updates, StepPlan& plan);
  void plan_rows(const std::vector<int64_t>& lens, StepPlan& plan);
  void take_pages(StepPlan& plan);
  void map_rows(StepPlan& plan);
  void record_blocks(const StepPlan& plan);

  // Phase 1 for one update: the first page index whose mapping disagrees with the new table.
  size_t first_disagreement(const BlockUpdate& u) const;
  // Phase 2 for one row: fresh ids whose index the row maps with anonymous pages adopt them.
  void adopt_anonymous(int slot, uintptr_t stream);
  // Phase 2: fresh id b leaves its earlier holders (except row `slot` at page `page`, group
  // `group`).
  void free_fresh(int64_t b, int slot, size_t page, size_t group);
  // True when row `slot` has no pages at (p, g): released, or the engine's null block.
  bool hole(int slot, size_t p, size_t g) const;

  CacheParts& parts_;
  const size_t groups_;
  const std::vector<std::vector<size_t>> columns_;  // per group, its columns (geometry.h)
  BlockPages pages_;
  std::vector<Row> rows_;
};

}  // namespace vattention
