// CacheGeometry: where every byte of a KV cache lives in virtual memory.
//
// Tensors: `layer` layout has 2*L of them (K of layer l is tensor l, V is tensor L + l), each
// [B, S, H, D]; `mega` layout has 2 (K, V), each [B, S, L, H, D]. A slot's row in a tensor is
// slot_bytes long, padded up to a page multiple so no alignment rule falls on max_seq_len. Pages
// are mapped per "page index" p of a slot: one page in every tensor at row offset p * page_bytes.
// Tokens may straddle two pages when page_bytes is not a multiple of the token stride; mapping is
// by bytes, so that is harmless.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

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
    // 2^46 bytes = 64 TiB: leaves room in the 47-bit user address space (and GPU VA space).
    const double virt = static_cast<double>(slot_bytes()) * max_batch * num_tensors();
    if (virt > static_cast<double>(int64_t{1} << 46)) {
      throw Error(Error::Kind::Config, "the cache needs " + std::to_string(virt / (1 << 30)) +
                                           " GiB of virtual address space; the limit is 65536 GiB "
                                           "(reduce max_batch_size or max_seq_len)");
    }
  }

  int num_tensors() const { return mega ? 2 : static_cast<int>(2 * num_layers); }
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
  // Bytes of one token over all layers, K and V.
  int64_t bytes_per_token() const { return 2 * num_layers * num_kv_heads * head_dim * element_bytes; }
};

}  // namespace vattention
