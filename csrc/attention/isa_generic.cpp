// The attention kernels for any CPU (the baseline ISA of the build): the fallback when neither
// AVX-512 nor AVX2 + FMA + F16C is available. See isa_kernels.h.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attention/plan.h"

// On x86-64 these kernels are the fallback for CPUs without AVX2 (the AVX2 and AVX-512 ones
// serve the rest): compiled without forced unrolling, which took this file from 162 to 32 s of
// the build (a GQA-4 decode call 1.5-1.7x slower on such a CPU, GQA-1 the same; prefill not
// measured). Elsewhere (aarch64) they are the kernels every call runs, unrolled as the others.
#if defined(__x86_64__)
#define VATTN_UNROLL
#endif

namespace vattention {
namespace attention {
namespace isa_generic {
// clang-format off: the vector type must come before the kernels that use it.
#include "attention/vec_generic.h"
#include "attention/isa_kernels.h"
// clang-format on
}  // namespace isa_generic

KernelTable kernels_generic() { return isa_generic::table("generic"); }
}  // namespace attention
}  // namespace vattention
