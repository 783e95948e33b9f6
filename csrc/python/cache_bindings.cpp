// _C.KVCacheCore: the cache for Python, and the DLPack export of its tensors.
//
// - Tensors leave through DLPack capsules. torch ignores DLPack's byte_offset, so per-layer views
//   of the mega layout put their offset into `data` and keep byte_offset = 0. Each capsule holds a
//   shared_ptr to the core: the virtual reservation lives until the last tensor dies.
// - The GIL is released around anything that may call the OS/driver or wait; step() first tries
//   KVCacheCore::try_step with the GIL held (nothing to map), the common case in decode.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <climits>
#include <cstring>
#include <memory>
#include <string>

#include "core/errors.h"
#include "core/kv_cache.h"
#include "host/host_backend.h"
#include "python/backend_factory.h"
#include "python/bindings.h"
#include "python/dlpack.h"

namespace py = pybind11;
namespace vattention {
namespace python {
namespace {

int64_t as_int(PyObject* obj, const char* what) {
  long long v;
  if (PyLong_CheckExact(obj)) {
    v = PyLong_AsLongLong(obj);  // the common case: no __index__ round trip
  } else {
    // numpy and torch integer scalars; never bools (True is not a length)
    PyObject* index = PyBool_Check(obj) ? nullptr : PyNumber_Index(obj);
    if (!index) {
      PyErr_Clear();
      throw py::type_error(std::string("seq_lens ") + what + " must be integers, got " +
                           Py_TYPE(obj)->tp_name);
    }
    v = PyLong_AsLongLong(index);
    Py_DECREF(index);
  }
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  // INT64_MIN marks "unlisted" inside the core; it is out of range anyway.
  return v == KVCacheCore::kUnlisted ? KVCacheCore::kUnlisted + 1 : v;
}

}  // namespace

std::vector<int64_t> parse_lens(py::handle obj, int64_t max_batch) {
  std::vector<int64_t> lens(static_cast<size_t>(max_batch), KVCacheCore::kUnlisted);
  PyObject* o = obj.ptr();
  if (PyDict_Check(o)) {
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(o, &pos, &key, &value)) {
      const int64_t slot = as_int(key, "keys (slots)");
      if (slot < 0 || slot >= max_batch) {
        throw Error(Error::Kind::InvalidSlot,
                    "slot=" + std::to_string(slot) + " is out of range [0, " +
                        std::to_string(max_batch) +
                        ") (max_batch_size=" + std::to_string(max_batch) + ")")
            .with("slot", slot)
            .with("max_batch_size", max_batch);
      }
      lens[static_cast<size_t>(slot)] = as_int(value, "values (lengths)");
    }
    return lens;
  }
  // Lists and tuples are read in place; other sequences (numpy arrays, ...) through one copy.
  PyObject* fast = PySequence_Fast(o, "seq_lens must be a dict {slot: length} or a sequence");
  if (!fast) throw py::error_already_set();
  py::object owner = py::reinterpret_steal<py::object>(fast);
  const auto n = static_cast<int64_t>(PySequence_Fast_GET_SIZE(fast));
  if (n != max_batch) {
    throw Error(Error::Kind::InvalidSlot,
                "seq_lens has " + std::to_string(n) +
                    " entries; a sequence must have max_batch_size=" + std::to_string(max_batch) +
                    " (or pass a {slot: length} dict)");
  }
  PyObject** items = PySequence_Fast_ITEMS(fast);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = as_int(items[i], "values (lengths)");
    if (v != 0) lens[static_cast<size_t>(i)] = v;
  }
  return lens;
}

namespace {

struct Export {
  DLManagedTensor managed;
  int64_t shape[5];
  int64_t strides[5];
  std::shared_ptr<KVCacheCore> owner;
};

void delete_export(DLManagedTensor* self) { delete static_cast<Export*>(self->manager_ctx); }

void capsule_destructor(PyObject* capsule) {
  // Consumed capsules are renamed "used_dltensor" and owned by the consumer.
  if (std::strcmp(PyCapsule_GetName(capsule), "dltensor") != 0) return;
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  if (managed && managed->deleter) managed->deleter(managed);
}

// kv: 0 = K, 1 = V. layer: -1 = the whole mega tensor [B, S, L, H, D].
py::capsule export_tensor(const std::shared_ptr<KVCacheCore>& core, int kv, int layer, int dl_code,
                          int bits, bool host_alias) {
  const vattention::CacheGeometry& g = core->geometry();
  if (kv < 0 || kv > 1) throw py::value_error("kv must be 0 (K) or 1 (V)");
  if (kv == 1 && !g.value_cache) {
    throw Error(Error::Kind::Config, "this cache has no V tensors (value_cache=False)");
  }
  if (layer < -1 || layer >= g.num_layers || (layer == -1 && !g.mega)) {
    throw Error(Error::Kind::Config, "layer=" + std::to_string(layer) + " is out of range [0, " +
                                         std::to_string(g.num_layers) +
                                         ") (num_layers=" + std::to_string(g.num_layers) + ")");
  }
  if (core->closed())
    throw Error(Error::Kind::Closed, "the KV cache is closed; create a new KVCache");
  auto* ex = new Export();
  ex->owner = core;
  const int64_t E = g.element_bytes, L = g.num_layers;
  // Per-layer shapes exist only in the layer layout (validate()); mega uses layer 0's.
  const int64_t H = g.kv_heads(layer < 0 ? 0 : layer), D = g.head_dim_of(layer < 0 ? 0 : layer);
  const int tensor = g.mega ? kv : kv * static_cast<int>(L) + layer;
  const auto slot_stride = static_cast<int64_t>(g.slot_bytes(tensor)) / E;
  uintptr_t data;
  int ndim = 4;
  if (!g.mega) {
    data = core->tensor_base(tensor);
    const int64_t shape[4] = {g.max_batch, g.max_seq, H, D};
    const int64_t strides[4] = {slot_stride, H * D, D, 1};
    std::memcpy(ex->shape, shape, sizeof shape);
    std::memcpy(ex->strides, strides, sizeof strides);
  } else if (layer >= 0) {
    data = core->tensor_base(kv) + static_cast<uintptr_t>(layer * H * D * E);
    const int64_t shape[4] = {g.max_batch, g.max_seq, H, D};
    const int64_t strides[4] = {slot_stride, L * H * D, D, 1};
    std::memcpy(ex->shape, shape, sizeof shape);
    std::memcpy(ex->strides, strides, sizeof strides);
  } else {
    data = core->tensor_base(kv);
    ndim = 5;
    const int64_t shape[5] = {g.max_batch, g.max_seq, L, H, D};
    const int64_t strides[5] = {slot_stride, L * H * D, H * D, D, 1};
    std::memcpy(ex->shape, shape, sizeof shape);
    std::memcpy(ex->strides, strides, sizeof strides);
  }
  const vattention::DeviceId dev =
      host_alias ? vattention::DeviceId{1, 0} : core->backend().device();
  DLTensor& t = ex->managed.dl_tensor;
  t.data = reinterpret_cast<void*>(data);
  t.device = DLDevice{dev.dl_device_type, dev.ordinal};
  t.ndim = ndim;
  t.dtype = DLDataType{static_cast<uint8_t>(dl_code), static_cast<uint8_t>(bits), 1};
  t.shape = ex->shape;
  t.strides = ex->strides;
  t.byte_offset = 0;
  ex->managed.manager_ctx = ex;
  ex->managed.deleter = delete_export;
  return py::reinterpret_steal<py::capsule>(
      PyCapsule_New(&ex->managed, "dltensor", capsule_destructor));
}

vattention::HostBackend& host_backend(KVCacheCore& core) {
  auto* host = dynamic_cast<vattention::HostBackend*>(&core.backend());
  if (!host) throw py::type_error("fault injection through this hook needs the host backend");
  return *host;
}

// A sequence of block ids (one KV cache group) or one sequence per group. Types are checked here,
// values by the core.
std::vector<std::vector<int64_t>> parse_block_ids(py::handle obj, int groups,
                                                  const std::string& who) {
  if (!PySequence_Check(obj.ptr()) || PyUnicode_Check(obj.ptr())) {
    throw py::type_error(who + " must be a sequence of block ids, or one per KV cache group");
  }
  std::vector<std::vector<int64_t>> out;
  py::sequence ids = py::reinterpret_borrow<py::sequence>(obj);
  const bool nested =
      py::len(ids) > 0 && PySequence_Check(ids[0].ptr()) && !PyLong_Check(ids[0].ptr());
  if (!nested) {
    if (groups != 1) {
      throw Error(Error::Kind::Config, who + " gives one list of block ids; the cache has " +
                                           std::to_string(groups) +
                                           " KV cache groups: give one per group");
    }
    out.emplace_back();
    for (auto id : ids) out.back().push_back(as_int(id.ptr(), "block ids"));
  } else {
    for (auto group : ids) {
      out.emplace_back();
      for (auto id : py::reinterpret_borrow<py::sequence>(group)) {
        out.back().push_back(as_int(id.ptr(), "block ids"));
      }
    }
  }
  return out;
}

// {slot: (start, ids, cached)}: ids as parse_block_ids reads them. Types are checked here; values
// by the core (BlockTables::validate).
std::vector<BlockUpdate> parse_updates(py::handle obj, int groups) {
  std::vector<BlockUpdate> out;
  if (obj.is_none()) return out;
  if (!PyDict_Check(obj.ptr())) {
    throw py::type_error("blocks must be a dict {slot: (start, block_ids, cached)}");
  }
  for (auto item : py::reinterpret_borrow<py::dict>(obj)) {
    BlockUpdate u;
    u.slot = static_cast<int>(as_int(item.first.ptr(), "keys of blocks (slots)"));
    py::sequence entry = py::reinterpret_borrow<py::object>(item.second);
    if (!PySequence_Check(item.second.ptr()) || py::len(entry) != 3) {
      throw py::type_error("blocks[" + std::to_string(u.slot) +
                           "] must be a tuple (start, block_ids, cached)");
    }
    const int64_t start = as_int(entry[0].ptr(), "start (blocks)");
    const int64_t cached = as_int(entry[2].ptr(), "cached (blocks)");
    if (start < 0 || cached < 0) {
      throw Error(Error::Kind::Config,
                  "blocks[" + std::to_string(u.slot) + "]: start=" + std::to_string(start) +
                      " and cached=" + std::to_string(cached) + " must be >= 0");
    }
    u.start = static_cast<size_t>(start);
    u.cached = static_cast<size_t>(cached);
    u.ids = parse_block_ids(entry[1], groups, "blocks[" + std::to_string(u.slot) + "]");
    out.push_back(std::move(u));
  }
  return out;
}

py::dict capacity_dict(const vattention::Capacity& c) {
  py::dict out;
  out["pages_needed"] = c.pages_needed;
  out["pages_free"] = c.pages_free;
  out["pages_creatable"] = c.pages_creatable == SIZE_MAX ? py::object(py::none())
                                                         : py::object(py::int_(c.pages_creatable));
  out["pages_reclaimable"] = c.pages_reclaimable;
  out["pages_short"] = c.pages_short;
  return out;
}

}  // namespace

void bind_cache(py::module_& m) {
  py::class_<KVCacheCore, std::shared_ptr<KVCacheCore>>(m, "KVCacheCore")
      .def(py::init([](const std::string& device, const vattention::CacheGeometry& g,
                       int64_t budget_bytes, bool eager, int64_t lookahead_tokens,
                       int64_t num_blocks, bool block_cache) {
             vattention::CacheOptions options;
             options.budget_bytes = budget_bytes;
             options.policy =
                 eager ? vattention::ReclaimPolicy::Eager : vattention::ReclaimPolicy::Deferred;
             options.lookahead_tokens = lookahead_tokens;
             options.num_blocks = num_blocks;
             options.block_cache = block_cache;
             return std::shared_ptr<KVCacheCore>(vattention::make_cache(
                 vattention::make_backend(device, g.page_bytes), g, options));
           }),
           py::arg("device"), py::arg("geometry"), py::arg("budget_bytes") = -1,
           py::arg("eager") = false, py::arg("lookahead_tokens") = 0, py::arg("num_blocks") = 0,
           py::arg("block_cache") = false)
      .def_property_readonly("geometry", &KVCacheCore::geometry)
      .def(
          "alloc",
          [](KVCacheCore& core, py::handle hits, uintptr_t stream) {
            if (hits.is_none()) return core.alloc(nullptr, stream);
            const auto ids = parse_block_ids(hits, core.geometry().num_groups(), "hits");
            return core.alloc(&ids, stream);
          },
          py::arg("hits") = py::none(), py::arg("stream") = 0)
      .def("free", &KVCacheCore::free, py::arg("slot"), py::arg("stream") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def(
          "step",
          [](KVCacheCore& core, py::handle seq_lens, uintptr_t stream, py::handle blocks) {
            std::vector<int64_t> lens = parse_lens(seq_lens, core.geometry().max_batch);
            // Nothing to map (decode): recorded with the GIL held. Else the GIL goes first.
            if (blocks.is_none() && core.try_step(lens)) return;
            std::vector<BlockUpdate> updates = parse_updates(blocks, core.geometry().num_groups());
            py::gil_scoped_release nogil;
            core.step(lens, updates, stream);
          },
          py::arg("seq_lens"), py::arg("stream") = 0, py::arg("blocks") = py::none())
      .def("block_table", &KVCacheCore::block_table, py::arg("slot"))
      .def("release_blocks", &KVCacheCore::release_blocks, py::arg("ids"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "capacity",
          [](KVCacheCore& core, py::handle seq_lens, std::vector<int64_t> new_lens) {
            std::vector<int64_t> lens = parse_lens(seq_lens, core.geometry().max_batch);
            vattention::Capacity c;
            {
              py::gil_scoped_release nogil;
              c = core.capacity(lens, new_lens);
            }
            return capacity_dict(c);
          },
          py::arg("seq_lens"), py::arg("new_lens") = std::vector<int64_t>{})
      .def(
          "prefetch",
          [](KVCacheCore& core, py::handle seq_lens, int64_t lookahead) {
            std::vector<int64_t> lens = parse_lens(seq_lens, core.geometry().max_batch);
            py::gil_scoped_release nogil;
            core.prefetch(lens, lookahead);
          },
          py::arg("seq_lens"), py::arg("lookahead_tokens") = -1)
      .def("wait", &KVCacheCore::wait, py::call_guard<py::gil_scoped_release>())
      .def("reserve", &KVCacheCore::reserve, py::arg("bytes"),
           py::call_guard<py::gil_scoped_release>())
      .def("reclaim", &KVCacheCore::reclaim, py::call_guard<py::gil_scoped_release>())
      .def("shrink", &KVCacheCore::shrink, py::arg("keep_bytes"),
           py::call_guard<py::gil_scoped_release>())
      .def("set_memory_budget", &KVCacheCore::set_memory_budget, py::arg("budget_bytes"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "set_lookahead",
          [](KVCacheCore& core, int64_t tokens) {
            vattention::Tuning t;
            t.lookahead_tokens = tokens;
            core.tune(t);
          },
          py::arg("tokens"))
      .def(
          "set_scrub",
          [](KVCacheCore& core, bool on) {
            vattention::Tuning t;
            t.scrub = on;
            core.tune(t);
          },
          py::arg("on"))
      .def(
          "set_headroom",
          [](KVCacheCore& core, int64_t bytes) {
            vattention::Tuning t;
            t.headroom_bytes = bytes;
            py::gil_scoped_release nogil;  // it may wake the prefetch thread
            core.tune(t);
          },
          py::arg("bytes"))
      .def("mapped_tokens", &KVCacheCore::mapped_tokens, py::arg("slot"))
      .def("seq_len", &KVCacheCore::seq_len, py::arg("slot"))
      .def("active_slots", &KVCacheCore::active_slots)
      .def("stats",
           [](const KVCacheCore& core) {
             py::dict out;
             for (const auto& kv : core.stats()) out[py::str(kv.first)] = kv.second;
             return out;
           })
      .def("check_invariants", &KVCacheCore::check_invariants)
      // Prefix sharing, swap and eviction: see vattention/sharing.py for the contracts.
      .def("fork", &KVCacheCore::fork, py::arg("src"), py::arg("num_tokens") = -1,
           py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def("share_prefix", &KVCacheCore::share_prefix, py::arg("src"), py::arg("dst"),
           py::arg("num_tokens"), py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def("ensure_private", &KVCacheCore::ensure_private, py::arg("slot"), py::arg("start_token"),
           py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def("swap_out", &KVCacheCore::swap_out, py::arg("slot"), py::arg("stream") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def("swap_in", &KVCacheCore::swap_in, py::arg("handle"), py::arg("stream") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def("swap_drop", &KVCacheCore::swap_drop, py::arg("handle"),
           py::call_guard<py::gil_scoped_release>())
      .def("set_swap_budget", &KVCacheCore::set_swap_budget, py::arg("budget_bytes"))
      .def("pick_victims", &KVCacheCore::pick_victims, py::arg("bytes_needed"))
      .def("window_starts", &KVCacheCore::window_starts, py::arg("slot"))
      .def("check_reads", &KVCacheCore::check_reads, py::arg("tensor"), py::arg("slots"),
           py::arg("begins"), py::arg("ends"))
      .def("close", &KVCacheCore::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("closed", &KVCacheCore::closed)
      .def_property_readonly("backend_name", [](KVCacheCore& c) { return c.backend().name(); })
      .def_property_readonly("granularity",
                             [](KVCacheCore& c) { return c.backend().granularity(); })
      .def("tensor_base", &KVCacheCore::tensor_base, py::arg("tensor"))
      .def(
          "export_tensor",
          [](const std::shared_ptr<KVCacheCore>& core, int kv, int layer, int dl_code, int bits,
             bool host_alias) { return export_tensor(core, kv, layer, dl_code, bits, host_alias); },
          py::arg("kv"), py::arg("layer"), py::arg("dl_code"), py::arg("bits"),
          py::arg("host_alias") = false)
      .def(
          "inject_host_fault",
          [](KVCacheCore& core, const std::string& op, int nth, bool out_of_memory) {
            host_backend(core).inject_fault(op, nth, out_of_memory);
          },
          py::arg("op"), py::arg("nth"), py::arg("out_of_memory") = false,
          "Test hook: make the nth next host backend call `op` fail.")
      .def(
          "host_backend_calls",
          [](KVCacheCore& core, const std::string& op) { return host_backend(core).calls(op); },
          py::arg("op"), "Test hook: how often the host backend primitive `op` was called.");
}

}  // namespace python
}  // namespace vattention
