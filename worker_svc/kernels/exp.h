// exp's polynomials, shared by the attention kernel (its softmax), cpu_ops.cpp (bfloat16 SiLU) and f32_ops.cpp
// (float32 SiLU). NOTE: internal linkage (an anonymous namespace) on purpose: f32_ops.cpp includes this under
// `fp-contract=off` and the others do not, so each library unit must keep its own copy, compiled with its flags.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

// c[0] x^(N-1) + c[1] x^(N-2) + ... + c[N-1] by Horner's rule, in that order (p = p * x + c[i]: the bits depend on
// it, and on whether the unit lets the compiler fuse each step into an FMA).
template <int N>
inline float horner(float x, const float (&c)[N]) {
  float p = c[0];
#pragma GCC unroll 8
  for (int i = 1; i < N; ++i) p = p * x + c[i];
  return p;
}

// exp(x) for x in [-87, 87] (the caller clamps): 2^(x log2 e) as 2^n * p(f), rel. error < 2e-7, no libm call.
inline float exp_poly(float x) {
  const float t = x * 1.44269504088896341f;
  const float n = std::floor(t);
  const float f = t - n;
  const float p = horner(f, {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                             5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f});
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // n in [-126, 127]: a normal power of two
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

#if defined(__AVX512F__)
// exp_poly on 16 lanes (x clamped by the caller): the same polynomial, 2^n applied with scalef.
inline __m512 exp_poly16(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

}  // namespace
