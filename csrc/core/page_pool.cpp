#include "core/page_pool.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <limits>
#include <string>

#include "core/errors.h"

namespace vattention {

namespace {

// Adds the nanoseconds from its construction to its destruction to `total` (a throwing call too).
class Timed {
 public:
  explicit Timed(uint64_t& total) : total_(total), start_(std::chrono::steady_clock::now()) {}
  ~Timed() {
    total_ += static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::steady_clock::now() - start_)
                                        .count());
  }
  Timed(const Timed&) = delete;
  Timed& operator=(const Timed&) = delete;

 private:
  uint64_t& total_;
  const std::chrono::steady_clock::time_point start_;
};

}  // namespace

PageHandle PagePool::create_one() {
  Timed timed(create_ns_);
  return backend_.create_page();
}

void PagePool::destroy_one(PageHandle page) {
  Timed timed(destroy_ns_);
  backend_.destroy_page(page);
}

PagePool::PagePool(Backend& backend, int64_t budget_bytes)
    : backend_(backend), page_bytes_(backend.page_bytes()), budget_bytes_(budget_bytes) {}

PagePool::~PagePool() {
  try {
    destroy_all();
  } catch (...) {
    // A destructor must not throw; close() calls destroy_all() itself to report failures.
  }
}

void PagePool::destroy_all() {
  // Every page gets its try, and a failed one a second: one failed release must not leak others.
  std::exception_ptr first;
  std::vector<PageHandle> failed;
  auto destroy = [&](PageHandle p, bool record) {
    try {
      destroy_one(p);
    } catch (...) {
      if (!first) first = std::current_exception();
      if (record) failed.push_back(p);
    }
  };
  for (PageHandle p : free_) destroy(p, true);
  for (const auto& entry : refs_) destroy(entry.first, true);
  for (PageHandle p : failed) destroy(p, false);
  destroyed_ += total_;
  total_ = 0;
  free_.clear();
  refs_.clear();
  extra_refs_ = 0;
  if (first) std::rethrow_exception(first);
}

size_t PagePool::headroom() const {
  if (budget_bytes_ < 0) return std::numeric_limits<size_t>::max();
  const size_t cap = static_cast<size_t>(budget_bytes_) / page_bytes_;
  return cap > total_ + creating_ ? cap - total_ - creating_ : 0;
}

size_t PagePool::free_shortfall() const {
  const size_t have = free_.size() + creating_;
  return free_target_ > have ? std::min(free_target_ - have, headroom()) : 0;
}

size_t PagePool::begin_create(size_t n) {
  const size_t allowed = std::min(n, headroom());
  creating_ += allowed;
  return allowed;
}

void PagePool::end_create(size_t reserved, const std::vector<PageHandle>& made) {
  creating_ -= reserved;
  for (PageHandle p : made) {
    ++created_;
    if (headroom() == 0) {  // the budget was lowered meanwhile
      try {
        destroy_one(p);
        ++destroyed_;
        continue;
      } catch (...) {
        // Keep it: a page the pool knows is better than a leaked one.
      }
    }
    free_.push_back(p);
    ++total_;
  }
}

uint32_t PagePool::refs(PageHandle page) const {
  auto it = refs_.find(page);
  return it == refs_.end() ? 0 : it->second;
}

void PagePool::reserve(size_t num_pages) {
  if (num_pages <= total_) return;
  const size_t want = num_pages - total_;
  if (want > headroom()) {
    throw Error(Error::Kind::OutOfPages, "reserve of " + std::to_string(num_pages) + " pages (" +
                                             std::to_string(num_pages * page_bytes_) +
                                             " bytes) exceeds the memory budget of " +
                                             std::to_string(budget_bytes_) + " bytes (" +
                                             std::to_string(total_) + " pages exist, " +
                                             std::to_string(headroom()) + " more allowed)")
        .with("pages_needed", static_cast<int64_t>(want))
        .with("pages_available", static_cast<int64_t>(headroom()));
  }
  std::vector<PageHandle> made;
  made.reserve(want);
  try {
    while (made.size() < want) made.push_back(create_one());
  } catch (const Error& e) {
    for (PageHandle p : made) destroy_one(p);
    if (e.kind() != Error::Kind::OutOfPages) throw;
    throw Error(Error::Kind::OutOfPages, "reserve of " + std::to_string(num_pages) +
                                             " pages failed: the backend refused page " +
                                             std::to_string(total_ + made.size() + 1) + " (" +
                                             e.what() + ")")
        .with("pages_needed", static_cast<int64_t>(want))
        .with("pages_available", static_cast<int64_t>(made.size()));
  }
  free_.insert(free_.end(), made.begin(), made.end());
  total_ += made.size();
  created_ += made.size();
}

std::vector<PageHandle> PagePool::take(size_t num_pages) {
  std::vector<PageHandle> got;
  got.reserve(num_pages);
  while (got.size() < num_pages && !free_.empty()) {
    got.push_back(free_.back());
    free_.pop_back();
  }
  size_t creatable = headroom();
  try {
    while (got.size() < num_pages && creatable > 0) {
      got.push_back(create_one());
      ++total_;
      ++created_;
      --creatable;
    }
  } catch (const Error& e) {
    if (e.kind() != Error::Kind::OutOfPages) {
      free_.insert(free_.end(), got.begin(), got.end());
      throw;
    }
  }
  for (PageHandle p : got) refs_[p] = 1;
  return got;
}

void PagePool::untake(const std::vector<PageHandle>& pages, size_t num_created) {
  for (PageHandle p : pages) {
    auto it = refs_.find(p);
    if (it != refs_.end()) {
      extra_refs_ -= it->second - 1;
      refs_.erase(it);
    }
    free_.push_back(p);
  }
  for (size_t i = 0; i < num_created && !free_.empty(); ++i) {
    destroy_one(free_.back());
    free_.pop_back();
    --total_;
    ++destroyed_;
  }
}

void PagePool::roll_back(const Counts& before) {
  while (total_ > before.total && !free_.empty()) {
    try {
      destroy_one(free_.back());
    } catch (...) {
      break;  // the call's own error is the one to report; the page stays, counted
    }
    free_.pop_back();
    --total_;
  }
  // total_ == created_ - destroyed_ at every moment, so the net change is total_ - before.total.
  created_ = before.created + (total_ > before.total ? total_ - before.total : 0);
  destroyed_ = before.destroyed + (before.total > total_ ? before.total - total_ : 0);
}

void PagePool::share(PageHandle page) {
  ++refs_.at(page);
  ++extra_refs_;
}

void PagePool::release(PageHandle page) {
  auto it = refs_.find(page);
  if (it == refs_.end()) return;
  if (--it->second == 0) {
    refs_.erase(it);
    free_.push_back(page);
  } else {
    --extra_refs_;
  }
}

size_t PagePool::shrink(size_t keep_bytes) {
  size_t destroyed = 0;
  while (!free_.empty() && total_ * page_bytes_ > keep_bytes) {
    destroy_one(free_.back());
    free_.pop_back();
    --total_;
    ++destroyed_;
    ++destroyed;
  }
  return destroyed;
}

}  // namespace vattention
