// CacheGeometry: where every byte of a KV cache lives in virtual memory.
//
// Tensors: `layer` layout has 2*L of them (K of layer l is tensor l, V is tensor L + l), each
// [B, S, H_l, D_l]; `mega` layout has 2 (K, V), each [B, S, L, H, D]. A slot's row in a tensor is
// slot_bytes(t) long, a whole number of page indices, so no alignment rule falls on max_seq_len.
// Pages are mapped per "page index" p of a slot: index_pages(t) pages in every tensor t (one
// when every layer has the same shape; see "page indices" below for per-layer shapes).
//
// Model coverage: value_cache=false drops the V tensors (MLA latents, K-only caches:
// `layer` layout has L tensors, `mega` one). windows[l] > 0 makes layer l a sliding-window layer
// of W = windows[l] tokens: positions stay absolute and step() releases the pages of its tensors
// that lie wholly before the window (window_release.h).
//
// Reads past a row's length: tile_tokens = T > 0 says kernels may load whole key tiles of a
// divisor of T, so a row of `len` tokens is read up to read_end(len) = len rounded up to T (and
// from a window's first key rounded down to T). Rows map that far and keep it finite
// (read_tail.h); windows keep the tile below a window's first key mapped.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/errors.h"

namespace vattention {

struct CacheGeometry {
  int64_t num_layers = 0;
  int64_t num_kv_heads = 0;       // every layer's, unless layer_kv_heads is given
  int64_t head_dim = 0;           // every layer's, unless layer_head_dims is given
  int64_t element_bytes = 0;
  int64_t max_batch = 0;
  int64_t max_seq = 0;
  size_t page_bytes = 0;
  bool mega = false;
  bool value_cache = true;        // false: K tensors only
  std::vector<int64_t> windows;  // empty, or num_layers entries: 0 = full attention, else W tokens
  // Per-layer shapes (hybrid models): empty, or num_layers entries overriding num_kv_heads /
  // head_dim for each layer. `layer` layout only (a mega tensor has one [L, H, D] token row).
  std::vector<int64_t> layer_kv_heads;
  std::vector<int64_t> layer_head_dims;
  // KV cache groups (an engine's block tables): empty (one group), or num_layers entries,
  // the group of each layer, numbered 0..G-1. A block id names one page index of one group: the
  // group's columns (K and V of its layers). Groups may differ in width (vLLM pads a group short
  // of layers); an engine may hand a block id from one group to another.
  std::vector<int64_t> layer_groups;
  // Key tile in tokens that kernels reading the cache may load whole (0: none; read_tail.h).
  int64_t tile_tokens = 0;

  // Throws Error(Kind::Config) naming the bad value and the limit. Python's KVCacheConfig calls
  // it through the bound geometry, so every check and its message live here only.
  void validate() const;

  // Fills the tables the accessors below would otherwise recompute on every call (KVCacheCore
  // calls it once; a geometry that never ran it still answers, only more slowly).
  void derive() {
    unit_ = compute_unit();
    first_column_.assign(static_cast<size_t>(num_tensors()) + 1, 0);
    column_tensor_.clear();
    for (int t = 0; t < num_tensors(); ++t) {
      const size_t n = token_bytes(t) / unit_;
      first_column_[static_cast<size_t>(t) + 1] = first_column_[static_cast<size_t>(t)] + n;
      column_tensor_.insert(column_tensor_.end(), n, t);
    }
    group_columns_.assign(static_cast<size_t>(num_groups()), {});
    for (size_t c = 0; c < columns(); ++c) {
      group_columns_[static_cast<size_t>(group_of(column_tensor(c)))].push_back(c);
    }
  }

  // ---- KV cache groups ---------------------------------------------------------------------
  int num_groups() const {
    int64_t g = 0;
    for (int64_t x : layer_groups) g = x + 1 > g ? x + 1 : g;
    return layer_groups.empty() ? 1 : static_cast<int>(g);
  }
  // Group of tensor t (mega: the one group).
  int group_of(int t) const {
    if (layer_groups.empty() || mega) return 0;
    return static_cast<int>(layer_groups[static_cast<size_t>(t % num_layers)]);
  }
  // Columns of group g, in column order (derive() caches them).
  std::vector<size_t> group_columns(int g) const {
    if (!group_columns_.empty()) return group_columns_[static_cast<size_t>(g)];
    std::vector<size_t> out;
    for (size_t c = 0; c < columns(); ++c) {
      if (group_of(column_tensor(c)) == g) out.push_back(c);
    }
    return out;
  }
  // Pages a block holds at most: the columns of the widest group.
  size_t group_width() const {
    std::vector<size_t> width(static_cast<size_t>(num_groups()), 0);
    for (int t = 0; t < num_tensors(); ++t)
      width[static_cast<size_t>(group_of(t))] += index_pages(t);
    size_t most = 0;
    for (size_t w : width) most = w > most ? w : most;
    return most;
  }

  int kv_tensors() const { return value_cache ? 2 : 1; }
  int num_tensors() const {
    return mega ? kv_tensors() : static_cast<int>(kv_tensors() * num_layers);
  }
  int64_t kv_heads(int64_t layer) const {
    return layer_kv_heads.empty() ? num_kv_heads : layer_kv_heads[static_cast<size_t>(layer)];
  }
  int64_t head_dim_of(int64_t layer) const {
    return layer_head_dims.empty() ? head_dim : layer_head_dims[static_cast<size_t>(layer)];
  }
  bool uniform_layers() const {
    for (int64_t l = 1; l < num_layers; ++l) {
      if (kv_heads(l) != kv_heads(0) || head_dim_of(l) != head_dim_of(0)) return false;
    }
    return true;
  }
  // Bytes of one token of one layer (K or V).
  size_t layer_token_bytes(int64_t layer) const {
    return static_cast<size_t>(kv_heads(layer) * head_dim_of(layer) * element_bytes);
  }
  // Bytes between consecutive tokens of one slot in tensor t.
  size_t token_bytes(int t) const {
    if (mega) return layer_token_bytes(0) * static_cast<size_t>(num_layers);
    return layer_token_bytes(t % num_layers);
  }

  // ---- page indices ---------------------------------------------------------------------------
  // A slot grows by page indices. Page index p covers the same tokens in every tensor: tensor t
  // maps index_pages(t) consecutive physical pages for it, at bytes [p, p + 1) * index_bytes(t) of
  // its row. unit_bytes() is the gcd of the tensors' token strides, so one page index holds
  // page_bytes / unit_bytes() tokens everywhere and each tensor's pages are exactly proportional to
  // its token stride (a layer with 4x the KV heads maps 4 pages per index). With one shape for
  // every layer unit_bytes() is the token stride and index_pages(t) is 1: one page per tensor.
  // Tokens may straddle two page indices when page_bytes is not a multiple of unit_bytes(); mapping
  // is by bytes, so that is harmless.
  size_t unit_bytes() const { return unit_ ? unit_ : compute_unit(); }
  size_t index_pages(int t) const { return token_bytes(t) / unit_bytes(); }
  size_t index_bytes(int t) const { return index_pages(t) * page_bytes; }
  // Physical pages per page index over all tensors ("columns"): column c of page index p is page
  // column_sub(c) of tensor column_tensor(c)'s run at p. Slot::pages holds columns() per index.
  size_t columns() const { return first_column(num_tensors()); }
  size_t first_column(int t) const {
    if (!first_column_.empty()) return first_column_[static_cast<size_t>(t)];
    size_t n = 0;
    for (int u = 0; u < t; ++u) n += index_pages(u);
    return n;
  }
  int column_tensor(size_t c) const {
    if (!column_tensor_.empty()) return column_tensor_[c];
    int t = 0;
    while (first_column(t + 1) <= c) ++t;
    return t;
  }
  size_t column_sub(size_t c) const { return c - first_column(column_tensor(c)); }
  // Page indices that cover max_seq tokens: every slot row is this many indices long.
  size_t max_indices() const {
    const size_t raw = static_cast<size_t>(max_seq) * unit_bytes();
    return (raw + page_bytes - 1) / page_bytes;
  }

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
  // before first_query - W + 1 (a query at q reads keys (q - W, q]), rounded down to the tile a
  // tile-loading kernel starts its window at. 0 for full-attention tensors.
  size_t releasable_pages(int t, int64_t first_query) const {
    const int64_t w = window(t);
    int64_t first_key = first_query - w + 1;
    if (w <= 0 || first_key <= 0) return 0;
    if (tile_tokens > 0) first_key = first_key / tile_tokens * tile_tokens;
    return static_cast<size_t>(first_key) * unit_bytes() / page_bytes;
  }
  // Smallest first_query for which releasable_pages(t, .) >= pages (0 for pages == 0).
  int64_t query_releasing(int t, size_t pages) const {
    if (pages == 0) return 0;
    const size_t ub = unit_bytes();
    int64_t first_key = static_cast<int64_t>((pages * page_bytes + ub - 1) / ub);
    if (tile_tokens > 0) first_key = (first_key + tile_tokens - 1) / tile_tokens * tile_tokens;
    return first_key + window(t) - 1;
  }
  // First key a tile-loading kernel reads for a query window starting at `first_key`.
  int64_t tile_floor(int64_t first_key) const {
    if (tile_tokens <= 0 || first_key <= 0) return first_key;
    return first_key / tile_tokens * tile_tokens;
  }
  // First token whose bytes lie wholly in page indices >= pages (tokens may straddle pages).
  int64_t first_token_at(size_t pages) const {
    const size_t ub = unit_bytes();
    return static_cast<int64_t>((pages * page_bytes + ub - 1) / ub);
  }
  // Tokens of one page index.
  size_t tokens_per_page() const { return page_bytes / unit_bytes(); }
  // Bytes of one slot's row in tensor t (a whole number of page indices).
  size_t slot_bytes(int t) const { return max_indices() * index_bytes(t); }
  size_t tensor_bytes(int t) const { return slot_bytes(t) * static_cast<size_t>(max_batch); }
  size_t virtual_bytes() const {
    return max_indices() * page_bytes * columns() * static_cast<size_t>(max_batch);
  }
  // Page indices a slot needs to back `tokens` tokens.
  size_t pages_for(int64_t tokens) const {
    return (static_cast<size_t>(tokens) * unit_bytes() + page_bytes - 1) / page_bytes;
  }
  // One past the last token a kernel reads of a row of `len` tokens: len rounded up to
  // tile_tokens (capped at max_seq); len itself without a tile or for an empty row.
  int64_t read_end(int64_t len) const {
    if (tile_tokens <= 0 || len <= 0) return len;
    if (tile_tokens >= max_seq) return max_seq;
    const int64_t end = (len + tile_tokens - 1) / tile_tokens * tile_tokens;
    return end < max_seq ? end : max_seq;
  }
  // Page indices a row of `len` tokens maps: its read end's.
  size_t read_pages(int64_t len) const { return pages_for(read_end(len)); }
  // The longest length whose read end lies within `tokens` (tokens itself without a tile).
  int64_t read_fits(int64_t tokens) const {
    if (tile_tokens <= 0 || tokens >= max_seq) return tokens < max_seq ? tokens : max_seq;
    return tokens / tile_tokens * tile_tokens;
  }
  // Tokens fully backed by `pages` page indices.
  int64_t tokens_in(size_t pages) const {
    const int64_t t = static_cast<int64_t>(pages * page_bytes / unit_bytes());
    return t < max_seq ? t : max_seq;
  }
  // Bytes of one token over all layers, K and V (K only without a value cache).
  int64_t bytes_per_token() const {
    int64_t sum = 0;
    for (int64_t l = 0; l < num_layers; ++l) sum += static_cast<int64_t>(layer_token_bytes(l));
    return kv_tensors() * sum;
  }

 private:
  static size_t gcd(size_t a, size_t b) {
    while (b != 0) {
      const size_t r = a % b;
      a = b;
      b = r;
    }
    return a;
  }
  size_t compute_unit() const {
    size_t g = 0;
    for (int t = 0; t < num_tensors(); ++t) g = gcd(g, token_bytes(t));
    return g;
  }
  void per_layer(const char* name, const std::vector<int64_t>& values) const;

  size_t unit_ = 0;  // derive(): unit_bytes()
  std::vector<size_t> first_column_;  // derive(): first column of each tensor, then columns()
  std::vector<int> column_tensor_;  // derive(): tensor of each column
  std::vector<std::vector<size_t>> group_columns_;  // derive(): columns of each group
};

}  // namespace vattention
