// CacheGuard: the cache mutex, and the two facts every call checks when it takes it: is the
// cache closed, and did the prefetch thread fail since (its error is raised, typed, by the next
// call on the cache).
//
// Lock order (kv_cache.h): Prefetcher::mu_ is never held while taking this mutex, and this mutex
// is never held while waiting on the prefetcher. The backend's own locks are leaves below it.
#pragma once

#include <exception>
#include <mutex>

#include "core/errors.h"
#include "core/prefetch_gate.h"

namespace vattention {

class CacheGuard {
 public:
  using Lock = std::unique_lock<std::mutex>;

  CacheGuard() = default;
  CacheGuard(const CacheGuard&) = delete;
  CacheGuard& operator=(const CacheGuard&) = delete;

  std::mutex& mutex() const { return mu_; }
  // Takes the mutex, then throws Closed, or the prefetch thread's error (once).
  Lock enter() {
    Lock lock(mu_);
    check_open();
    rethrow_background_error();
    return lock;
  }
  // The same after settling `gate` (nothing mapped or created outside the mutex any more), for
  // calls that may unmap or pick any slot (rule R, prefetch_gate.h).
  Lock enter_settled(PrefetchGate& gate) {
    Lock lock(mu_);
    gate.settle(lock);
    check_open();
    rethrow_background_error();
    return lock;
  }
  // Under the mutex:
  bool closed() const { return closed_; }
  void mark_closed() { closed_ = true; }
  void check_open() const {
    if (closed_) throw Error(Error::Kind::Closed, "the KV cache is closed; create a new KVCache");
  }
  // True when the prefetch thread failed and no call has raised its error yet.
  bool failed() const { return static_cast<bool>(background_error_); }
  void record_background_error(std::exception_ptr error) { background_error_ = error; }
  void rethrow_background_error() {
    if (!background_error_) return;
    std::exception_ptr e = background_error_;
    background_error_ = nullptr;
    std::rethrow_exception(e);
  }

 private:
  mutable std::mutex mu_;
  bool closed_ = false;
  std::exception_ptr background_error_;
};

}  // namespace vattention
