#include "core/slot_mapper.h"

#include "core/slot.h"

namespace vattention {

SlotMapper::SlotMapper(Backend& backend, const CacheGeometry& geometry)
    : backend_(backend), geo_(geometry) {
  try {
    for (int t = 0; t < geo_.num_tensors(); ++t) {
      bases_.push_back(backend_.reserve(geo_.tensor_bytes(t)));
    }
  } catch (...) {
    for (size_t t = 0; t < bases_.size(); ++t) {
      backend_.release_va(bases_[t], geo_.tensor_bytes(static_cast<int>(t)));
    }
    throw;
  }
}

SlotMapper::~SlotMapper() {
  if (keep_) return;
  for (size_t t = 0; t < bases_.size(); ++t) {
    try {
      backend_.release_va(bases_[t], geo_.tensor_bytes(static_cast<int>(t)));
    } catch (...) {
    }
  }
}

std::vector<size_t> SlotMapper::first_pages(size_t from, size_t to, const PageHandle* pages) const {
  // Holes are a prefix of each tensor (all of a tensor's columns together): tensor t maps
  // [first[t], to) only.
  const int T = geo_.num_tensors();
  const size_t C = geo_.columns();
  std::vector<size_t> first(static_cast<size_t>(T), from);
  for (int t = 0; t < T; ++t) {
    size_t& f = first[static_cast<size_t>(t)];
    while (f < to && pages[(f - from) * C + geo_.first_column(t)] == kNoPage) ++f;
  }
  return first;
}

size_t SlotMapper::map_pages(int slot, size_t from, size_t to, const PageHandle* pages) const {
  const int T = geo_.num_tensors();
  const size_t C = geo_.columns();
  const size_t P = geo_.page_bytes;
  const std::vector<size_t> first = first_pages(from, to, pages);
  size_t calls = 0;
  int tensors_done = 0;
  size_t pages_done = 0;  // physical pages mapped in the tensor being mapped
  try {
    for (int t = 0; t < T; ++t) {
      const size_t begin = first[static_cast<size_t>(t)];
      if (begin == to) {
        tensors_done = t + 1;
        continue;
      }
      map_run(t, slot, begin, to, pages + (begin - from) * C, pages_done);
      calls += pages_done + 1;
      tensors_done = t + 1;
      pages_done = 0;
    }
  } catch (...) {
    try {
      // One unmap per contiguous run: the tensors done, then the part of the one that failed.
      for (int t = 0; t < tensors_done; ++t) {
        const size_t begin = first[static_cast<size_t>(t)];
        if (begin < to) unmap_run(t, slot, begin, to);
      }
      if (pages_done > 0) {
        backend_.unmap(page_va(tensors_done, slot, first[static_cast<size_t>(tensors_done)]),
                       pages_done * P);
      }
    } catch (...) {
      // Secondary failure while undoing: the first error is the one the caller needs.
    }
    throw;
  }
  return calls;
}

void SlotMapper::map_run(int t, int slot, size_t begin, size_t end, const PageHandle* row,
                         size_t& mapped) const {
  // Tensor t's pages for [begin, end) form one contiguous run of index_pages(t) per index.
  const size_t C = geo_.columns(), P = geo_.page_bytes;
  const size_t n = geo_.index_pages(t), column = geo_.first_column(t);
  const uintptr_t va = page_va(t, slot, begin);
  for (size_t p = 0; p < end - begin; ++p) {
    for (size_t j = 0; j < n; ++j) {
      backend_.map(va + mapped * P, row[p * C + column + j]);
      ++mapped;
    }
  }
  // One access grant per contiguous run of new pages, not one per page.
  backend_.set_access(va, mapped * P);
}

void SlotMapper::unmap_run(int t, int slot, size_t begin, size_t end) const {
  backend_.unmap(page_va(t, slot, begin), (end - begin) * geo_.index_bytes(t));
}

void SlotMapper::prefault(int slot, size_t from, size_t to) const noexcept {
  for (int t = 0; t < geo_.num_tensors(); ++t) {
    backend_.prefault(page_va(t, slot, from), (to - from) * geo_.index_bytes(t));
  }
}

}  // namespace vattention
