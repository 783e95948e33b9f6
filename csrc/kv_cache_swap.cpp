// KVCacheCore, part 3: swapping slots to host memory and choosing victims for preemption.
//
// Why swap pages and not tokens: a slot's memory is whole pages in every tensor, so the cheapest
// faithful copy is page by page; swap-in maps pages back in one map_slot() run and copies them,
// bit-identical, into a possibly different slot (addresses differ, contents do not).
//
// Shared pages are swapped by reference: while another active slot maps a page, swapping it out
// frees no memory, so the handle keeps a pool reference instead of a copy. A page whose only
// holders are handles (or idle slots) is copied to host exactly once, at the next swap_out, and
// every handle referring to it then shares that one host block.
//
// Ordering (CUDA): copies are stream-ordered; swap_out waits on a fence on the caller's stream
// before it unmaps the slot (unmapping is not stream-ordered), swap_in before it frees host blocks.
#include <algorithm>
#include <map>
#include <string>
#include <unordered_map>

#include "kv_cache.h"

namespace vattention {

void KVCacheCore::set_swap_budget(int64_t budget_bytes) {
  Lock lock(mu_);
  check_open();
  swap_->set_budget(budget_bytes < 0 ? SwapStore::kNoBudget : budget_bytes);
}

void KVCacheCore::copy_page_to_host(PageHandle page, void* dst, uintptr_t stream) {
  // The page may be mapped nowhere: map it at the staging address for the copy.
  stage(page);
  try {
    backend_->copy_to_host(dst, staging_.va, geo_.page_bytes, stream);
    sync_stream(stream);
  } catch (...) {
    try {
      unstage();
    } catch (...) {  // the page stays staged (referenced); the first error is the one to report
    }
    throw;
  }
  unstage();
}

int64_t KVCacheCore::swap_out(int slot, uintptr_t stream) {
  prefetcher_->wait();
  Lock lock(mu_);
  settle(lock);  // another thread may have queued a prefetch since (rule R, kv_cache_prefetch.cpp)
  check_open();
  rethrow_background_error();
  require_active(slot, "slot", "is not an active slot: only active slots can be swapped out");
  Slot& s = slots_[static_cast<size_t>(slot)];
  const size_t C = geo_.columns();
  const size_t P = geo_.page_bytes;
  const size_t n = geo_.pages_for(s.seq_len);

  // Pages some other active slot maps stay on the device; everything else this slot saves, and
  // every page handles keep by reference that no active slot maps any more, goes to host once.
  std::unordered_map<PageHandle, uint32_t> active_maps;
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (static_cast<int>(i) == slot || slots_[i].state != Slot::State::Active) continue;
    for (PageHandle p : slots_[i].pages) ++active_maps[p];  // kNoPage entries match nothing below
  }
  std::map<PageHandle, std::shared_ptr<HostBlock>> copies;
  std::vector<std::pair<PageHandle, uintptr_t>> order;  // page, an address it is mapped at (0: none)
  for (size_t i = 0; i < n * C; ++i) {
    const PageHandle p = s.pages[i];
    if (p == kNoPage) continue;  // released by a sliding window: nothing to save
    if (active_maps.count(p) == 0 && copies.emplace(p, nullptr).second) {
      order.emplace_back(p, column_va(i % C, slot, i / C));
    }
  }
  for (const auto& entry : swap_->device_refs()) {
    if (active_maps.count(entry.first) == 0 && copies.emplace(entry.first, nullptr).second) {
      order.emplace_back(entry.first, 0);
    }
  }
  swap_->check_room(order.size());  // SwapSpace: nothing changed
  for (const auto& item : order) copies[item.first] = swap_->make_block();
  for (const auto& item : order) {
    void* dst = copies[item.first]->data();
    if (item.second != 0) {
      backend_->copy_to_host(dst, item.second, P, stream);
    } else {
      copy_page_to_host(item.first, dst, stream);
    }
  }
  sync_stream(stream);  // copies done, and no queued kernel still reads the slot

  SwapRecord record;
  record.seq_len = s.seq_len;
  record.pages = n;
  record.shared_pages = std::min(s.shared_pages, n);
  record.entries.resize(n * C);
  for (size_t i = 0; i < n * C; ++i) {
    if (s.pages[i] == kNoPage) {
      record.entries[i].device = kNoPage;  // a hole: restored as one by swap_in
      continue;
    }
    auto it = copies.find(s.pages[i]);
    if (it != copies.end()) {
      record.entries[i].host = it->second;
    } else {
      record.entries[i].device = s.pages[i];
      pool_->share(s.pages[i]);  // the handle's reference, taken before the slot drops its own
    }
  }
  try {
    unmap_tail(s, slot, 0);
  } catch (...) {
    for (const SwapEntry& e : record.entries) {
      if (!e.host && e.device != kNoPage) pool_->release(e.device);
    }
    throw;
  }
  // Handles that kept a now-copied page by reference switch to the host copy.
  for (auto& rec : swap_->records()) {
    for (SwapEntry& e : rec.second.entries) {
      if (e.host) continue;
      auto it = copies.find(e.device);
      if (it == copies.end()) continue;
      pool_->release(e.device);
      e.host = it->second;
      e.device = 0;
    }
  }
  s.state = Slot::State::Free;
  s.seq_len = 0;
  s.shared_pages = 0;
  s.freed_at = ++free_counter_;
  counters_.swap_out_pages += order.size();
  return swap_->add(std::move(record));
}

int KVCacheCore::swap_in(int64_t handle, uintptr_t stream) {
  prefetcher_->wait();
  Lock lock(mu_);
  settle(lock);  // another thread may have queued a prefetch since (rule R, kv_cache_prefetch.cpp)
  check_open();
  rethrow_background_error();
  drain_eager();
  SwapRecord& rec = swap_->get(handle);
  const size_t C = geo_.columns();
  const int slot = pick_fresh_slot();
  Slot& d = slots_[static_cast<size_t>(slot)];
  size_t from_host = 0;
  for (const SwapEntry& e : rec.entries) from_host += e.host ? 1 : 0;
  std::vector<PageHandle> fresh;
  try {
    fresh = obtain(from_host, {}, true);  // may reclaim idle slots, `slot` included
  } catch (const Error& e) {
    if (e.kind() == Error::Kind::OutOfPages) ++counters_.oom_events;
    throw;
  }
  std::vector<PageHandle> handles(rec.entries.size());
  for (size_t i = 0, k = 0; i < handles.size(); ++i) {
    handles[i] = rec.entries[i].host ? fresh[k++] : rec.entries[i].device;
  }
  try {
    unmap_tail(d, slot, 0);  // an idle slot waits on its free() fence inside
    // The handle's device references become the mapping's references: no refcount change.
    if (rec.pages > 0) map_slot(slot, 0, rec.pages, handles.data(), false);
  } catch (...) {
    for (PageHandle p : fresh) pool_->release(p);
    throw;
  }
  try {
    for (size_t i = 0; i < handles.size(); ++i) {
      if (!rec.entries[i].host) continue;
      backend_->copy_from_host(column_va(i % C, slot, i / C),
                               rec.entries[i].host->data(), geo_.page_bytes, stream);
    }
    sync_stream(stream);  // before the host blocks may be freed
  } catch (...) {
    for (const SwapEntry& e : rec.entries) {
      if (!e.host && e.device != kNoPage) pool_->share(e.device);  // the record keeps its references
    }
    try {
      unmap_tail(d, slot, 0);
    } catch (...) {
    }
    throw;
  }
  if (d.has_fence) {
    backend_->fence_release(d.fence);
    d.has_fence = false;
  }
  d.state = Slot::State::Active;
  d.seq_len = rec.seq_len;
  d.shared_pages = rec.shared_pages;
  d.last_step = step_counter_;
  counters_.swap_in_pages += from_host;
  swap_->erase(handle);
  return slot;
}

void KVCacheCore::swap_drop(int64_t handle) {
  Lock lock(mu_);
  check_open();
  SwapRecord& rec = swap_->get(handle);
  for (const SwapEntry& e : rec.entries) {
    if (!e.host && e.device != kNoPage) pool_->release(e.device);
  }
  swap_->erase(handle);
}

std::vector<int> KVCacheCore::pick_victims(size_t bytes_needed) const {
  Lock lock(mu_);
  check_open();
  std::vector<int> order;
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].state == Slot::State::Active) order.push_back(static_cast<int>(i));
  }
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    const Slot& x = slots_[static_cast<size_t>(a)];
    const Slot& y = slots_[static_cast<size_t>(b)];
    if (x.last_step != y.last_step) return x.last_step < y.last_step;
    return x.seq_len < y.seq_len;
  });
  // References that would be gone: idle mappings (reclaimed on demand) plus the victims'.
  std::unordered_map<PageHandle, uint32_t> dropped;
  for (const Slot& s : slots_) {
    if (s.state == Slot::State::Idle) {
      for (PageHandle p : s.pages) {
        if (p != kNoPage) ++dropped[p];
      }
    }
  }
  std::vector<int> victims;
  size_t freed_bytes = 0;
  for (int v : order) {
    if (freed_bytes >= bytes_needed) break;
    victims.push_back(v);
    for (PageHandle p : slots_[static_cast<size_t>(v)].pages) {
      if (p != kNoPage && ++dropped[p] == pool_->refs(p)) freed_bytes += geo_.page_bytes;
    }
  }
  return victims;
}

}  // namespace vattention
