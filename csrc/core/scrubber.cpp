#include "core/scrubber.h"

namespace vattention {

Scrubber::Scrubber(Backend& backend, const CacheGeometry& geometry, const SlotMapper& mapper)
    : backend_(backend), geo_(geometry), mapper_(mapper) {}

Scrubber::~Scrubber() {
  try {
    close();
  } catch (...) {
    // A destructor must not throw; at worst the stream leaks.
  }
}

void Scrubber::scrub(int slot, size_t from, size_t to, uintptr_t stream) {
  if (!enabled_ || to <= from) return;
  zero_on(slot, from, to, stream);
  scrubbed_pages_ += (to - from) * geo_.columns();
}

void Scrubber::prepare(bool force) {
  if ((!enabled_ && !force) || own_stream_ready_) return;
  own_stream_ = backend_.create_stream();
  own_stream_ready_ = true;
}

void Scrubber::zero(int slot, size_t from, size_t to) const {
  zero_on(slot, from, to, own_stream_);
  // Visible to other streams' kernels only once done: wait for it before the range is published.
  const uint64_t fence = backend_.record_fence(own_stream_);
  try {
    backend_.fence_wait(fence);
  } catch (...) {
    backend_.fence_release(fence);
    throw;
  }
  backend_.fence_release(fence);
}

void Scrubber::zero_on(int slot, size_t from, size_t to, uintptr_t stream) const {
  for (int t = 0; t < geo_.num_tensors(); ++t) {
    backend_.zero(mapper_.page_va(t, slot, from), (to - from) * geo_.index_bytes(t), stream);
  }
}

void Scrubber::scrub_columns(int slot, size_t page, const std::vector<size_t>& columns,
                             uintptr_t stream) {
  if (!enabled_ || columns.empty()) return;
  for (size_t c : columns) {
    backend_.zero(mapper_.column_va(c, slot, page), geo_.page_bytes, stream);
  }
  scrubbed_pages_ += columns.size();
}

void Scrubber::add_stats(Stats& out) const {
  out.emplace_back("scrub", enabled_ ? 1 : 0);
  out.emplace_back("scrubbed_pages", static_cast<int64_t>(scrubbed_pages_));
}

void Scrubber::close() {
  if (!own_stream_ready_) return;
  own_stream_ready_ = false;
  backend_.destroy_stream(own_stream_);  // the cache synchronized the device first
}

}  // namespace vattention
