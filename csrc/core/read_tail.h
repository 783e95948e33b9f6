// ReadTail: what a kernel that loads whole key tiles reads past a row's length is mapped and
// finite (the tile rule, CacheGeometry::tile_tokens > 0).
//
// Why: kernels that take the whole [batch, max_seq, ...] tensor with per-row lengths
// (FlashAttention 3 and 4 with seqused_k) load key tiles whole, through TMA, whose bounds are the
// tensor's: a row of `len` tokens is read up to the next multiple of the kernel's tile. Two things
// can go wrong there. A tile may reach a page the row does not map (an illegal address on a GPU:
// the mega layout holds few tokens a page, 32 for a Llama-3-8B shape with 2 MB pages), and rows
// past `len` in a page the row does map hold whatever the page held before it came to the row
// (a fresh CUDA page is uninitialised; a recycled one holds another request's data), where a NaN
// leaks through the masked softmax: P = 0, but 0 x NaN is NaN in P @ V. The cache owns the rule,
// not the caller: with tile T, every row maps read_end(len) = len rounded up to T (capped at
// max_seq: plan_step, capacity, the prefetch thread and trimming all count it, through
// CacheGeometry::read_pages), and tokens [len, read_end(len)) hold finite values whenever a
// kernel may read them. A kernel whose tile divides T reads only mapped, finite memory.
//
// How, zeroing only what a row has not written since its pages came to it: each row keeps
// `finite` (SlotPages::finite): tokens [0, finite) hold the request's own K/V (below its length,
// written before a kernel reads them) or zeros this part wrote. A step whose read end passes
// `finite` zeroes from max(finite, len) to the end of what the row maps after the step, in every
// tensor, on the step's stream (one Backend::zero per tensor: a row's tokens are contiguous in
// a tensor, also in the mega layout, whose token row holds every layer), and moves `finite`
// there. So a prefill zeroes the rest of its last page past the length, never what it writes,
// and a decode zeroes each page it grows into once, in the step that maps it. The prefetch
// thread zeroes the pages it maps for a row that is finite up to its mapped end (whole: the row
// has written nothing there), on its own stream and before it publishes them (as scrubbing
// does), so with prefetch() the steps that reach them have nothing to zero. A step whose
// lengths stay within `finite` does nothing new: the decode fast path compares a length with
// SlotPages::ready(), the longest one whose read end is backed and finite.
//
// `finite` starts over at 0 when alloc() hands a row to a new request (what the previous one
// wrote, or failed to write, is no concern of the new one), shrinks with the mapping
// (SlotMemory::unmap_tail), and is set by fork/share_prefix (the shared prefix is the source's
// data; the new row's tail is zeroed at once, settle()) and by swap-in (the record keeps it).
//
// Not thread-safe: callers hold the cache mutex.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/cache_feature.h"
#include "core/cache_parts.h"

namespace vattention {

class ReadTail final : public CacheFeature {
 public:
  explicit ReadTail(CacheParts& parts) : parts_(parts) {}
  ReadTail(const ReadTail&) = delete;
  ReadTail& operator=(const ReadTail&) = delete;

  // One row's work in a step: zero tokens [from, to) of `slot`, then it is finite up to `to`
  // (planned: its read end; zero() extends it to the end of what the row maps then; from == to:
  // only `finite` moves).
  struct Zeroing {
    int slot;
    int64_t from;
    int64_t to;
  };
  // The listed rows (lens: a step's, kUnlisted for rows left alone) whose read end passes their
  // finite tokens, and what each must zero. Empty without a tile rule. Reads the rows only.
  std::vector<Zeroing> plan(const std::vector<int64_t>& lens) const;
  // Zeroes every planned range on `stream`, in every tensor, after the step's growth: from
  // `from` to the end of what the row maps then (`to` is moved there), and counts it. Changes no
  // row: a failure leaves `finite` as it was.
  void zero(std::vector<Zeroing>& plan, uintptr_t stream);
  // The planned rows are finite up to their `to` (after zero() succeeded).
  void commit(const std::vector<Zeroing>& plan);
  // fork/share_prefix: `slot` now holds `len` tokens of another row's data and maps its read
  // end; under a tile rule zeroes [len, backed) on `stream` (pages of its own: past the shared
  // prefix) and records it finite up to backed (nothing without one). The caller makes the
  // stream's work complete before a failure unmaps anything.
  void settle(int slot, int64_t len, uintptr_t stream);
  // alloc(): the row's new request has written nothing yet.
  void forget(int slot);

  void add_stats(Stats& out) const override;
  // With a tile rule: every row's finite tokens are backed, and every active row maps its read
  // end and holds it finite.
  std::string check(std::map<PageHandle, uint32_t>& seen) const override;

 private:
  // Zeroes tokens [from, to) of `slot` in every tensor on `stream`.
  void zero_tokens(int slot, int64_t from, int64_t to, uintptr_t stream);

  CacheParts& parts_;  // counts in parts_.counters (the prefetch thread zeroes too)
};

}  // namespace vattention
