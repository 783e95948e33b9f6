// The pieces of the vattention._C module (module.cpp puts them together). Only csrc/python/ knows
// Python: the core, the backends and the kernels are plain C++.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <exception>
#include <vector>

namespace vattention {
namespace python {

// CacheGeometry as _C.CacheGeometry: named fields and every derived size (geometry_bindings.cpp).
void bind_geometry(pybind11::module_& m);
// KVCacheCore as _C.KVCacheCore, and the DLPack export of its tensors (cache_bindings.cpp).
void bind_cache(pybind11::module_& m);
// {slot: length} (unlisted slots untouched) or a length-max_batch sequence (0 = untouched), as the
// core's lens vector. Throws InvalidSlot/TypeError naming the bad entry.
std::vector<int64_t> parse_lens(pybind11::handle obj, int64_t max_batch);
// Sets the Python error for a C++ exception as pybind11's translation would (vattention::Error as
// its vattention.errors class; module.cpp), for functions called outside pybind11's dispatch.
void set_python_error(std::exception_ptr error) noexcept;

}  // namespace python
}  // namespace vattention
