// PrefixSharing: fork, share_prefix and ensure_private: a physical page mapped by several slots.
//
// Why sharing is sound: a physical page may be mapped at several virtual addresses (CUDA VMM
// aliasing; MAP_SHARED extents on the host). A slot's page indices [0, read_only) (slot.h) are
// read-only by contract, because tokens are only appended past them, so a shared page never
// changes while shared. The partial page at a fork point is where both slots write next: it is
// copied at fork time. ensure_private() gives a slot private copies when it must rewrite history.
//
// References: the pool counts one reference per mapping (and one per swap entry that keeps a page
// on the device). Unmapping only drops references; a page goes back to the free list with its last
// one, so freeing a parent never frees what a child maps.
//
// Ordering (CUDA): copies are stream-ordered and may still run when Backend::copy returns, and
// unmapping is not stream-ordered. Every path here waits on a fence on the caller's stream
// (SlotMemory::sync_stream) after copying and before it unmaps a page a kernel may read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "core/cache_feature.h"
#include "core/cache_parts.h"
#include "core/read_tail.h"
#include "core/staging_page.h"
#include "core/window_release.h"

namespace vattention {

class PrefixSharing final : public CacheFeature {
 public:
  PrefixSharing(CacheParts& parts, const WindowRelease& windows, ReadTail& tail,
                StagingPage& staging)
      : parts_(parts), windows_(windows), tail_(tail), staging_(staging) {}

  // Throws InvalidSlot/SequenceTooLong unless src is active and [0, num_tokens) of it can be
  // shared (within its length, and not below a released window).
  void check_source(int src, int64_t num_tokens) const;
  // share_prefix's arguments: dst active, then the source as above, then dst is not src and is
  // fresh (seq_len 0). Throws InvalidSlot/SequenceTooLong naming the bad one.
  void check_pair(int src, int dst, int64_t num_tokens) const;
  // Makes dst (free, idle, or active and fresh) an active slot whose tokens [0, num_tokens) equal
  // src's: full pages shared, the partial last page copied; under a tile rule dst maps its read
  // end and its tail past num_tokens is zeroed (pages of its own). OutOfPages/Driver: nothing
  // changed.
  void share(int src, int dst, int64_t num_tokens, uintptr_t stream);
  // Replaces every shared page of `slot` from the page holding start_token on with a private
  // copy. Returns the pages copied. All or nothing.
  size_t ensure_private(int slot, int64_t start_token, uintptr_t stream);

  // alloc(): the new owner must never write into a page someone else reads: unmap `slot` from its
  // first page still shared, and clear its read-only prefix.
  void clear(int slot);
  void add_stats(Stats& out) const override;
  // Every page mapped more than once (or kept by a swap handle, counted in `seen` before) lies
  // inside the read-only prefix of each slot mapping it.
  std::string check(std::map<PageHandle, uint32_t>& seen) const override;

 private:
  CacheParts& parts_;
  const WindowRelease& windows_;
  ReadTail& tail_;
  StagingPage& staging_;
  uint64_t cow_pages_copied_ = 0;  // pages copied by fork/share_prefix/ensure_private
};

}  // namespace vattention
