// Slot: one batch row of the cache, owned by at most one request at a time.
#pragma once

#include <cstdint>
#include <vector>

#include "backend.h"

namespace vattention {

struct Slot {
  enum class State : uint8_t {
    Free,    // no request, no pages
    Active,  // owned by a request
    Idle,    // request freed; pages still mapped (deferred reclamation) until needed elsewhere
  };
  State state = State::Free;
  int64_t seq_len = 0;               // length given by the last step() (tokens)
  size_t mapped = 0;                 // page indices [0, mapped) are mapped in every tensor
  int64_t backed = 0;                // tokens those pages back (geometry.tokens_in(mapped))
  std::vector<PageHandle> pages;     // mapped * num_tensors handles, index p * num_tensors + t
  uint64_t freed_at = 0;             // free() order, for least-recently-freed-first reclamation
  uint64_t last_step = 0;            // step() counter when last listed, for eviction policies
  uint64_t fence = 0;                // event recorded at free(): unmap only after it completed
  bool has_fence = false;
};

}  // namespace vattention
