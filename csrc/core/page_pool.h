// PagePool: owns every physical page a cache has created.
//
// Why: creating a page is the slow driver call (~190 us per 2 MB page on an A100, against ~1.5 us
// to map one), so pages are created ahead of need (reserve) and recycled through a free list;
// the hot path never creates a page while a created one is free. A byte budget caps the pool, and
// shrink() hands free pages back to the OS/driver so memory is elastic.
//
// Every in-use page carries a reference count (one per mapping), so a page mapped at several
// virtual addresses (prefix sharing) goes back to the free list only when its last mapping goes.
// A free target (KVCache.set_headroom) is how many created-but-free pages the cache wants ready:
// the prefetch thread creates what free_shortfall() says, so a step finds them in the free list.
// The time creating and destroying pages took is counted here, where every such call is made
// (pages created outside the lock through begin/end_create are timed by their caller).
// Not thread-safe: the owning cache serializes calls under its mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "core/backend.h"

namespace vattention {

class PagePool {
 public:
  static constexpr int64_t kNoBudget = -1;

  PagePool(Backend& backend, int64_t budget_bytes);
  ~PagePool();  // destroys every page; callers unmap first (destroying a mapped page is legal)
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  size_t page_bytes() const { return page_bytes_; }
  size_t total() const { return total_; }
  size_t free() const { return free_.size(); }
  size_t in_use() const { return total_ - free_.size(); }
  int64_t budget_bytes() const { return budget_bytes_; }
  // Pages that may still be created within the budget (SIZE_MAX without a budget).
  size_t headroom() const;
  uint64_t pages_created() const { return created_; }
  uint64_t pages_destroyed() const { return destroyed_; }
  // Nanoseconds spent in the backend's create_page() (this pool's own calls: take, reserve) and
  // destroy_page() (every destruction).
  uint64_t create_ns() const { return create_ns_; }
  uint64_t destroy_ns() const { return destroy_ns_; }
  // Free pages to keep created ahead (0: none), and how many more to create for it now: the
  // target less the free pages and those being created, within the budget.
  size_t free_target() const { return free_target_; }
  void set_free_target(size_t pages) { free_target_ = pages; }
  size_t free_shortfall() const;
  uint32_t refs(PageHandle page) const;
  // References beyond the first, over all pages: 0 when no page is held twice (mapped at two
  // places, or kept by a swap handle, the staging address or an engine block besides its
  // mapping). O(1), so reclamation can take its cheap path when nothing is shared.
  size_t extra_refs() const { return extra_refs_; }

  // Makes total() >= num_pages by creating pages. All-or-nothing: on failure the pages this call
  // created are destroyed and Error(OutOfPages) says how many were needed and possible.
  void reserve(size_t num_pages);

  // Takes up to `num_pages` pages with refcount 1: free ones first, then newly created ones within
  // the budget. Stops early (returning fewer) only when the budget or the backend refuses more;
  // other backend errors propagate after the pages taken so far are returned.
  std::vector<PageHandle> take(size_t num_pages);
  // Creation outside the owner's lock (the prefetch thread): begin_create(n) counts up
  // to n pages against the budget (headroom() excludes them) and returns how many the caller may
  // create; the caller creates them with the backend, unlocked, and hands what it got to
  // end_create(reserved, made), which adds them to the free list (destroying any a budget lowered
  // meanwhile no longer allows). Both under the owner's lock.
  size_t begin_create(size_t n);
  void end_create(size_t reserved, const std::vector<PageHandle>& made);
  size_t creating() const { return creating_; }
  // Undoes take(): returns `pages` to the free list and destroys the last `num_created` of them
  // (the ones take() created), so the pool is as it was before.
  void untake(const std::vector<PageHandle>& pages, size_t num_created);
  // What the pool counts, at one moment: a failed call's rollback goes back to it.
  struct Counts {
    size_t total = 0;
    uint64_t created = 0;
    uint64_t destroyed = 0;
  };
  Counts counts() const { return {total_, created_, destroyed_}; }
  // After a call that failed and undid its mappings: destroys free pages until total() is back to
  // `before.total` (the pages the call created and kept), then counts as created and destroyed
  // only the net change since `before`, so a failed call's pages appear in no count. The time
  // spent stays in create_ns()/destroy_ns(). A page whose destruction fails stays, counted.
  void roll_back(const Counts& before);
  // Adds a reference to an in-use page (one more mapping of it).
  void share(PageHandle page);
  // Drops one reference; at zero the page goes back to the free list.
  void release(PageHandle page);

  // Destroys free pages until total() * page_bytes <= keep_bytes or none is free.
  // Returns the number destroyed.
  size_t shrink(size_t keep_bytes);
  // Destroys every page, free or in use (callers unmap first), trying each one even after a
  // failure; rethrows the first failure. The pool is empty afterwards.
  void destroy_all();
  // Changes the budget (kNoBudget = none). Does not shrink; see KVCacheCore::set_memory_budget.
  void set_budget(int64_t budget_bytes) { budget_bytes_ = budget_bytes; }

 private:
  Backend& backend_;
  const size_t page_bytes_;
  int64_t budget_bytes_;
  size_t total_ = 0;
  std::vector<PageHandle> free_;
  std::unordered_map<PageHandle, uint32_t> refs_;  // in-use pages only
  uint64_t created_ = 0;
  uint64_t destroyed_ = 0;
  size_t creating_ = 0;  // pages being created outside the owner's lock (begin/end_create)
  size_t extra_refs_ = 0;  // sum over in-use pages of (refs - 1)
  uint64_t create_ns_ = 0;
  uint64_t destroy_ns_ = 0;
  size_t free_target_ = 0;

  // The backend's create_page()/destroy_page(), timed.
  PageHandle create_one();
  void destroy_one(PageHandle page);
};

}  // namespace vattention
