// pybind11 glue of the CPU attention kernel: the only file where Python meets csrc/attention.
//
// vattention/attention/kernel.py checks dtypes, shapes and strides of the torch tensors
// and passes raw data pointers and element strides here; the kernel checks the values it reads
// (cache_seqlens, cache_batch_idx, cu_seqlens_q) before writing anything and throws
// std::invalid_argument, which pybind11 raises as ValueError. The GIL is released while the
// kernel runs (it touches no Python object).
//
// prepare_attention() is the same kernel for a serving loop's layer after layer: the layer's
// fixed arguments (vattention/attention/plan.py checks them once) held by a plain CPython
// function that takes only what changes per call, through vectorcall (no argument tuple, no
// keyword matching, none of pybind11's dispatch): in an engine each layer's call comes after
// its matmuls have evicted the interpreter's code and data, where every step of the generic
// entry costs several times what it costs in a loop.
#include "python/attention_bindings.h"

#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "attention/attention.h"
#include "python/bindings.h"

namespace py = pybind11;
namespace at = vattention::attention;

namespace {

// (data pointer, batch stride, token stride, head stride), strides in elements
using OperandTuple = std::tuple<uintptr_t, int64_t, int64_t, int64_t>;

at::Operand operand(const OperandTuple& t) {
  return at::Operand{reinterpret_cast<void*>(std::get<0>(t)), std::get<1>(t), std::get<2>(t),
                     std::get<3>(t)};
}

at::DType dtype(int code) {
  if (code < 0 || code > static_cast<int>(at::DType::kFloat8E5M2)) {
    throw py::value_error("unknown attention dtype code " + std::to_string(code));
  }
  return static_cast<at::DType>(code);
}

// One int argument of a prepared call (a count, a stride or an address); false with a Python
// error set.
bool int_arg(PyObject* obj, int64_t* out) {
  const long long v = PyLong_AsLongLong(obj);
  if (v == -1 && PyErr_Occurred()) return false;
  *out = v;
  return true;
}

// The ints of `tuple` (exactly n of them) into out[0..n), or false with a Python error set.
bool int_tuple(PyObject* tuple, Py_ssize_t n, const char* what, int64_t* out) {
  if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) != n) {
    PyErr_Format(PyExc_TypeError, "%s must be a tuple of %zd ints", what, n);
    return false;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!int_arg(PyTuple_GET_ITEM(tuple, i), out + i)) return false;
  }
  return true;
}

// run(batch, layout, q, out, k_new, v_new, num_threads): batch = (num_requests, q_tokens,
// cu_seqlens_q, cache_seqlens, cache_batch_idx, prefix_group, prefix_len) (addresses of int32
// arrays, 0 for none), layout = the token and head strides of q, out, k_new and v_new (elements),
// then their data addresses (k_new 0: no append) and the OpenMP team size. `self` is a capsule
// holding the layer's fixed Args. The kernel checks the values it reads before it writes.
PyObject* run_prepared(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 7) {
    PyErr_Format(PyExc_TypeError,
                 "run(batch, layout, q, out, k_new, v_new, num_threads) takes 7 arguments (%zd "
                 "given)",
                 nargs);
    return nullptr;
  }
  const auto* fixed = static_cast<const at::Args*>(PyCapsule_GetPointer(self, nullptr));
  if (!fixed) return nullptr;
  int64_t batch[7], layout[8], q, out, k, v, threads;
  if (!int_tuple(args[0], 7, "batch", batch) || !int_tuple(args[1], 8, "layout", layout) ||
      !int_arg(args[2], &q) || !int_arg(args[3], &out) || !int_arg(args[4], &k) ||
      !int_arg(args[5], &v) || !int_arg(args[6], &threads)) {
    return nullptr;
  }
  at::Args a = *fixed;
  a.num_requests = batch[0];
  a.q_tokens = batch[1];
  a.cu_seqlens_q = reinterpret_cast<const int32_t*>(batch[2]);
  a.cache_seqlens = reinterpret_cast<const int32_t*>(batch[3]);
  a.cache_batch_idx = reinterpret_cast<const int32_t*>(batch[4]);
  a.prefix_group = reinterpret_cast<const int32_t*>(batch[5]);
  a.prefix_len = reinterpret_cast<const int32_t*>(batch[6]);
  a.q = at::Operand{reinterpret_cast<void*>(q), 0, layout[0], layout[1]};
  a.out = at::Operand{reinterpret_cast<void*>(out), 0, layout[2], layout[3]};
  if (k != 0) {
    a.k_new = at::Operand{reinterpret_cast<void*>(k), 0, layout[4], layout[5]};
    a.v_new = at::Operand{reinterpret_cast<void*>(v), 0, layout[6], layout[7]};
  }
  a.num_threads = static_cast<int>(threads);
  try {
    py::gil_scoped_release nogil;
    at::flash_attn_with_kvcache(a);
  } catch (const std::invalid_argument& e) {  // a value the kernel refused, as pybind11 maps it
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  } catch (...) {
    vattention::python::set_python_error(std::current_exception());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef run_prepared_def = {
    "run", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(run_prepared)),
    METH_FASTCALL,
    "run(batch, layout, q, out, k_new, v_new, num_threads): the kernel over one layer's "
    "prepared arguments."};

void drop_args(PyObject* capsule) {
  delete static_cast<at::Args*>(PyCapsule_GetPointer(capsule, nullptr));
}

}  // namespace

void register_attention(py::module_& m) {
  m.def(
      "flash_attn_with_kvcache",
      [](int64_t num_requests, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
         int dtype_code, int cache_dtype_code, const OperandTuple& q, const OperandTuple& out,
         const OperandTuple& k_new, const OperandTuple& v_new, const OperandTuple& k_cache,
         const OperandTuple& v_cache, uintptr_t cu_seqlens_q, int64_t seqlen_q, int64_t q_tokens,
         int64_t seqlen_new, int64_t cache_batch, int64_t cache_len, uintptr_t cache_seqlens,
         uintptr_t cache_batch_idx, float softmax_scale, bool causal, int64_t window_left,
         int64_t window_right, float k_descale, float v_descale, int num_threads,
         uintptr_t prefix_group, uintptr_t prefix_len) {
        at::Args a;
        a.num_requests = num_requests;
        a.num_heads = num_heads;
        a.num_kv_heads = num_kv_heads;
        a.head_dim = head_dim;
        a.dtype = dtype(dtype_code);
        a.cache_dtype = dtype(cache_dtype_code);
        a.q = operand(q);
        a.out = operand(out);
        a.k_new = operand(k_new);
        a.v_new = operand(v_new);
        a.k_cache = operand(k_cache);
        a.v_cache = operand(v_cache);
        a.cu_seqlens_q = reinterpret_cast<const int32_t*>(cu_seqlens_q);
        a.seqlen_q = seqlen_q;
        a.q_tokens = q_tokens;
        a.seqlen_new = seqlen_new;
        a.cache_batch = cache_batch;
        a.cache_len = cache_len;
        a.cache_seqlens = reinterpret_cast<const int32_t*>(cache_seqlens);
        a.cache_batch_idx = reinterpret_cast<const int32_t*>(cache_batch_idx);
        a.softmax_scale = softmax_scale;
        a.causal = causal;
        a.window_left = window_left;
        a.window_right = window_right;
        a.k_descale = k_descale;
        a.v_descale = v_descale;
        a.num_threads = num_threads;
        a.prefix_group = reinterpret_cast<const int32_t*>(prefix_group);
        a.prefix_len = reinterpret_cast<const int32_t*>(prefix_len);
        py::gil_scoped_release nogil;
        at::flash_attn_with_kvcache(a);
      },
      py::arg("num_requests"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
      py::arg("dtype"), py::arg("cache_dtype"), py::arg("q"), py::arg("out"), py::arg("k_new"),
      py::arg("v_new"), py::arg("k_cache"), py::arg("v_cache"), py::arg("cu_seqlens_q"),
      py::arg("seqlen_q"), py::arg("q_tokens"), py::arg("seqlen_new"), py::arg("cache_batch"),
      py::arg("cache_len"), py::arg("cache_seqlens"), py::arg("cache_batch_idx"),
      py::arg("softmax_scale"), py::arg("causal"), py::arg("window_left"), py::arg("window_right"),
      py::arg("k_descale"), py::arg("v_descale"), py::arg("num_threads"),
      py::arg("prefix_group") = 0, py::arg("prefix_len") = 0,
      "Raw entry of the CPU attention kernel; use "
      "vattention.attention.cpu_attention.");
  m.def(
      "prepare_attention",
      [](int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int dtype_code,
         int cache_dtype_code, const OperandTuple& k_cache, const OperandTuple& v_cache,
         int64_t cache_batch, int64_t cache_len, float softmax_scale, bool causal,
         int64_t window_left, int64_t window_right, float k_descale, float v_descale) {
        auto a = std::make_unique<at::Args>();
        a->num_heads = num_heads;
        a->num_kv_heads = num_kv_heads;
        a->head_dim = head_dim;
        a->dtype = dtype(dtype_code);
        a->cache_dtype = dtype(cache_dtype_code);
        a->k_cache = operand(k_cache);
        a->v_cache = operand(v_cache);
        a->cache_batch = cache_batch;
        a->cache_len = cache_len;
        a->softmax_scale = softmax_scale;
        a->causal = causal;
        a->window_left = window_left;
        a->window_right = window_right;
        a->k_descale = k_descale;
        a->v_descale = v_descale;
        PyObject* capsule = PyCapsule_New(a.get(), nullptr, drop_args);
        if (!capsule) throw py::error_already_set();
        a.release();  // the capsule owns it now
        PyObject* fn = PyCFunction_NewEx(&run_prepared_def, capsule, nullptr);
        Py_DECREF(capsule);  // the function holds it now
        if (!fn) throw py::error_already_set();
        return py::reinterpret_steal<py::object>(fn);
      },
      py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("dtype"),
      py::arg("cache_dtype"), py::arg("k_cache"), py::arg("v_cache"), py::arg("cache_batch"),
      py::arg("cache_len"), py::arg("softmax_scale"), py::arg("causal"), py::arg("window_left"),
      py::arg("window_right"), py::arg("k_descale"), py::arg("v_descale"),
      "The kernel bound to one layer's fixed arguments, as a function taking the rest per call; "
      "use vattention.attention.CpuAttentionPlan.");
  m.def("attention_kernel_isa", &at::kernel_isa,
        "Instruction set of the CPU attention kernels in use.");
  m.def(
      "attention_kernel_variants",
      [] {
        std::vector<std::tuple<std::string, bool, std::vector<std::string>,
                               std::vector<std::string>, std::string>>
            out;
        for (const at::KernelVariant& v : at::kernel_variants())
          out.emplace_back(v.name, v.compiled, v.needs, v.missing, v.refused);
        return out;
      },
      "Every variant of the CPU attention kernels, best first: (name, compiled into this build,\n"
      "CPU features it needs, those this CPU lacks, why the OS refuses a state it needs or ''),\n"
      "features spelled as in /proc/cpuinfo.");
  m.def("attention_unused_cpu_features", &at::unused_cpu_features,
        "Features of this CPU no kernel variant uses (AMX-INT8, AMX-FP16, AVX512-FP16), "
        "/proc/cpuinfo spelling.");
  m.def(
      "set_attention_kernel_isa",
      [](const std::string& name) { return at::set_kernel_isa(name.c_str()); }, py::arg("name"),
      "Select the CPU attention kernels ('amx', 'avx512bf16', 'avx512', 'avx2', 'generic'; '' =\n"
      "best).\n"
      "False if this CPU cannot run them.");
  m.def("attention_kernel_tuning", &at::kernel_tuning,
        "The tuning the CPU attention kernels take: 'intel' on Intel CPUs, else 'other' (measured\n"
        "choices of prefetch and loop order; results are the same bits either way).");
  m.def(
      "set_attention_kernel_tuning",
      [](const std::string& name) { return at::set_kernel_tuning(name.c_str()); }, py::arg("name"),
      "Select the CPU attention kernels' tuning ('intel', 'other'; '' = this CPU's), so either\n"
      "is tested on any CPU. False, changing nothing, for another name.");
}
