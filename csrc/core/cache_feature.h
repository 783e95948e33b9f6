// CacheFeature: what a part of a coordinator (sharing, swap, windows, scrubbing, engine blocks,
// ...) tells the shared calls, so that stats(), check_invariants() and close() never call a part
// by name: each coordinator registers its parts once and they are called through this
// interface, in registration order.
//
// Every hook runs under the cache mutex.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "core/backend.h"
#include "core/stats.h"

namespace vattention {

class CacheFeature {
 public:
  virtual ~CacheFeature() = default;
  // Appends this part's entries to stats() (none by default).
  virtual void add_stats(Stats& /*out*/) const {}
  // Adds the pool references this part holds (beyond row mappings) to `seen`, and checks its own
  // invariants: "" or a description of what is wrong. A part that holds no page has nothing to
  // add (the default).
  virtual std::string check(std::map<PageHandle, uint32_t>& /*seen*/) const { return ""; }
  // close(): give back what holds pages or memory, before the pool destroys every page. Returns
  // normally or throws the first failure (close() goes on with the other parts). Nothing by
  // default.
  virtual void close() {}
};

}  // namespace vattention
