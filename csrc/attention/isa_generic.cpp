// The attention kernels for any CPU (the baseline ISA of the build): the fallback when neither
// AVX-512 nor AVX2 + FMA + F16C is available. See kernel_impl.h.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attention/plan.h"

namespace vattention {
namespace attention {
namespace isa_generic {
// clang-format off: the vector type must come before the kernels that use it.
#include "attention/vec_generic.h"
#include "attention/kernel_impl.h"
// clang-format on
}  // namespace isa_generic

KernelTable kernels_generic() { return isa_generic::table("generic"); }
}  // namespace attention
}  // namespace vattention
