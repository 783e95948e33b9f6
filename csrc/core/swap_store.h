// SwapStore: host-side state of slots swapped out of the KV cache.
//
// Why in C++ and not Python: a swapped slot's pages are either host copies or, when another live
// slot still maps them, references to the very same physical page (pool refcount). Keeping those
// references next to the pool, under the cache's mutex, lets check_invariants() count them, lets
// close() drop them before the pool is destroyed, and keeps the copies, fences and rollback in one
// transaction with the mapping calls. Python only sees an integer handle.
//
// Memory: host buffers are one page_bytes each, from Backend::alloc_host() (pinned on CUDA). One
// buffer may back several records (a page shared by several swapped slots is copied once). The
// budget counts distinct buffers; SwapStore never exceeds it (Error(Kind::SwapSpace) instead).
//
// Not thread-safe: the owning KVCacheCore serializes calls under its mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "core/backend.h"
#include "core/swap_buffer.h"

namespace vattention {

// Where one (page index, tensor) of a swapped slot lives until swap-in.
struct SwapEntry {
  PageHandle device = 0;  // valid when host is null: the store holds one pool reference
  std::shared_ptr<SwapBuffer> host;  // the page's bytes, when copied out
};

struct SwapRecord {
  int64_t seq_len = 0;  // tokens the slot held (its last step() length)
  size_t pages = 0;  // page indices saved: [0, pages), read_pages(seq_len)
  int64_t finite = 0;  // the slot's finite tokens (read_tail.h), restored by swap-in
  size_t read_only = 0;  // the slot's read-only prefix (page indices), restored by swap-in
  std::vector<SwapEntry> entries;  // pages * columns, index p * columns + column (as a row's)
};

class SwapStore {
 public:
  static constexpr int64_t kNoBudget = -1;

  SwapStore(Backend& backend, size_t page_bytes) : backend_(backend), page_bytes_(page_bytes) {}
  SwapStore(const SwapStore&) = delete;
  SwapStore& operator=(const SwapStore&) = delete;

  int64_t budget_bytes() const { return budget_bytes_; }
  void set_budget(int64_t bytes) { budget_bytes_ = bytes; }
  size_t host_bytes() const { return host_bytes_; }
  // Host bytes that may still be allocated within the budget (SIZE_MAX without a budget).
  size_t headroom() const;
  size_t size() const { return records_.size(); }

  // Allocates one host buffer. Throws Error(SwapSpace) when over budget or the allocation fails.
  std::shared_ptr<SwapBuffer> make_buffer();
  // Throws Error(SwapSpace) naming the numbers unless `buffers` more buffers fit in the budget.
  void check_room(size_t buffers) const;

  int64_t add(SwapRecord record);
  // Throws Error(InvalidSlot) naming the handle if it is unknown (never issued, or consumed).
  SwapRecord& get(int64_t handle);
  void erase(int64_t handle) { records_.erase(handle); }
  // Device pages held by reference, with the number of entries holding each.
  std::map<PageHandle, size_t> device_refs() const;
  // Every record, for promotion of device references to host copies.
  std::map<int64_t, SwapRecord>& records() { return records_; }
  // Drops every record and host buffer. Device references are NOT released: the caller does that
  // first (or is about to destroy the pool).
  void clear() { records_.clear(); }

 private:
  Backend& backend_;
  const size_t page_bytes_;
  int64_t budget_bytes_ = kNoBudget;
  size_t host_bytes_ = 0;
  int64_t next_handle_ = 1;
  std::map<int64_t, SwapRecord> records_;
};

}  // namespace vattention
