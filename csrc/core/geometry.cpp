#include "core/geometry.h"

#include <algorithm>
#include <string>

namespace vattention {
namespace {

void positive(const std::string& name, int64_t v) {
  if (v < 1) {
    throw Error(Error::Kind::Config,
                name + "=" + std::to_string(v) + " must be a positive int (>= 1)");
  }
}

}  // namespace

void CacheGeometry::per_layer(const char* name, const std::vector<int64_t>& values) const {
  if (values.empty() || static_cast<int64_t>(values.size()) == num_layers) return;
  throw Error(Error::Kind::Config, std::string(name) + " has " + std::to_string(values.size()) +
                                       " entries; it needs one per layer (num_layers=" +
                                       std::to_string(num_layers) + ")");
}

void CacheGeometry::validate() const {
  positive("num_layers", num_layers);
  positive("num_kv_heads", num_kv_heads);
  positive("head_dim", head_dim);
  positive("element_bytes", element_bytes);
  positive("max_batch_size", max_batch);
  positive("max_seq_len", max_seq);
  if (page_bytes < 1) throw Error(Error::Kind::Config, "page_size=0 bytes must be > 0 bytes");
  if (tile_tokens < 0 || tile_tokens > (int64_t{1} << 30)) {
    throw Error(Error::Kind::Config, "kv_tile_tokens=" + std::to_string(tile_tokens) +
                                         " must be in [0, 2**30] (0: no tile rule)")
        .with("kv_tile_tokens", tile_tokens);
  }
  per_layer("num_kv_heads", layer_kv_heads);
  per_layer("head_dim", layer_head_dims);
  for (size_t l = 0; l < layer_kv_heads.size(); ++l) {
    positive("num_kv_heads[" + std::to_string(l) + "]", layer_kv_heads[l]);
  }
  for (size_t l = 0; l < layer_head_dims.size(); ++l) {
    positive("head_dim[" + std::to_string(l) + "]", layer_head_dims[l]);
  }
  if (mega && !uniform_layers()) {
    throw Error(Error::Kind::Config,
                "num_kv_heads/head_dim differ between layers; per-layer shapes need "
                "layout='layer' (a mega tensor has one [num_layers, heads, head_dim] token row)");
  }
  // Sizes below may overflow 64 bits for absurd inputs: check them in long double first.
  // 2^46 bytes = 64 TiB: leaves room in the 47-bit user address space (and GPU VA space).
  const long double limit = static_cast<long double>(int64_t{1} << 46);
  long double token_row = 0;  // bytes of one token over every tensor
  for (int64_t l = 0; l < num_layers; ++l) {
    token_row += static_cast<long double>(kv_heads(l)) * head_dim_of(l) * element_bytes;
  }
  token_row *= kv_tensors();
  const long double virt = token_row * max_seq * max_batch;
  if (virt > limit) {
    throw Error(Error::Kind::Config,
                "the cache needs " + std::to_string(static_cast<double>(virt / (1 << 30))) +
                    " GiB of virtual address space (max_batch_size=" + std::to_string(max_batch) +
                    " x max_seq_len=" + std::to_string(max_seq) + " x " +
                    std::to_string(static_cast<double>(token_row)) +
                    " bytes per token); the limit is 65536 GiB (reduce max_batch_size or "
                    "max_seq_len)")
        .with("max_batch_size", max_batch)
        .with("max_seq_len", max_seq);
  }
  size_t widest = 0;  // the largest token row of one tensor
  int64_t widest_layer = 0;
  for (int t = 0; t < num_tensors(); ++t) {
    if (token_bytes(t) > widest) {
      widest = token_bytes(t);
      widest_layer = t % num_layers;
    }
  }
  if (widest > page_bytes) {
    throw Error(
        Error::Kind::Config,
        "page_size=" + std::to_string(page_bytes) +
            " bytes holds less than one token: a "
            "token row of one " +
            (mega ? "'mega'" : "'layer'") + "-layout tensor is " + std::to_string(widest) +
            " bytes" +
            (uniform_layers() ? std::string() : " (layer " + std::to_string(widest_layer) + ")") +
            ", so tokens_per_page would be < 1; use a page of at least that size")
        .with("page_bytes", static_cast<int64_t>(page_bytes))
        .with("token_bytes", static_cast<int64_t>(widest));
  }
  per_layer("sliding_window", windows);
  for (size_t l = 0; l < windows.size(); ++l) {
    if (windows[l] < 0) {
      throw Error(Error::Kind::Config, "sliding_window[" + std::to_string(l) +
                                           "]=" + std::to_string(windows[l]) +
                                           " must be >= 1 (or 0/None for full attention)");
    }
    if (mega && windows[l] != windows[0]) {
      throw Error(Error::Kind::Config,
                  "sliding_window differs between layers (layer 0: " + std::to_string(windows[0]) +
                      ", layer " + std::to_string(l) + ": " + std::to_string(windows[l]) +
                      "); per-layer windows need layout='layer'");
    }
  }
  per_layer("layer_groups", layer_groups);
  if (!layer_groups.empty()) {
    const int groups = num_groups();
    std::vector<size_t> width(static_cast<size_t>(groups), 0);
    for (size_t l = 0; l < layer_groups.size(); ++l) {
      if (layer_groups[l] < 0) {
        throw Error(Error::Kind::Config, "layer_groups[" + std::to_string(l) +
                                             "]=" + std::to_string(layer_groups[l]) +
                                             " must be a group number >= 0");
      }
    }
    if (mega && groups > 1) {
      throw Error(Error::Kind::Config,
                  "layer_groups has " + std::to_string(groups) +
                      " groups; several KV cache groups need layout='layer' (a mega tensor maps "
                      "every layer of a token with one page)");
    }
    for (int t = 0; t < num_tensors(); ++t)
      width[static_cast<size_t>(group_of(t))] += index_pages(t);
    for (int t = 0; t < num_tensors(); ++t) {
      const int first =
          static_cast<int>(std::find(layer_groups.begin(), layer_groups.end(),
                                     layer_groups[static_cast<size_t>(t % num_layers)]) -
                           layer_groups.begin());
      if (window(t) != window(first)) {
        throw Error(Error::Kind::Config,
                    "layers " + std::to_string(first) + " and " + std::to_string(t % num_layers) +
                        " are in KV cache group " + std::to_string(group_of(t)) +
                        " but have different sliding windows (" + std::to_string(window(first)) +
                        ", " + std::to_string(window(t)) + "); a group's layers share one window")
            .with("group", group_of(t));
      }
    }
    for (int g = 0; g < groups; ++g) {
      if (width[static_cast<size_t>(g)] == 0) {
        throw Error(Error::Kind::Config, "layer_groups names groups 0.." +
                                             std::to_string(groups - 1) + " but group " +
                                             std::to_string(g) + " has no layer");
      }
    }
  }
  // Padding every row to whole page indices can add up to a page index per slot: check again.
  const long double padded = static_cast<long double>(max_indices()) * page_bytes * columns() *
                             static_cast<long double>(max_batch);
  if (padded > limit) {
    throw Error(Error::Kind::Config,
                "the cache needs " + std::to_string(static_cast<double>(padded / (1 << 30))) +
                    " GiB of virtual address space with rows padded to whole pages; the limit is "
                    "65536 GiB (reduce max_batch_size or max_seq_len)")
        .with("max_batch_size", max_batch)
        .with("max_seq_len", max_seq);
  }
}

}  // namespace vattention
