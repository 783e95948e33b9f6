// BlockPages: an engine's block ids naming physical pages.
//
// Why: a block-based engine (vLLM) decides which KV block holds which tokens and which blocks a
// new request may reuse from its prefix cache. If the pages behind a block belong to the block,
// not to the slot that first mapped them, a cache hit is a remap of the same physical pages into
// the new request's row (zero copy), and windows and hybrid models follow the engine's tables by
// construction. Block b names the pages of one page index of one KV cache group: group_width()
// pages (geometry.h); every group has that width, so an id may move between groups.
//
// Lifetime of a block's pages: while rows map them (one pool reference per mapping, the rows'),
// and, when caching (the engine's prefix cache may still report a hit), until the engine hands the
// id out as a fresh block or releases it (release_blocks): the block then holds a reference of its
// own on each page. Without caching the block forgets its pages with the last mapping.
//
// BlockTables owns this part and the rows that record which block they map where; it reports
// every mapping that comes (mapped()) and goes (unmapped()). Not thread-safe: the owning cache
// serializes calls under its mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/page_pool.h"
#include "core/stats.h"

namespace vattention {

class BlockPages {
 public:
  // Block ids [0, num_blocks); cache: a block keeps its pages after its last mapping.
  BlockPages(PagePool& pool, int64_t num_blocks, bool cache)
      : pool_(pool), entries_(static_cast<size_t>(num_blocks)), cache_(cache) {}
  BlockPages(const BlockPages&) = delete;
  BlockPages& operator=(const BlockPages&) = delete;

  bool caching() const { return cache_; }
  int64_t num_blocks() const { return static_cast<int64_t>(entries_.size()); }

  // Block b's pages (group_width() handles, in the group's column order), empty if none.
  const std::vector<PageHandle>& pages(int64_t b) const { return entry(b).pages; }
  bool has_pages(int64_t b) const { return !entry(b).pages.empty(); }
  uint32_t mappings(int64_t b) const { return entry(b).mappings; }
  // A row maps b's pages at one page index (the row holds its own pool references).
  void mapped(int64_t b) { ++entry(b).mappings; }
  // A row stopped mapping b. Without caching b forgets its pages with its last mapping.
  void unmapped(int64_t b);
  // b names `pages` from now on; they are mapped by one row (which called mapped()). Caching: b
  // takes its own reference on each.
  void assign(int64_t b, std::vector<PageHandle> pages);
  // b's content is dead (the engine hands the id out fresh, or a row keeps its pages after the id
  // moved on): b forgets its pages, dropping its own references (a page nobody maps goes back).
  void drop(int64_t b);

  // Counters of what steps did with blocks (stats()).
  // A hit the row already mapped (a new request in the row of an earlier one): no map call.
  void count_hit(bool in_place) {
    ++hits_;
    if (in_place) ++hits_in_place_;
  }
  void count_adopted() { ++adopted_; }
  void count_reused() { ++reused_; }
  void count_detached() { ++detached_; }
  // release_blocks(): `blocks` with pages were released, and `pages` reached the free list.
  void count_released(size_t blocks, size_t pages) {
    released_ += blocks;
    pages_released_ += pages;
  }

  void add_stats(Stats& out) const;
  // Checks each block's mapping count against `counted` (the rows' mappings of each block) and
  // adds the blocks' own references to `seen`: "" or what is wrong.
  std::string check(const std::vector<uint32_t>& counted,
                    std::map<PageHandle, uint32_t>& seen) const;
  void forget_all();  // close(): every block forgets its pages (the pool destroys them next)

 private:
  struct Entry {
    std::vector<PageHandle> pages;  // empty: no pages
    uint32_t mappings = 0;          // rows mapping the pages (one per row and page index)
  };
  Entry& entry(int64_t b) { return entries_[static_cast<size_t>(b)]; }
  const Entry& entry(int64_t b) const { return entries_[static_cast<size_t>(b)]; }

  PagePool& pool_;
  std::vector<Entry> entries_;
  const bool cache_;
  uint64_t hits_ = 0, hits_in_place_ = 0, adopted_ = 0, reused_ = 0, detached_ = 0;
  uint64_t released_ = 0, pages_released_ = 0;
};

}  // namespace vattention
