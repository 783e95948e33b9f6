#include "core/swap_store.h"

#include <limits>
#include <string>

#include "core/errors.h"
#include "core/slot.h"

namespace vattention {

size_t SwapStore::headroom() const {
  if (budget_bytes_ < 0) return std::numeric_limits<size_t>::max();
  const auto budget = static_cast<size_t>(budget_bytes_);
  return budget > host_bytes_ ? budget - host_bytes_ : 0;
}

void SwapStore::check_room(size_t buffers) const {
  const size_t need = buffers * page_bytes_;
  if (need <= headroom()) return;
  throw Error(Error::Kind::SwapSpace,
              "swapping needs " + std::to_string(need) + " bytes of host memory (" +
                  std::to_string(buffers) + " pages of " + std::to_string(page_bytes_) +
                  " bytes) but the swap budget of " + std::to_string(budget_bytes_) +
                  " bytes has " + std::to_string(headroom()) + " left (" +
                  std::to_string(host_bytes_) +
                  " in use); nothing was swapped: raise it with "
                  "set_swap_budget() or drop handles with swap_drop()")
      .with("bytes_needed", static_cast<int64_t>(need))
      .with("bytes_available", static_cast<int64_t>(headroom()))
      .with("swap_budget", budget_bytes_);
}

std::shared_ptr<SwapBuffer> SwapStore::make_buffer() {
  check_room(1);
  void* data = backend_.alloc_host(page_bytes_);
  if (!data) {
    throw Error(Error::Kind::SwapSpace, "allocating " + std::to_string(page_bytes_) +
                                            " bytes of host memory for swap failed (" +
                                            std::to_string(host_bytes_) + " bytes in use)")
        .with("bytes_needed", static_cast<int64_t>(page_bytes_))
        .with("bytes_available", 0)
        .with("swap_budget", budget_bytes_);
  }
  return std::make_shared<SwapBuffer>(backend_, data, page_bytes_, &host_bytes_);
}

int64_t SwapStore::add(SwapRecord record) {
  const int64_t handle = next_handle_++;
  records_.emplace(handle, std::move(record));
  return handle;
}

SwapRecord& SwapStore::get(int64_t handle) {
  auto it = records_.find(handle);
  if (it == records_.end()) {
    throw Error(Error::Kind::InvalidSlot, "swap handle " + std::to_string(handle) +
                                              " is unknown: never returned by swap_out(), or "
                                              "already swapped in or dropped")
        .with("handle", handle);
  }
  return it->second;
}

std::map<PageHandle, size_t> SwapStore::device_refs() const {
  std::map<PageHandle, size_t> refs;
  for (const auto& rec : records_) {
    for (const SwapEntry& e : rec.second.entries) {
      if (!e.host && e.device != kNoPage) ++refs[e.device];  // kNoPage: a released window page
    }
  }
  return refs;
}

}  // namespace vattention
