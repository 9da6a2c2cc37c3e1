// bfloat16 as the CPU kernels hold it (uint16 bits) and its conversions to and from float32, shared by every unit
// that takes bfloat16 rows (f32_gemm.cpp, q_gemm.cpp, q8a_gemm.cpp).
#pragma once

#include <cstdint>
#include <cstring>

namespace {

using bf16 = uint16_t;

inline float widen(float x) { return x; }
inline float widen(bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// float32 -> bfloat16, nearest even, NaN a quiet NaN, denormals kept: torch's conversion, in every build.
inline bf16 narrow_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
  return static_cast<bf16>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace
