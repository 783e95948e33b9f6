// WindowRelease: gives back the pages a sliding-window layer can never read again.
//
// Why absolute positions: token t of a slot stays at row index t, so FlashAttention's window_size,
// SDPA masks and CUDA graphs see the same dense tensor as without a window. Only memory changes:
// a page of a windowed tensor lying wholly before the first key any query of this step can read is
// unmapped and returned to the pool, so a long request holds O(W) pages per windowed tensor.
//
// Which keys a step's queries read: step(len) after a previous length `old` writes and attends
// queries at positions [old, len); the query at q reads keys (q - W, q] (Mistral, Gemma and Qwen2
// convention; FlashAttention window_size=(W - 1, 0)). So pages wholly before min(old, len - 1) - W
// + 1 are released; a prefill (old = 0) releases nothing, a decode step (old = len - 1) releases
// pages wholly before len - W. (vLLM's sliding-window manager frees a block by the same rule:
// blocks wholly before num_computed_tokens - W + 1.) Under a tile rule (read_tail.h) the first
// key is rounded down to the tile, where a tile-loading kernel starts its window.
//
// This part is the policy (which pages, when); SlotMemory::release_front does the unmapping and
// owns the record: released page indices stay in the row's handles as kNoPage below head(t) (a
// per-tensor prefix), so page index arithmetic (p * columns + column) is unchanged everywhere;
// every path that walks a row's pages skips them (fork shares only what is mapped, swap saves
// only the mapped window).
//
// Ordering (CUDA): unmapping is not stream-ordered and kernels of earlier steps may still read the
// released keys, so release waits on a fence recorded on the step's stream first (only in steps
// that release something: once per page of tokens per windowed slot).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/cache_feature.h"
#include "core/cache_parts.h"

namespace vattention {

class WindowRelease final : public CacheFeature {
 public:
  explicit WindowRelease(CacheParts& parts) : parts_(parts) {}

  // Releases, for every listed slot, the pages its windowed tensors no query of this step can
  // read (old_lens: the lengths before the step); waits on a fence on `stream` before unmapping.
  // Returns the pages that reached the free list.
  size_t release(const std::vector<int64_t>& lens, const std::vector<int64_t>& old_lens,
                 uintptr_t stream);
  // Pages release() would return to the pool for these lengths, changing nothing (a page still
  // referenced elsewhere does not count).
  size_t releasable(const std::vector<int64_t>& lens) const;
  // Throws SequenceTooLong unless the window of a `len`-token sequence is still backed in `slot`.
  void check(int slot, int64_t len, const char* what) const;
  // Per layer, the first token of `slot` still backed (0 on full-attention layers).
  std::vector<int64_t> starts(int slot) const;

  // alloc(): the new request starts at token 0, which a window may have released: a row with
  // released pages is unmapped whole (an idle row waits for its fence inside).
  void clear(int slot);
  void add_stats(Stats& out) const override;  // holds no page: released pages go to the pool

 private:
  // Releases page indices [head(t), releasable_pages(t, first_query)) of every windowed tensor.
  size_t release_head(int slot, int64_t first_query);
  // Per tensor, the end of the range release_head would release (head[t] when nothing).
  size_t release_end(const Slot& slot, int tensor, int64_t first_query) const;

  CacheParts& parts_;
  uint64_t released_pages_ = 0;  // pages sliding windows returned to the pool
};

}  // namespace vattention
