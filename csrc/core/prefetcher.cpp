#include "core/prefetcher.h"

namespace vattention {

void Prefetcher::submit(Job job) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return;
  pending_ = std::move(job);
  has_pending_ = true;
  if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
  wake_.notify_one();
}

void Prefetcher::request_refill() {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_ || has_pending_) return;
  pending_.clear();
  has_pending_ = true;
  if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
  wake_.notify_one();
}

void Prefetcher::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [this] { return !has_pending_ && !running_; });
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

bool Prefetcher::idle() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !has_pending_ && !running_ && !error_;
}

void Prefetcher::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    has_pending_ = false;
    wake_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
  done_.notify_all();
}

void Prefetcher::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    wake_.wait(lock, [this] { return stopping_ || has_pending_; });
    if (stopping_) break;
    Job job = std::move(pending_);
    has_pending_ = false;
    running_ = true;
    lock.unlock();
    try {
      runner_(job);
    } catch (...) {
      lock.lock();
      error_ = std::current_exception();
      lock.unlock();
    }
    lock.lock();
    running_ = false;
    done_.notify_all();
  }
  running_ = false;
  done_.notify_all();
}

}  // namespace vattention
