// Fused elementwise ops for the float32 lean forward on the CPU (worker_svc/cpu_ops.py): each is one pass over its
// rows instead of torch's 3-6 kernels of the same math (a 512-token prefill step spent ~60 ms of ~410 in them).
// Built into the CPU kernel library with paged_attention_cpu.cpp (worker_svc/cpu_build.py).
//
// Rounding: every product and sum is rounded to float32 where torch's op rounds it (contraction into FMAs is off
// below), so the residual adds, the rotary and the SiLU product's multiply give torch's bits; the RMSNorm's sum of
// squares runs in a fixed order of its own (16 lane sums, then a fixed tree), and SiLU's exp is Cephes' (torch's is
// Sleef's): those differ from torch by an ulp or so. Plain loops the compiler vectorises: with
// contraction off and a fixed reduction order, every build of the library (native or portable) gives the same bits.
#include <cmath>
#include <cstdint>
#include <cstring>

#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// NOTE: after the pragma: what these define is compiled under it in this unit (each unit has its own copy).
#include "kernels/exp.h"
#include "kernels/simd.h"

namespace {

constexpr int kLanes = 16;

// exp(x) in float32 (Cephes' expf: rel. error ~1.2e-7): n = round(x log2 e), r = x - n ln 2 in two parts (so r
// keeps x's precision: a single x * log2 e loses ~5e-6 at x ~ 12), exp(r) by a degree-7 polynomial, times 2^n.
// Past 88.72: inf (as torch's); below -87.3: 0 (torch's gives denormals there: silu's g / (1 + exp(-g)) is g either
// way).
inline float exp_f32(float x) {
  const float xc = x < -87.3f ? -87.3f : (x > 88.5f ? 88.5f : x);
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  const float p = horner(r, {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                             1.6666665459e-1f, 5.0000001201e-1f});
  const float y = p * (r * r) + r + 1.0f;
  // 2^n as two normal powers of two (n in [-126, 128]: 2^128 is not a float)
  const int32_t half = static_cast<int32_t>(n) >> 1;
  const int32_t b1 = (half + 127) << 23, b2 = (static_cast<int32_t>(n) - half + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &b1, 4);
  std::memcpy(&s2, &b2, 4);
  const float e = y * s1 * s2;
  return x > 88.72283f ? INFINITY : (x < -87.3f ? 0.0f : e);
}

// exp_f32 on the lanes of V (F32x16: AVX-512, F32x8: AVX2), the same operations in the same order (so the same
// bits); the compiler does not vectorise exp_f32's integer steps (a scalar SiLU product ran 5x slower than torch's).
template <class V>
inline typename V::V exp_lanes(typename V::V x) {
  using F = typename V::V;
  using I = typename V::I;
  const F xc = V::min(V::max(x, V::set1(-87.3f)), V::set1(88.5f));
  const F n = V::floor(V::add(V::mul(xc, V::set1(1.44269504088896341f)), V::set1(0.5f)));
  const F r = V::sub(V::sub(xc, V::mul(n, V::set1(0.693359375f))), V::mul(n, V::set1(-2.12194440e-4f)));
  F p = V::set1(1.9875691500e-4f);
  p = V::add(V::mul(p, r), V::set1(1.3981999507e-3f));
  p = V::add(V::mul(p, r), V::set1(8.3334519073e-3f));
  p = V::add(V::mul(p, r), V::set1(4.1665795894e-2f));
  p = V::add(V::mul(p, r), V::set1(1.6666665459e-1f));
  p = V::add(V::mul(p, r), V::set1(5.0000001201e-1f));
  const F y = V::add(V::add(V::mul(p, V::mul(r, r)), r), V::set1(1.0f));
  const I ni = V::to_int(n), half = V::srai1(ni), bias = V::set1i(127);
  const F s1 = V::exponent(V::addi(half, bias));
  const F s2 = V::exponent(V::addi(V::subi(ni, half), bias));
  const F e = V::where_lt(x, -87.3f, V::zero(), V::mul(V::mul(y, s1), s2));
  return V::where_gt(x, 88.72283f, V::set1(INFINITY), e);
}

// SiLU-gated products of one row on the lanes of V, from column i while whole vectors fit; returns the first left.
template <class V>
inline int64_t silu_mul_lanes(const float* g, const float* u, float* o, int64_t inter, int64_t i) {
  for (; i + V::kLanes <= inter; i += V::kLanes) {
    const typename V::V gv = V::load(g + i);
    const typename V::V e = exp_lanes<V>(V::sub(V::zero(), gv));
    V::store(o + i, V::mul(V::div(gv, V::add(V::set1(1.0f), e)), V::load(u + i)));
  }
  return i;
}

// out = w * (x * (1 / sqrt(mean(x^2) + eps))) for one row of `dim` (transformers' LlamaRMSNorm in float32).
inline void norm_row(const float* x, const float* w, float eps, int64_t dim, float* out) {
  float lane[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes)
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) lane[j] += x[d + j] * x[d + j];
  for (int j = 0; d < dim; ++d, ++j) lane[j] += x[d] * x[d];
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) lane[j] += lane[j + width];
  const float inv = 1.0f / std::sqrt(lane[0] / static_cast<float>(dim) + eps);
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) out[i] = w[i] * (x[i] * inv);
}

// x = x + delta, one row.
inline void add_row(float* x, const float* delta, int64_t dim) {
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) x[d] = x[d] + delta[d];
}

// The SiLU-gated MLP's middle for one row: o[i] = (g / (1 + exp(-g))) * u.
inline void silu_mul_row(const float* g, const float* u, float* o, int64_t inter) {
  int64_t i = 0;
#if defined(__AVX512F__)
  i = silu_mul_lanes<F32x16>(g, u, o, inter, i);
#elif defined(__AVX2__)
  i = silu_mul_lanes<F32x8>(g, u, o, inter, i);
#endif
  for (; i < inter; ++i) o[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
}

// Rotate-half rotary of one head of hd = 2 * half (v: its values, c/s: its token's cos/sin), each product rounded.
inline void rope_head(float* v, const float* c, const float* s, int64_t half) {
#pragma omp simd
  for (int64_t d = 0; d < half; ++d) {
    const float lo = v[d], hi = v[d + half];
    v[d] = lo * c[d] + (-hi) * s[d];
    v[d + half] = hi * c[d + half] + lo * s[d + half];
  }
}

}  // namespace

#include "kernels/row_ops.h"  // NOTE: after the row functions it calls (see there)

extern "C" {

// RMSNorm of `rows` rows of `dim` float32 values.
void ps_rms_norm_f32(const float* x, const float* w, float eps, int64_t rows, int64_t dim, float* out) {
  rms_norm_rows(x, w, eps, rows, dim, out);
}

// The residual add, then the next RMSNorm: x = x + delta in place, out = rms_norm(x).
void ps_add_rms_norm_f32(float* x, const float* delta, const float* w, float eps, int64_t rows, int64_t dim,
                         float* out) {
  add_rms_norm_rows(x, delta, w, eps, rows, dim, out);
}

// The SiLU-gated MLP's middle: gu is [rows, 2 * inter] (gate | up); out[r, i] = (g / (1 + exp(-g))) * u.
void ps_silu_mul_f32(const float* gu, int64_t rows, int64_t inter, float* out) {
  silu_mul_rows(gu, rows, inter, out);
}

// Rotate-half rotary embedding in place: x is [tokens, heads, hd] with rows `x_stride` elements apart (heads are
// contiguous within a row), cos/sin [tokens, hd]; x = x * cos + rotate_half(x) * sin, each product rounded.
void ps_rope_f32(float* x, int64_t x_stride, const float* cos, const float* sin, int64_t tokens, int64_t heads,
                 int64_t hd) {
  rope_rows(x, x_stride, cos, sin, tokens, heads, hd);
}

}  // extern "C"

#pragma GCC pop_options
