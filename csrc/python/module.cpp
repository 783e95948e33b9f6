// pybind11 module vattention._C.
//
// - vattention::Error is translated into the matching class of vattention.errors, with its numbers
//   and strings set as attributes.
// - The GIL is released around anything that may call the OS/driver or wait.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>

#include "core/backend.h"
#include "core/errors.h"
#include "core/page_pool.h"
#include "host/host_backend.h"
#include "python/attention_bindings.h"
#include "python/backend_factory.h"
#include "python/bindings.h"

namespace py = pybind11;
using vattention::Error;

namespace {

const char* python_class(Error::Kind kind) {
  switch (kind) {
    case Error::Kind::Config: return "ConfigError";
    case Error::Kind::InvalidSlot: return "InvalidSlotError";
    case Error::Kind::SequenceTooLong: return "SequenceTooLongError";
    case Error::Kind::OutOfPages: return "OutOfPagesError";
    case Error::Kind::Driver: return "DriverError";
    case Error::Kind::Unavailable: return "BackendUnavailableError";
    case Error::Kind::Closed: return "CacheClosedError";
    case Error::Kind::SwapSpace: return "SwapSpaceError";
    case Error::Kind::UnmappedRead: return "UnmappedReadError";
  }
  return "VAttentionError";
}

void raise_python(const Error& e) {
  py::object cls = py::module_::import("vattention.errors").attr(python_class(e.kind()));
  py::object exc = cls(e.what());
  for (const auto& kv : e.ints()) exc.attr(kv.first.c_str()) = kv.second;
  for (const auto& kv : e.strs()) exc.attr(kv.first.c_str()) = kv.second;
  PyErr_SetObject(cls.ptr(), exc.ptr());
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "vattention C++ core (see vattention.KVCache for the public API)";
  py::register_exception_translator([](std::exception_ptr p) {
    if (!p) return;
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      raise_python(e);
    }
  });

  m.def("backend_unavailable_reason", &vattention::backend_unavailable_reason, py::arg("kind"),
        "'' if the backend ('host' or 'cuda') can run here, else why not.");
  m.def(
      "backend_granularity",
      [](const std::string& device) {
        // Any legal page size works for asking: use a large multiple of every granularity.
        auto backend = vattention::make_backend(device, size_t{2} << 20);
        return backend->granularity();
      },
      py::arg("device"), "Minimum page size in bytes of the backend for `device`.");
  m.def("release_unused_contexts", &vattention::release_unused_contexts,
        "Test hook: release the CUDA primary contexts no cache uses (they are held for the "
        "process's life otherwise). Returns how many.");
  m.def("host_huge_unit", &vattention::HostBackend::huge_unit,
        "Host pages whose size is a multiple of this are 2 MB huge pages of the OS (0: none).");
  m.def("host_mapping_limit", &vattention::HostBackend::mapping_limit,
        "Page mappings the host backend allows this process (see host/host_backend.h).");

  // The raw backend primitives, for backend-level tests (not part of the public API).
  py::class_<vattention::Backend>(m, "Backend")
      .def(py::init([](const std::string& device, size_t page_bytes) {
             return vattention::make_backend(device, page_bytes);
           }),
           py::arg("device"), py::arg("page_bytes"))
      .def_property_readonly("granularity", &vattention::Backend::granularity)
      .def_property_readonly("page_bytes", &vattention::Backend::page_bytes)
      .def_property_readonly("name", &vattention::Backend::name)
      .def("bind_thread", &vattention::Backend::bind_thread)
      .def("reserve", &vattention::Backend::reserve, py::arg("bytes"))
      .def("release_va", &vattention::Backend::release_va, py::arg("va"), py::arg("bytes"))
      .def("create_page", &vattention::Backend::create_page)
      .def("destroy_page", &vattention::Backend::destroy_page, py::arg("page"))
      .def("map", &vattention::Backend::map, py::arg("va"), py::arg("page"))
      .def("set_access", &vattention::Backend::set_access, py::arg("va"), py::arg("bytes"))
      .def("unmap", &vattention::Backend::unmap, py::arg("va"), py::arg("bytes"))
      .def("committed_bytes", &vattention::Backend::committed_bytes)
      .def("huge_page_bytes", &vattention::Backend::huge_page_bytes);

  // The page pool over such a backend, for the pool's own contract tests (tests/test_page_pool.py).
  using vattention::PagePool;
  py::class_<PagePool>(m, "PagePool")
      .def(py::init<vattention::Backend&, int64_t>(), py::arg("backend"),
           py::arg("budget_bytes") = PagePool::kNoBudget, py::keep_alive<1, 2>())
      .def_property_readonly("page_bytes", &PagePool::page_bytes)
      .def_property_readonly("total", &PagePool::total)
      .def_property_readonly("free", &PagePool::free)
      .def_property_readonly("in_use", &PagePool::in_use)
      .def_property_readonly("budget_bytes", &PagePool::budget_bytes)
      .def_property_readonly("headroom",
                             [](const PagePool& p) {
                               return p.headroom() == SIZE_MAX ? py::object(py::none())
                                                               : py::object(py::int_(p.headroom()));
                             })
      .def_property_readonly("pages_created", &PagePool::pages_created)
      .def_property_readonly("pages_destroyed", &PagePool::pages_destroyed)
      .def_property_readonly("extra_refs", &PagePool::extra_refs)
      .def_property_readonly("creating", &PagePool::creating)
      .def("refs", &PagePool::refs, py::arg("page"))
      .def("reserve", &PagePool::reserve, py::arg("num_pages"))
      .def("take", &PagePool::take, py::arg("num_pages"))
      .def("untake", &PagePool::untake, py::arg("pages"), py::arg("num_created"))
      .def("share", &PagePool::share, py::arg("page"))
      .def("release", &PagePool::release, py::arg("page"))
      .def("shrink", &PagePool::shrink, py::arg("keep_bytes"))
      .def("destroy_all", &PagePool::destroy_all)
      .def("set_budget", &PagePool::set_budget, py::arg("budget_bytes"))
      .def("begin_create", &PagePool::begin_create, py::arg("n"))
      .def("end_create", &PagePool::end_create, py::arg("reserved"), py::arg("made"));

  vattention::python::bind_geometry(m);
  vattention::python::bind_cache(m);
  register_attention(m);  // the CPU attention kernel (csrc/attention)
}
