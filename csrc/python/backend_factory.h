// The backend for a device string, for the bindings (C++ callers construct a backend directly).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "core/backend.h"

namespace vattention {

// Builds the backend for a device string ("cpu", "cuda", "cuda:N") and page size.
// Throws Error(Kind::Unavailable) with the reason when that backend cannot run here, and
// Error(Kind::Config) when page_bytes is not a positive multiple of the granularity.
std::unique_ptr<Backend> make_backend(const std::string& device, size_t page_bytes);

// Why a backend is (un)available, for `python -m vattention info`: "" when it is available.
std::string backend_unavailable_reason(const std::string& kind);

// Releases the CUDA primary contexts no backend uses any more (0 without the CUDA backend): see
// cuda/cuda_backend.h. Tests call it before resetting the emulated driver.
size_t release_unused_contexts();

}  // namespace vattention
