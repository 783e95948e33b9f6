// SlotMapper: where every page of every slot lives in virtual memory, and the driver calls that
// map or unmap a run of them.
//
// Why a type of its own: the address arithmetic (tensor bases, slot rows, page indices, columns)
// and the mapping of one slot's range read no cache state, so the prefetch thread runs them
// without the cache mutex (rule R, prefetch_gate.h). Every method is const.
//
// It owns the virtual reservations, one per tensor (geometry.h numbers them), reserved on
// construction and given back on destruction unless keep_reserved() was called: a reservation
// with live mappings cannot be freed (cuMemAddressFree refuses), so when a cache could not unmap
// everything, leaking the address range is the only safe choice.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/backend.h"
#include "core/geometry.h"

namespace vattention {

class SlotMapper {
 public:
  // Reserves every tensor's range (all or nothing: a failure gives back what was reserved).
  SlotMapper(Backend& backend, const CacheGeometry& geometry);
  ~SlotMapper();
  SlotMapper(const SlotMapper&) = delete;
  SlotMapper& operator=(const SlotMapper&) = delete;

  const std::vector<uintptr_t>& bases() const { return bases_; }
  uintptr_t tensor_base(int t) const { return bases_.at(static_cast<size_t>(t)); }
  // Address of page index `page` of `slot` in `tensor` (the first of its index_pages(tensor)).
  uintptr_t page_va(int tensor, int slot, size_t page) const {
    return bases_[static_cast<size_t>(tensor)] +
           static_cast<size_t>(slot) * geo_.slot_bytes(tensor) + page * geo_.index_bytes(tensor);
  }
  // Address of column `column` of page index `page` of `slot` (Slot::pages[page * columns + c]).
  uintptr_t column_va(size_t column, int slot, size_t page) const {
    return page_va(geo_.column_tensor(column), slot, page) +
           geo_.column_sub(column) * geo_.page_bytes;
  }

  // Per tensor, the first page index in [from, to) whose pages are not holes (kNoPage: released
  // window pages, restored as holes by fork or swap-in); `to` when all of them are.
  std::vector<size_t> first_pages(size_t from, size_t to, const PageHandle* pages) const;
  // Maps pages at page indices [from, to) of `slot` in every tensor and grants access (one
  // set_access per tensor run); pages[(p - from) * columns + column]. On failure unmaps what it
  // mapped and rethrows. Returns the driver calls made.
  size_t map_pages(int slot, size_t from, size_t to, const PageHandle* pages) const;
  // Maps tensor t's pages for page indices [begin, end) of `slot` as one run and grants access to
  // it; the handles of index p are row[(p - begin) * columns + first_column(t) + j]. `mapped`
  // counts the pages mapped so far, so a caller can unmap exactly those if a call fails.
  void map_run(int t, int slot, size_t begin, size_t end, const PageHandle* row,
               size_t& mapped) const;
  // Unmaps tensor t's pages for page indices [begin, end) of `slot` with one call.
  void unmap_run(int t, int slot, size_t begin, size_t end) const;
  // Makes [from, to) of `slot` resident in every tensor (Backend::prefault; never throws).
  void prefault(int slot, size_t from, size_t to) const noexcept;
  // The reservations outlive this object (pages may still be mapped in them).
  void keep_reserved() { keep_ = true; }

 private:
  Backend& backend_;
  const CacheGeometry& geo_;
  std::vector<uintptr_t> bases_;
  bool keep_ = false;
};

}  // namespace vattention
