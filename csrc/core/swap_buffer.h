// SwapBuffer: one page_bytes buffer of host memory (pinned on CUDA: Backend::alloc_host) holding a
// swapped-out page. Shared by every swap record that refers to that page; it frees itself, and
// gives back its share of the swap budget, when the last record drops it.
#pragma once

#include <cstddef>

#include "core/backend.h"

namespace vattention {

// One page_bytes host buffer; frees itself and its budget share when the last record drops it.
class SwapBuffer {
 public:
  SwapBuffer(Backend& backend, void* data, size_t bytes, size_t* live_bytes);
  ~SwapBuffer();
  SwapBuffer(const SwapBuffer&) = delete;
  SwapBuffer& operator=(const SwapBuffer&) = delete;
  void* data() const { return data_; }

 private:
  Backend& backend_;
  void* data_;
  size_t bytes_;
  size_t* live_bytes_;  // SwapStore::host_bytes_, which outlives every buffer
};

}  // namespace vattention
