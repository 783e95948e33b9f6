#include "core/prefetch_gate.h"

#include <utility>

namespace vattention {

void PrefetchGate::begin(int slot, size_t from, size_t to, std::vector<PageHandle> pages) {
  flight_.slot = slot;
  flight_.from = from;
  flight_.to = to;
  flight_.pages = std::move(pages);
}

void PrefetchGate::publish() {
  flight_ = Flight{};
  ++publishes_;
  settled_.notify_all();
}

void PrefetchGate::created() {
  ++publishes_;  // wakes await_publish()/settle() callers waiting for pages
  settled_.notify_all();
}

void PrefetchGate::settle(Lock& lock) {
  if (!busy()) return;
  ++waiters_;
  settled_.wait(lock, [this] { return !busy(); });
  --waiters_;
}

void PrefetchGate::await_publish(Lock& lock) {
  if (!busy()) return;
  const uint64_t seen = publishes_;
  ++waiters_;
  settled_.wait(lock, [this, seen] { return publishes_ != seen; });
  --waiters_;
}

}  // namespace vattention
