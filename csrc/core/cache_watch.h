// CacheWatch: what a backend may keep per cache while the cache lives (the host backend: the fault
// report that names the cache, tensor, slot and token of a bad access). Backend::watch_cache makes
// it; the cache drops it before its reservations go.
#pragma once

namespace vattention {

class CacheWatch {
 public:
  virtual ~CacheWatch() = default;
  // The cache was closed: its tensors are dangling from now on.
  virtual void mark_closed() = 0;
};

}  // namespace vattention
