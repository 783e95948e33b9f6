// Slot: one batch row of the cache, owned by at most one request at a time.
//
// The record is split by concept, and each concept has exactly one writer, which the compiler
// enforces (private members, one friend each):
//   SlotUse    whether a request holds the row, its sequence length, the orders reclamation
//              and eviction read                                         written by SlotTable
//   SlotPages  which physical pages back the row: the mapped range [head(t), mapped) of every
//              tensor (a sliding window moves head(t) up), the read-only prefix that other rows
//              or swap handles may share, and the fences of the row's free()s that guard
//              its unmapping
//                                       written by SlotMemory (SlotTable::PagesKey is its key)
// Every other part reads them through the accessors and changes them only by calling an
// operation of the owner (SlotTable::activate, SlotMemory::map, ...). Which engine block a row
// maps where is not in the record at all: BlockTables keeps those rows, privately.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/backend.h"
#include "core/geometry.h"

namespace vattention {

// A page index a sliding window released (a SlotPages handle; never a real handle).
constexpr PageHandle kNoPage = std::numeric_limits<PageHandle>::max();
// No engine block: anonymous pages, or a hole (an engine's null block).
constexpr int64_t kNoBlock = -1;

class SlotUse {
 public:
  SlotUse() = default;
  SlotUse(const SlotUse&) = default;
  SlotUse& operator=(const SlotUse&) = delete;  // changed field by field, by SlotTable only

  bool active() const { return active_; }
  // The length given by the last step() (tokens); 0 when not active.
  int64_t seq_len() const { return seq_len_; }
  // free() order, for least-recently-freed-first reclamation.
  uint64_t freed_at() const { return freed_at_; }
  // step() counter when last listed, for eviction policies.
  uint64_t last_step() const { return last_step_; }

 private:
  friend class SlotTable;
  bool active_ = false;
  int64_t seq_len_ = 0;
  uint64_t freed_at_ = 0;
  uint64_t last_step_ = 0;
};

class SlotPages {
 public:
  SlotPages() = default;
  SlotPages(const SlotPages&) = default;
  SlotPages& operator=(const SlotPages&) = delete;  // changed field by field, by SlotMemory only

  // Page indices [0, mapped) are mapped in every tensor (but below head(t), see below).
  size_t mapped() const { return mapped_; }
  // Tokens those pages back (geometry.tokens_in(mapped)).
  int64_t backed() const { return backed_; }
  // Tokens [0, finite) hold finite values: the request's own (below its length) or zeros the
  // cache wrote past it (read_tail.h). Never past backed(); kept only under a tile rule.
  int64_t finite() const { return finite_; }
  // The longest length a step may give the row with nothing to map or zero: its read end is
  // backed and finite (backed() without a tile rule). Kept for the decode fast path.
  int64_t ready() const { return ready_; }
  // mapped * columns handles, index p * columns + column (geometry.h; a column is one page of a
  // tensor's run at a page index). kNoPage where a window released the page.
  const std::vector<PageHandle>& handles() const { return handles_; }
  // First page index of tensor t still mapped: a sliding window released [0, head(t)).
  size_t head(size_t t) const { return head_.empty() ? 0 : head_[t]; }
  // True when a window released some page index of some tensor.
  bool has_holes() const { return !head_.empty(); }
  // Physical pages released in all tensors together (kNoPage entries of handles()).
  size_t holes(const CacheGeometry& g) const {
    size_t n = 0;
    for (size_t t = 0; t < head_.size(); ++t) n += head_[t] * g.index_pages(static_cast<int>(t));
    return n;
  }
  // Pages this row really maps (its references in the pool).
  size_t live(const CacheGeometry& g) const { return handles_.size() - holes(g); }
  // First query position at which a window can release another page (INT64_MAX: never).
  int64_t release_at() const { return release_at_; }
  // Page indices [0, read_only) may be mapped by other rows or kept by swap handles: read-only by
  // contract (tokens are only appended past them). Every page mapped more than once lies below
  // this boundary in each row that maps it.
  size_t read_only() const { return read_only_; }

 private:
  friend class SlotMemory;
  // Recomputes release_at_ from head_ (after the window heads or the mapping changed).
  void refresh_release_at(const CacheGeometry& g) {
    release_at_ = std::numeric_limits<int64_t>::max();
    if (!g.any_window()) return;
    for (int t = 0; t < g.num_tensors(); ++t) {
      if (g.window(t) <= 0) continue;
      release_at_ = std::min(release_at_, g.query_releasing(t, head(static_cast<size_t>(t)) + 1));
    }
  }

  // Recomputes ready_ from backed_ and finite_ (after either changed).
  void refresh_ready(const CacheGeometry& g) {
    ready_ = g.tile_tokens > 0 ? g.read_fits(std::min(backed_, finite_)) : backed_;
  }

  size_t mapped_ = 0;
  int64_t backed_ = 0;
  int64_t finite_ = 0;
  int64_t ready_ = 0;
  std::vector<PageHandle> handles_;
  std::vector<size_t> head_;  // empty, or one per tensor (not all zero)
  int64_t release_at_ = std::numeric_limits<int64_t>::max();
  size_t read_only_ = 0;
  // The fences recorded by the row's free()s whose pages it may still map: none of those pages is
  // unmapped before they completed, also after alloc() handed the row to a new request (the old
  // request's last kernels may still read them). Dropped by the first unmapping of the row, which
  // waits for them, or by free() once complete (SlotMemory::fence_pending says whether they are).
  std::vector<uint64_t> fences_;
};

struct Slot {
  enum class State : uint8_t {
    Free,    // no request, no pages
    Active,  // owned by a request
    Idle,    // request freed; pages still mapped (deferred reclamation) until needed elsewhere
  };
  Slot() = default;
  Slot(const Slot&) = default;
  Slot& operator=(const Slot&) = delete;

  // Derived, so "free holds no pages" and "idle holds some" need no check.
  State state() const {
    if (use.active()) return State::Active;
    return pages.mapped() > 0 ? State::Idle : State::Free;
  }

  SlotUse use;
  SlotPages pages;
};

}  // namespace vattention
