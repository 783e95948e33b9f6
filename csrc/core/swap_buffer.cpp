#include "core/swap_buffer.h"

namespace vattention {

SwapBuffer::SwapBuffer(Backend& backend, void* data, size_t bytes, size_t* live_bytes)
    : backend_(backend), data_(data), bytes_(bytes), live_bytes_(live_bytes) {
  *live_bytes_ += bytes_;
}

SwapBuffer::~SwapBuffer() {
  *live_bytes_ -= bytes_;
  try {
    backend_.free_host(data_);
  } catch (...) {
    // A destructor must not throw; at worst one host buffer leaks.
  }
}

}  // namespace vattention
