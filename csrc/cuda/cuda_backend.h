// Factory for the CUDA backend (the CUDA driver's VMM API, see cuda_backend.cpp).
//
// backend_factory.cpp calls these under #ifdef VATTENTION_WITH_CUDA; without that macro the
// declarations are absent, so a build without cuda.h cannot reference them by accident.
#pragma once

#ifdef VATTENTION_WITH_CUDA

#include <cstddef>
#include <memory>
#include <string>

#include "core/backend.h"

namespace vattention {

// The CUDA backend on device `ordinal` with pages of page_bytes.
// Throws Error(Kind::Unavailable) when the driver cannot be loaded/initialised, no device exists,
// or the device lacks virtual memory management; Error(Kind::Config) when ordinal is out of range
// or page_bytes is not a positive multiple of the device's minimum VMM granularity.
std::unique_ptr<Backend> make_cuda_backend(int ordinal, size_t page_bytes);

// "" when a CUDA backend could be built on device 0 here, else the reason. Never throws.
std::string cuda_unavailable_reason();

// Releases the process's retains of primary contexts that no backend uses any more (they are
// otherwise held for the process's life: see cuda_backend.cpp). Returns how many. For tests that
// reset an emulated driver between cases; never throws.
size_t release_unused_primary_contexts();

}  // namespace vattention

#endif  // VATTENTION_WITH_CUDA
