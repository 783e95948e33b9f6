// _C.CacheGeometry: the one geometry of a cache, for Python (vattention.KVCacheConfig delegates
// every derived size to it, so each size and each check is written once, in core/geometry.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <vector>

#include "core/geometry.h"
#include "python/bindings.h"

namespace py = pybind11;
using vattention::CacheGeometry;

namespace vattention {
namespace python {
namespace {

CacheGeometry make(int64_t num_layers, int64_t num_kv_heads, int64_t head_dim,
                   int64_t element_bytes, int64_t max_batch, int64_t max_seq, size_t page_bytes,
                   bool mega, bool value_cache, std::vector<int64_t> windows,
                   std::vector<int64_t> layer_kv_heads, std::vector<int64_t> layer_head_dims,
                   std::vector<int64_t> layer_groups, int64_t tile_tokens) {
  CacheGeometry g;
  g.num_layers = num_layers;
  g.num_kv_heads = num_kv_heads;
  g.head_dim = head_dim;
  g.element_bytes = element_bytes;
  g.max_batch = max_batch;
  g.max_seq = max_seq;
  g.page_bytes = page_bytes;
  g.mega = mega;
  g.value_cache = value_cache;
  g.windows = std::move(windows);
  g.layer_kv_heads = std::move(layer_kv_heads);
  g.layer_head_dims = std::move(layer_head_dims);
  g.layer_groups = std::move(layer_groups);
  g.tile_tokens = tile_tokens;
  g.validate();
  g.derive();
  return g;
}

// Tensor of layer `layer`'s K (mega: the one K tensor), checked.
int k_tensor(const CacheGeometry& g, int64_t layer) {
  if (layer < 0 || layer >= g.num_layers) {
    throw py::index_error("layer=" + std::to_string(layer) + " is out of range [0, " +
                          std::to_string(g.num_layers) + ")");
  }
  return g.mega ? 0 : static_cast<int>(layer);
}

}  // namespace

void bind_geometry(py::module_& m) {
  py::class_<CacheGeometry>(m, "CacheGeometry",
                            "Where every byte of a KV cache lives (core/geometry.h); validated on "
                            "construction (ConfigError naming the value and the limit).")
      .def(py::init(&make), py::kw_only(), py::arg("num_layers"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("element_bytes"), py::arg("max_batch"), py::arg("max_seq"),
           py::arg("page_bytes"), py::arg("mega") = false, py::arg("value_cache") = true,
           py::arg("windows") = std::vector<int64_t>{},
           py::arg("layer_kv_heads") = std::vector<int64_t>{},
           py::arg("layer_head_dims") = std::vector<int64_t>{},
           py::arg("layer_groups") = std::vector<int64_t>{}, py::arg("tile_tokens") = 0)
      .def_readonly("num_layers", &CacheGeometry::num_layers)
      .def_readonly("tile_tokens", &CacheGeometry::tile_tokens,
                    "Key tile (tokens) that kernels may load whole past a row's length; 0: none.")
      .def_readonly("element_bytes", &CacheGeometry::element_bytes)
      .def_readonly("max_batch", &CacheGeometry::max_batch)
      .def_readonly("max_seq", &CacheGeometry::max_seq)
      .def_readonly("page_bytes", &CacheGeometry::page_bytes)
      .def_readonly("mega", &CacheGeometry::mega)
      .def_readonly("value_cache", &CacheGeometry::value_cache)
      .def_property_readonly("num_tensors", &CacheGeometry::num_tensors)
      .def_property_readonly("kv_tensors", &CacheGeometry::kv_tensors)
      .def_property_readonly("unit_bytes", &CacheGeometry::unit_bytes,
                             "Bytes per token of the page-index arithmetic (gcd of token strides).")
      .def_property_readonly("columns", &CacheGeometry::columns,
                             "Physical pages of one page index over all tensors.")
      .def_property_readonly("tokens_per_page", &CacheGeometry::tokens_per_page)
      .def_property_readonly("max_indices", &CacheGeometry::max_indices,
                             "Page indices of one slot row (max_seq tokens).")
      .def_property_readonly("virtual_bytes", &CacheGeometry::virtual_bytes)
      .def_property_readonly("bytes_per_token", &CacheGeometry::bytes_per_token)
      .def_property_readonly("num_groups", &CacheGeometry::num_groups,
                             "KV cache groups (each follows its own engine block table).")
      .def_property_readonly("group_width", &CacheGeometry::group_width,
                             "Pages one engine block holds: the columns of one group.")
      .def(
          "layer_token_bytes",
          [](const CacheGeometry& g, int64_t layer) {
            k_tensor(g, layer);
            return g.layer_token_bytes(layer);
          },
          py::arg("layer"))
      .def(
          "token_bytes",
          [](const CacheGeometry& g, int64_t layer) { return g.token_bytes(k_tensor(g, layer)); },
          py::arg("layer"), "Token stride in bytes of layer `layer`'s K tensor.")
      .def(
          "index_pages",
          [](const CacheGeometry& g, int64_t layer) { return g.index_pages(k_tensor(g, layer)); },
          py::arg("layer"), "Pages one page index takes in each of the layer's tensors.")
      .def(
          "slot_bytes",
          [](const CacheGeometry& g, int64_t layer) { return g.slot_bytes(k_tensor(g, layer)); },
          py::arg("layer"), "Row stride in bytes of layer `layer`'s K tensor.")
      .def("pages_for", &CacheGeometry::pages_for, py::arg("tokens"),
           "Page indices one slot needs to back `tokens` tokens.")
      .def("tokens_in", &CacheGeometry::tokens_in, py::arg("pages"))
      .def("read_end", &CacheGeometry::read_end, py::arg("tokens"),
           "One past the last token a tile-loading kernel reads of a row of `tokens` tokens.")
      .def("read_pages", &CacheGeometry::read_pages, py::arg("tokens"),
           "Page indices a row of `tokens` tokens maps: its read end's.")
      .def(py::pickle(
          [](const CacheGeometry& g) {
            return py::make_tuple(g.num_layers, g.num_kv_heads, g.head_dim, g.element_bytes,
                                  g.max_batch, g.max_seq, g.page_bytes, g.mega, g.value_cache,
                                  g.windows, g.layer_kv_heads, g.layer_head_dims, g.layer_groups,
                                  g.tile_tokens);
          },
          [](const py::tuple& t) {
            return make(t[0].cast<int64_t>(), t[1].cast<int64_t>(), t[2].cast<int64_t>(),
                        t[3].cast<int64_t>(), t[4].cast<int64_t>(), t[5].cast<int64_t>(),
                        t[6].cast<size_t>(), t[7].cast<bool>(), t[8].cast<bool>(),
                        t[9].cast<std::vector<int64_t>>(), t[10].cast<std::vector<int64_t>>(),
                        t[11].cast<std::vector<int64_t>>(), t[12].cast<std::vector<int64_t>>(),
                        t[13].cast<int64_t>());
          }));
}

}  // namespace python
}  // namespace vattention
