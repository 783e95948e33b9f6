// StagingPage: one page of address space at which a page that is mapped nowhere (a swap handle's
// page, a page about to replace a shared one) is mapped for a copy.
//
// Why RAII: the address range is reserved on first use and given back on destruction, unless a
// page is still mapped there (an unmap failed twice): then the range is leaked with it, since a
// reservation with a live mapping cannot be freed. The mapping holds its own pool reference, so a
// page whose staging unmap failed is never back on the free list while mapped; a later stage() or
// close() clears a mapping left by an earlier failure.
//
// Not thread-safe: the owning cache serializes calls under its mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "core/backend.h"
#include "core/cache_feature.h"
#include "core/page_pool.h"
#include "core/stats.h"

namespace vattention {

class StagingPage final : public CacheFeature {
 public:
  StagingPage(Backend& backend, PagePool& pool, CacheCounters& counters);
  ~StagingPage() override;
  StagingPage(const StagingPage&) = delete;
  StagingPage& operator=(const StagingPage&) = delete;

  // The staging address (reserved on first use). Valid while the object lives.
  uintptr_t va();
  // Maps `page` at va() with access, taking a pool reference (undoing itself on failure).
  void stage(PageHandle page);
  bool staged() const { return staged_; }
  // Unmaps the staged page (retrying a failed unmap once) and drops its reference.
  void unstage();
  // The staging mapping's reference, for check_invariants(); "" or what is wrong.
  std::string check(std::map<PageHandle, uint32_t>& seen) const override;
  // Clears a mapping a failed unmap left behind (one more try; unstage() retries once itself).
  void close() override;

 private:
  Backend& backend_;
  PagePool& pool_;
  CacheCounters& counters_;
  uintptr_t va_ = 0;
  bool staged_ = false;      // va_ maps page_ (holding a pool reference)
  PageHandle page_ = 0;
};

}  // namespace vattention
