// Chooses the backend for a device string. The CUDA backend is compiled only when cuda.h was found
// at build time (setup.py defines VATTENTION_WITH_CUDA); it still loads libcuda at run time.
#include <string>

#include "python/backend_factory.h"

#include "core/errors.h"
#include "host/host_backend.h"

#ifdef VATTENTION_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace vattention {

std::unique_ptr<Backend> make_backend(const std::string& device, size_t page_bytes) {
  if (device == "cpu") return std::make_unique<HostBackend>(page_bytes);
  if (device.rfind("cuda", 0) == 0) {
    int ordinal = 0;
    const std::string rest = device.substr(4);
    if (!rest.empty()) {
      const bool digits = rest.size() > 1 && rest.size() <= 6 && rest[0] == ':' &&
                          rest.find_first_not_of("0123456789", 1) == std::string::npos;
      if (!digits) {
        throw Error(Error::Kind::Config,
                    "device=" + device + " is not supported; use cpu, cuda or cuda:N");
      }
      ordinal = std::stoi(rest.substr(1));
    }
#ifdef VATTENTION_WITH_CUDA
    return make_cuda_backend(ordinal, page_bytes);
#else
    (void)ordinal;
    throw Error(Error::Kind::Unavailable, backend_unavailable_reason("cuda"));
#endif
  }
  throw Error(Error::Kind::Config,
              "device=" + device + " is not supported; use cpu, cuda or cuda:N");
}

std::string backend_unavailable_reason(const std::string& kind) {
  if (kind == "host") return "";
  if (kind == "cuda") {
#ifdef VATTENTION_WITH_CUDA
    return cuda_unavailable_reason();
#else
    return "the CUDA backend was not compiled in: cuda.h was not found at build time "
           "(set CUDA_HOME and reinstall)";
#endif
  }
  return "unknown backend " + kind;
}

size_t release_unused_contexts() {
#ifdef VATTENTION_WITH_CUDA
  return release_unused_primary_contexts();
#else
  return 0;
#endif
}

}  // namespace vattention
