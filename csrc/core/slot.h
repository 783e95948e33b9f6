// Slot: one batch row of the cache, owned by at most one request at a time.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/backend.h"
#include "core/geometry.h"

namespace vattention {

// A page index a sliding window released (Slot::pages entry; never a real handle).
constexpr PageHandle kNoPage = std::numeric_limits<PageHandle>::max();
// No engine block: anonymous pages, or a hole (Slot::blocks, Slot::table: the null block).
constexpr int64_t kNoBlock = -1;

struct Slot {
  enum class State : uint8_t {
    Free,    // no request, no pages
    Active,  // owned by a request
    Idle,    // request freed; pages still mapped (deferred reclamation) until needed elsewhere
  };
  State state = State::Free;
  int64_t seq_len = 0;               // length given by the last step() (tokens)
  size_t mapped = 0;                 // page indices [0, mapped) are mapped in every tensor
  int64_t backed = 0;                // tokens those pages back (geometry.tokens_in(mapped))
  std::vector<PageHandle> pages;     // mapped * columns handles, index p * columns + column
                                  // (geometry.h; column = tensor with one shape per layer)
  uint64_t freed_at = 0;  // free() order, for least-recently-freed-first reclamation
  uint64_t last_step = 0;  // step() counter when last listed, for eviction policies
  uint64_t fence = 0;  // event recorded at free(): unmap only after it completed
  bool has_fence = false;
  // Page indices [0, shared_pages) may be mapped by other slots or kept by swap handles: read-only
  // by contract (tokens are only appended past them). Set by fork/share_prefix, lowered by
  // ensure_private, cleared when the slot is reallocated. Every page mapped more than once lies
  // below this boundary in each slot that maps it (PrefixSharing::check).
  size_t shared_pages = 0;
  // Sliding windows (issue 14): page indices [0, head[t]) of tensor t were released; their pages
  // entries (every column of tensor t) are kNoPage. Empty when nothing is released.
  std::vector<size_t> head;
  // First query position at which step() can release another page (INT64_MAX: never).
  int64_t release_at = std::numeric_limits<int64_t>::max();
  // Engine blocks (block_tables.h; empty unless the cache's pages are named by block ids):
  // table[g] is the engine's block table of group g (kNoBlock: its null block), possibly longer
  // than what is mapped; blocks[p * groups + g] is the block whose pages are mapped at page index
  // p for group g (kNoBlock: anonymous pages, e.g. prefetched look-ahead, or a hole).
  std::vector<std::vector<int64_t>> table;
  std::vector<int64_t> blocks;
  size_t fresh_from = 0;  // table entries from here on were given as fresh blocks (hits before)

  // First page index of tensor t that is mapped (head[t], or 0).
  size_t head_of(size_t t) const { return head.empty() ? 0 : head[t]; }
  // Physical pages released in all tensors together (kNoPage entries of `pages`).
  size_t holes(const CacheGeometry& g) const {
    size_t n = 0;
    for (size_t t = 0; t < head.size(); ++t) n += head[t] * g.index_pages(static_cast<int>(t));
    return n;
  }
  // Pages this slot really maps (its references in the pool).
  size_t live_pages(const CacheGeometry& g) const { return pages.size() - holes(g); }
  // Recomputes release_at from head (after the window heads or the mapping changed).
  void refresh_release_at(const CacheGeometry& g) {
    release_at = std::numeric_limits<int64_t>::max();
    if (!g.any_window()) return;
    for (int t = 0; t < g.num_tensors(); ++t) {
      if (g.window(t) <= 0) continue;
      release_at = std::min(release_at, g.query_releasing(t, head_of(static_cast<size_t>(t)) + 1));
    }
  }
};

}  // namespace vattention
