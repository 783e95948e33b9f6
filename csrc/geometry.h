// CacheGeometry: where every byte of a KV cache lives in virtual memory.
//
// Tensors: `layer` layout has 2*L of them (K of layer l is tensor l, V is tensor L + l), each
// [B, S, H, D]; `mega` layout has 2 (K, V), each [B, S, L, H, D]. A slot's row in a tensor is
// slot_bytes long, padded up to a page multiple so no alignment rule falls on max_seq_len. Pages
// are mapped per "page index" p of a slot: one page in every tensor at row offset p * page_bytes.
// Tokens may straddle two pages when page_bytes is not a multiple of the token stride; mapping is
// by bytes, so that is harmless.
//
// Model coverage (issue 14): value_cache=false drops the V tensors (MLA latents, K-only caches:
// `layer` layout has L tensors, `mega` one). windows[l] > 0 makes layer l a sliding-window layer
// of W = windows[l] tokens: positions stay absolute and step() releases the pages of its tensors
// that lie wholly before the window (kv_cache_window.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "errors.h"

namespace vattention {

struct CacheGeometry {
  int64_t num_layers = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t element_bytes = 0;
  int64_t max_batch = 0;
  int64_t max_seq = 0;
  size_t page_bytes = 0;
  bool mega = false;
  bool value_cache = true;        // false: K tensors only
  std::vector<int64_t> windows;   // empty, or num_layers entries: 0 = full attention, else W tokens

  // Throws Error(Kind::Config) naming the bad value and the limit.
  void validate() const {
    auto positive = [](const char* name, int64_t v) {
      if (v < 1) {
        throw Error(Error::Kind::Config, std::string(name) + "=" + std::to_string(v) +
                                             " must be a positive integer (>= 1)");
      }
    };
    positive("num_layers", num_layers);
    positive("num_kv_heads", num_kv_heads);
    positive("head_dim", head_dim);
    positive("element_bytes", element_bytes);
    positive("max_batch_size", max_batch);
    positive("max_seq_len", max_seq);
    if (token_bytes() > page_bytes) {
      throw Error(Error::Kind::Config,
                  "page_size=" + std::to_string(page_bytes) + " bytes holds less than one token (" +
                      std::to_string(token_bytes()) + " bytes per token row): tokens_per_page < 1")
          .with("page_bytes", static_cast<int64_t>(page_bytes))
          .with("token_bytes", static_cast<int64_t>(token_bytes()));
    }
    if (!windows.empty() && static_cast<int64_t>(windows.size()) != num_layers) {
      throw Error(Error::Kind::Config, "sliding_window has " + std::to_string(windows.size()) +
                                           " entries; it needs one per layer (num_layers=" +
                                           std::to_string(num_layers) + ")");
    }
    for (size_t l = 0; l < windows.size(); ++l) {
      if (windows[l] < 0) {
        throw Error(Error::Kind::Config, "sliding_window[" + std::to_string(l) + "]=" +
                                             std::to_string(windows[l]) +
                                             " must be >= 1 (or 0/None for full attention)");
      }
      if (mega && windows[l] != windows[0]) {
        throw Error(Error::Kind::Config,
                    "sliding_window differs between layers (layer 0: " + std::to_string(windows[0]) +
                        ", layer " + std::to_string(l) + ": " + std::to_string(windows[l]) +
                        "); per-layer windows need layout='layer'");
      }
    }
    // 2^46 bytes = 64 TiB: leaves room in the 47-bit user address space (and GPU VA space).
    const double virt = static_cast<double>(slot_bytes()) * max_batch * num_tensors();
    if (virt > static_cast<double>(int64_t{1} << 46)) {
      throw Error(Error::Kind::Config, "the cache needs " + std::to_string(virt / (1 << 30)) +
                                           " GiB of virtual address space; the limit is 65536 GiB "
                                           "(reduce max_batch_size or max_seq_len)");
    }
  }

  int kv_tensors() const { return value_cache ? 2 : 1; }
  int num_tensors() const { return mega ? kv_tensors() : static_cast<int>(kv_tensors() * num_layers); }
  // Window of tensor t in tokens (0 = full attention). Tensor t holds layer t % num_layers.
  int64_t window(int t) const {
    if (windows.empty()) return 0;
    return mega ? windows[0] : windows[static_cast<size_t>(t % num_layers)];
  }
  bool any_window() const {
    for (int64_t w : windows) {
      if (w > 0) return true;
    }
    return false;
  }
  // Page indices of tensor t no query at position >= first_query can read: pages lying wholly
  // before first_query - W + 1 (a query at q reads keys (q - W, q]). 0 for full-attention tensors.
  size_t releasable_pages(int t, int64_t first_query) const {
    const int64_t w = window(t);
    const int64_t first_key = first_query - w + 1;
    if (w <= 0 || first_key <= 0) return 0;
    return static_cast<size_t>(first_key) * token_bytes() / page_bytes;
  }
  // Smallest first_query for which releasable_pages(t, .) >= pages (0 for pages == 0).
  int64_t query_releasing(int t, size_t pages) const {
    if (pages == 0) return 0;
    const size_t tb = token_bytes();
    return static_cast<int64_t>((pages * page_bytes + tb - 1) / tb) + window(t) - 1;
  }
  // First token whose bytes lie wholly in page indices >= pages (tokens may straddle pages).
  int64_t first_token_at(size_t pages) const {
    const size_t tb = token_bytes();
    return static_cast<int64_t>((pages * page_bytes + tb - 1) / tb);
  }
  // Bytes between consecutive tokens of one slot in one tensor.
  size_t token_bytes() const {
    const int64_t per_layer = num_kv_heads * head_dim * element_bytes;
    return static_cast<size_t>(mega ? per_layer * num_layers : per_layer);
  }
  size_t tokens_per_page() const { return page_bytes / token_bytes(); }
  size_t slot_bytes() const {
    const size_t raw = static_cast<size_t>(max_seq) * token_bytes();
    return (raw + page_bytes - 1) / page_bytes * page_bytes;
  }
  size_t tensor_bytes() const { return slot_bytes() * static_cast<size_t>(max_batch); }
  // Page indices a slot needs to back `tokens` tokens.
  size_t pages_for(int64_t tokens) const {
    return (static_cast<size_t>(tokens) * token_bytes() + page_bytes - 1) / page_bytes;
  }
  // Tokens fully backed by `pages` page indices.
  int64_t tokens_in(size_t pages) const {
    const int64_t t = static_cast<int64_t>(pages * page_bytes / token_bytes());
    return t < max_seq ? t : max_seq;
  }
  // Bytes of one token over all layers, K and V (K only without a value cache).
  int64_t bytes_per_token() const {
    return kv_tensors() * num_layers * num_kv_heads * head_dim * element_bytes;
  }
};

}  // namespace vattention
