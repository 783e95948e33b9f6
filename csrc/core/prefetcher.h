// Prefetcher: one persistent background thread that runs "map ahead" jobs for a cache.
//
// Why: creating and mapping pages costs tens to hundreds of microseconds each on a GPU; done inline
// in step() it would stall every iteration that crosses a page boundary. While iteration N
// computes, this thread maps what iteration N+1 needs, so step() finds it already mapped.
//
// One thread per cache, created lazily on the first submit(), woken by a condition variable (no
// spinning, no thread per call). It never touches Python. A newer job replaces a pending one that
// has not started (only the latest look-ahead matters). wait() blocks until nothing is pending or
// running. The job function reports its own errors to the cache; an exception escaping it is kept
// and handed to the next wait() caller.
//
// Lock order: Prefetcher::mu_ is a leaf with respect to the cache: the worker never holds mu_ while
// running a job (which takes the cache mutex), and the cache never calls submit()/wait() while it
// holds its own mutex.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace vattention {

class Prefetcher {
 public:
  using Job = std::vector<int64_t>;  // per-slot target token counts, -1 = leave the slot alone
  using Runner = std::function<void(const Job&)>;

  explicit Prefetcher(Runner runner) : runner_(std::move(runner)) {}
  ~Prefetcher() { stop(); }
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // Queues `job` (replacing a queued one not yet started) and returns at once.
  void submit(Job job);
  // Queues a job that lists no slot, unless one is queued already, and returns at once: the
  // runner ends every job by topping the pool's free pages up to its headroom
  // (background_mapper.h), so a queued job of either kind does it.
  void request_refill();
  // Blocks until no job is queued or running. Rethrows an exception that escaped a job.
  void wait();
  // True when no job is queued or running (cheap; for the step() fast path).
  bool idle() const;
  // Finishes the running job, drops a queued one, and joins the thread. Idempotent.
  void stop();

 private:
  void loop();

  Runner runner_;
  mutable std::mutex mu_;
  std::condition_variable wake_;  // worker waits for a job or stop
  std::condition_variable done_;  // wait() callers wait for idle
  std::thread thread_;
  Job pending_;
  bool has_pending_ = false;
  bool running_ = false;
  bool stopping_ = false;
  std::exception_ptr error_;
};

}  // namespace vattention
