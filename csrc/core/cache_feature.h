// CacheFeature: what a feature of the cache (sharing, swap, windows, scrubbing, ...) tells the
// coordinator, so that alloc(), stats(), check_invariants() and close() never call a feature by
// name: each feature registers once and is called through this interface, in registration order.
//
// Every hook runs under the cache mutex.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "core/backend.h"
#include "core/slot.h"
#include "core/stats.h"

namespace vattention {

class CacheFeature {
 public:
  virtual ~CacheFeature() = default;
  // alloc() hands `slot` (free, or idle with the previous request's pages still mapped) to a new
  // request: drop what the previous owner left that the new one must not inherit (it may unmap;
  // an idle slot's fence is waited for inside).
  virtual void reset_slot(Slot& /*slot*/, int /*index*/) {}
  // Appends this feature's entries to stats().
  virtual void add_stats(Stats& /*out*/) const {}
  // Adds the pool references this feature holds (beyond slot mappings) to `seen`, and checks its
  // own invariants: "" or a description of what is wrong.
  virtual std::string check(std::map<PageHandle, uint32_t>& /*seen*/) const { return ""; }
  // close(): give back what holds pages or memory, before the pool destroys every page. Returns
  // normally or throws the first failure (close() goes on with the other features).
  virtual void close() {}
};

}  // namespace vattention
