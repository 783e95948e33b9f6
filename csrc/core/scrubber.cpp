#include "core/scrubber.h"

#include <cstring>
#include <string>

#include "core/errors.h"

namespace vattention {
namespace {

bool host_memory(const Backend& backend) { return backend.device().dl_device_type == 1; }

}  // namespace

Scrubber::Scrubber(Backend& backend, const CacheGeometry& geometry, const SlotMapper& mapper)
    : backend_(backend), geo_(geometry), mapper_(mapper) {}

Scrubber::~Scrubber() { close(); }

void Scrubber::scrub(int slot, size_t from, size_t to) {
  if (!enabled_ || to <= from) return;
  prepare();
  zero(slot, from, to);
  scrubbed_pages_ += (to - from) * geo_.columns();
}

void Scrubber::prepare() {
  if (!enabled_ || host_memory(backend_) || zero_block_ != nullptr) return;
  const size_t P = geo_.page_bytes;
  zero_block_ = backend_.alloc_host(P);
  if (zero_block_ == nullptr) {
    throw Error(Error::Kind::Driver, "scrub: could not allocate " + std::to_string(P) +
                                         " bytes of host memory for the zero page")
        .with("call", std::string("alloc_host"))
        .with("bytes", static_cast<int64_t>(P));
  }
  std::memset(zero_block_, 0, P);
}

void Scrubber::zero(int slot, size_t from, size_t to) const {
  const size_t P = geo_.page_bytes;
  for (int t = 0; t < geo_.num_tensors(); ++t) {
    const uintptr_t va = mapper_.page_va(t, slot, from);
    const size_t pages = (to - from) * geo_.index_pages(t);
    if (host_memory(backend_)) {
      std::memset(reinterpret_cast<void*>(va), 0, pages * P);
    } else {
      for (size_t p = 0; p < pages; ++p) backend_.copy_from_host(va + p * P, zero_block_, P, 0);
    }
  }
}

void Scrubber::scrub_columns(int slot, size_t page, const std::vector<size_t>& columns) {
  if (!enabled_ || columns.empty()) return;
  prepare();
  const size_t P = geo_.page_bytes;
  for (size_t c : columns) {
    const uintptr_t va = mapper_.column_va(c, slot, page);
    if (host_memory(backend_)) {
      std::memset(reinterpret_cast<void*>(va), 0, P);
    } else {
      backend_.copy_from_host(va, zero_block_, P, 0);
    }
  }
  scrubbed_pages_ += columns.size();
}

void Scrubber::add_stats(Stats& out) const {
  out.emplace_back("scrub", enabled_ ? 1 : 0);
  out.emplace_back("scrubbed_pages", static_cast<int64_t>(scrubbed_pages_));
}

void Scrubber::close() {
  if (zero_block_ == nullptr) return;
  backend_.free_host(zero_block_);
  zero_block_ = nullptr;
}

}  // namespace vattention
