#include "core/staging_page.h"

namespace vattention {

StagingPage::StagingPage(Backend& backend, PagePool& pool, CacheCounters& counters)
    : backend_(backend), pool_(pool), counters_(counters) {}

StagingPage::~StagingPage() {
  if (va_ == 0 || staged_) return;  // still mapped: leak the range with the mapping
  try {
    backend_.release_va(va_, backend_.page_bytes());
  } catch (...) {
  }
}

uintptr_t StagingPage::va() {
  if (va_ == 0) va_ = backend_.reserve(backend_.page_bytes());
  return va_;
}

void StagingPage::stage(PageHandle page) {
  const uintptr_t at = va();
  const size_t P = backend_.page_bytes();
  if (staged_) unstage();  // a mapping an earlier failed unmap left behind
  backend_.map(at, page);
  ++counters_.map_calls;
  try {
    backend_.set_access(at, P);
    ++counters_.set_access_calls;
  } catch (...) {
    try {
      backend_.unmap(at, P);
      ++counters_.unmap_calls;
    } catch (...) {
      pool_.share(page);  // still mapped: the staging keeps it out of the free list
      staged_ = true;
      page_ = page;
    }
    throw;
  }
  pool_.share(page);
  staged_ = true;
  page_ = page;
}

void StagingPage::unstage() {
  if (!staged_) return;
  for (int attempt = 0;; ++attempt) {
    try {
      backend_.unmap(va_, backend_.page_bytes());
      ++counters_.unmap_calls;
      break;
    } catch (...) {
      if (attempt == 1) throw;  // the page stays staged and referenced: accounted, not leaked
    }
  }
  staged_ = false;
  pool_.release(page_);
}

void StagingPage::close() {
  for (int attempt = 0; attempt < 2 && staged_; ++attempt) {
    try {
      unstage();
    } catch (...) {
      if (attempt == 1) throw;
    }
  }
}

std::string StagingPage::check(std::map<PageHandle, uint32_t>& seen) const {
  if (!staged_) return "";
  if (pool_.refs(page_) == 0) {
    return "page " + std::to_string(page_) +
           " is back in the pool but still mapped at the staging address";
  }
  ++seen[page_];  // the staging mapping's reference
  return "";
}

}  // namespace vattention
