#include "core/swap_manager.h"

#include <algorithm>
#include <map>
#include <memory>
#include <unordered_map>
#include <utility>

namespace vattention {

void SwapManager::set_budget(int64_t budget_bytes) {
  store_.set_budget(budget_bytes < 0 ? SwapStore::kNoBudget : budget_bytes);
}

void SwapManager::copy_page_to_host(PageHandle page, void* dst, uintptr_t stream) {
  // The page may be mapped nowhere: map it at the staging address for the copy.
  staging_.stage(page);
  try {
    parts_.backend.copy_to_host(dst, staging_.va(), parts_.geo.page_bytes, stream);
    parts_.memory.sync_stream(stream);
  } catch (...) {
    try {
      staging_.unstage();
    } catch (...) {  // the page stays staged (referenced); the first error is the one to report
    }
    throw;
  }
  staging_.unstage();
}

int64_t SwapManager::swap_out(int slot, uintptr_t stream) {
  SlotTable& slots = parts_.slots;
  slots.require_active(slot, "slot", "is not an active slot: only active slots can be swapped out");
  const Slot& s = slots[static_cast<size_t>(slot)];
  const std::vector<PageHandle>& pages = s.pages.handles();
  const size_t C = parts_.geo.columns();
  const size_t P = parts_.geo.page_bytes;
  // Its read end's pages (read_tail.h: a zeroed tail comes back with them).
  const size_t n = std::min(s.pages.mapped(), parts_.geo.read_pages(s.use.seq_len()));

  // Pages some other active slot maps stay on the device; everything else this slot saves, and
  // every page handles keep by reference that no active slot maps any more, goes to host once.
  std::unordered_map<PageHandle, uint32_t> active_maps;
  for (size_t i = 0; i < slots.size(); ++i) {
    if (static_cast<int>(i) == slot || !slots[i].use.active()) continue;
    for (PageHandle p : slots[i].pages.handles()) ++active_maps[p];  // kNoPage matches nothing
  }
  std::map<PageHandle, std::shared_ptr<SwapBuffer>> copies;
  std::vector<std::pair<PageHandle, uintptr_t>>
      order;  // page, an address it is mapped at (0: none)
  for (size_t i = 0; i < n * C; ++i) {
    const PageHandle p = pages[i];
    if (p == kNoPage) continue;  // released by a sliding window: nothing to save
    if (active_maps.count(p) == 0 && copies.emplace(p, nullptr).second) {
      order.emplace_back(p, parts_.mapper.column_va(i % C, slot, i / C));
    }
  }
  for (const auto& entry : store_.device_refs()) {
    if (active_maps.count(entry.first) == 0 && copies.emplace(entry.first, nullptr).second) {
      order.emplace_back(entry.first, 0);
    }
  }
  store_.check_room(order.size());  // SwapSpace: nothing changed
  for (const auto& item : order) copies[item.first] = store_.make_buffer();
  for (const auto& item : order) {
    void* dst = copies[item.first]->data();
    if (item.second != 0) {
      parts_.backend.copy_to_host(dst, item.second, P, stream);
    } else {
      copy_page_to_host(item.first, dst, stream);
    }
  }
  parts_.memory.sync_stream(stream);  // copies done, and no queued kernel still reads the slot

  SwapRecord record;
  record.seq_len = s.use.seq_len();
  record.pages = n;
  record.read_only = std::min(s.pages.read_only(), n);
  record.finite = std::min(s.pages.finite(), parts_.geo.tokens_in(n));
  record.entries.resize(n * C);
  for (size_t i = 0; i < n * C; ++i) {
    if (pages[i] == kNoPage) {
      record.entries[i].device = kNoPage;  // a hole: restored as one by swap_in
      continue;
    }
    auto it = copies.find(pages[i]);
    if (it != copies.end()) {
      record.entries[i].host = it->second;
    } else {
      record.entries[i].device = pages[i];
      parts_.pool.share(pages[i]);  // the handle's reference, taken before the slot drops its own
    }
  }
  try {
    parts_.memory.unmap_tail(slot, 0);
  } catch (...) {
    for (const SwapEntry& e : record.entries) {
      if (!e.host && e.device != kNoPage) parts_.pool.release(e.device);
    }
    throw;
  }
  // Handles that kept a now-copied page by reference switch to the host copy.
  for (auto& rec : store_.records()) {
    for (SwapEntry& e : rec.second.entries) {
      if (e.host) continue;
      auto it = copies.find(e.device);
      if (it == copies.end()) continue;
      parts_.pool.release(e.device);
      e.host = it->second;
      e.device = 0;
    }
  }
  slots.deactivate(slot);  // its pages went: the slot is free
  parts_.memory.set_read_only(slot, 0);
  swap_out_pages_ += order.size();
  return store_.add(std::move(record));
}

int SwapManager::swap_in(int64_t handle, uintptr_t stream) {
  SwapRecord& rec = store_.get(handle);
  const size_t C = parts_.geo.columns();
  const int slot = parts_.slots.pick_fresh();
  size_t from_host = 0;
  for (const SwapEntry& e : rec.entries) from_host += e.host ? 1 : 0;
  std::vector<PageHandle> fresh;
  try {
    fresh = parts_.supply.obtain(from_host, {}, true);  // may reclaim idle slots, `slot` included
  } catch (const Error& e) {
    if (e.kind() == Error::Kind::OutOfPages) ++parts_.counters.oom_events;
    throw;
  }
  std::vector<PageHandle> handles(rec.entries.size());
  for (size_t i = 0, k = 0; i < handles.size(); ++i) {
    handles[i] = rec.entries[i].host ? fresh[k++] : rec.entries[i].device;
  }
  try {
    parts_.memory.unmap_tail(slot, 0);  // an idle slot waits on its free() fence inside
    // The handle's device references become the mapping's references: no refcount change.
    if (rec.pages > 0) parts_.memory.map(slot, 0, rec.pages, handles.data());
  } catch (...) {
    for (PageHandle p : fresh) parts_.pool.release(p);
    throw;
  }
  try {
    for (size_t i = 0; i < handles.size(); ++i) {
      if (!rec.entries[i].host) continue;
      parts_.backend.copy_from_host(parts_.mapper.column_va(i % C, slot, i / C),
                                    rec.entries[i].host->data(), parts_.geo.page_bytes, stream);
    }
    parts_.memory.sync_stream(stream);  // before the host buffers may be freed
  } catch (...) {
    for (const SwapEntry& e : rec.entries) {
      if (!e.host && e.device != kNoPage) parts_.pool.share(e.device);  // the record keeps its refs
    }
    try {
      parts_.memory.unmap_tail(slot, 0);
    } catch (...) {
    }
    throw;
  }
  parts_.memory.forget_fence(slot);
  parts_.slots.activate(slot, rec.seq_len);
  parts_.memory.set_read_only(slot, rec.read_only);
  parts_.memory.set_finite(slot, rec.finite);  // bit-identical pages: what was finite still is
  swap_in_pages_ += from_host;
  store_.erase(handle);
  return slot;
}

void SwapManager::drop(int64_t handle) {
  SwapRecord& rec = store_.get(handle);
  for (const SwapEntry& e : rec.entries) {
    if (!e.host && e.device != kNoPage) parts_.pool.release(e.device);
  }
  store_.erase(handle);
}

void SwapManager::add_stats(Stats& out) const {
  out.emplace_back("swap_handles", static_cast<int64_t>(store_.size()));
  out.emplace_back("swap_host_bytes", static_cast<int64_t>(store_.host_bytes()));
  out.emplace_back("swap_budget", store_.budget_bytes());
  out.emplace_back("swap_device_pages", static_cast<int64_t>(store_.device_refs().size()));
  out.emplace_back("swap_out_pages", static_cast<int64_t>(swap_out_pages_));
  out.emplace_back("swap_in_pages", static_cast<int64_t>(swap_in_pages_));
}

std::string SwapManager::check(std::map<PageHandle, uint32_t>& seen) const {
  for (const auto& entry : store_.device_refs())
    seen[entry.first] += static_cast<uint32_t>(entry.second);
  return "";
}

void SwapManager::close() { store_.clear(); }

}  // namespace vattention
