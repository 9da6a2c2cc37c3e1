// Fused elementwise ops for the bfloat16 lean forward on the CPU (worker_svc/cpu_ops.py): each is one pass over
// its rows instead of the 5-10 torch kernels (and float32 round trips) of the same math op for op. Built into the
// CPU kernel library with paged_attention_cpu.cpp (worker_svc/cpu_build.py).
//
// Rounding follows torch's bfloat16 ops: every op computes in float32 and rounds to bfloat16 (nearest even) where
// torch's op would store its bfloat16 result, so only the order of the RMSNorm's sum differs from torch.
#include <cmath>
#include <cstdint>
#include <cstring>

#include <omp.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "kernels/exp.h"

namespace {

inline float bf2f(uint16_t x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f2bf(float f) {  // round to nearest even; NaN stays a (quiet) NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float rbf(float f) { return bf2f(f2bf(f)); }  // a float32 rounded through bfloat16

// exp(x) clamped to [-87, 87]: exp_poly (rel. error < 2e-7).
inline float exp_clamped(float x) { return exp_poly(x < -87.0f ? -87.0f : (x > 87.0f ? 87.0f : x)); }

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PS_OPS_AVX512 1
inline __m512 vload(const uint16_t* p) {  // 16 bfloat16 -> float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
// NOTE: by hand, not with AVX512-BF16's vcvtneps2bf16 (which flushes denormals): the same bits from every build of
// the library (a portable image's and a -march=native one), so containers serve the host's tokens.
inline __m256i vround(__m512 v) {  // 16 float32 -> bfloat16, nearest even, NaN -> quiet NaN (as f2bf)
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
}
inline void vstore(uint16_t* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), vround(v)); }
inline __m512 vrbf(__m512 v) {  // rounded through bfloat16
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(vround(v)), 16));
}
// The two-vector forms below split 32 bfloat16 (one 64-byte load) into their even and odd elements as float32 lanes
// with a shift and a mask, and merge two results back the same way: no cross-lane conversions (vpmovzxwd, vpmovdw,
// each bound to one port), which made the 16-lane forms above port-bound. Elementwise ops only: lane order differs.
inline void vload2(const uint16_t* p, __m512& even, __m512& odd) {
  const __m512i w = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
// vround's bfloat16 (same bits: nearest even, NaN -> quiet NaN) left in each lane's high half, the low half zero.
inline __m512i vround_hi(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), hi_mask);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_and_si512(_mm512_or_si512(u, _mm512_set1_epi32(0x400000)), hi_mask));
}
inline __m512 vrbf_hi(__m512 v) { return _mm512_castsi512_ps(vround_hi(v)); }  // vrbf's value
inline void vstore2(uint16_t* p, __m512 even, __m512 odd) {  // the 32 values vload2 split, rounded as vround
  _mm512_storeu_si512(p, _mm512_or_si512(vround_hi(odd), _mm512_srli_epi32(vround_hi(even), 16)));
}
inline __m512 vexp(__m512 x) {  // exp_clamped, 16 lanes
  return exp_poly16(_mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(87.0f)));
}
#endif

// out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))) for one row of `dim`.
inline void norm_row(const uint16_t* x, const uint16_t* w, float eps, int64_t dim, uint16_t* out) {
  float ss = 0.0f;
  int64_t d = 0;
#if defined(PS_OPS_AVX512)
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= dim; d += 16) {
    const __m512 v = vload(x + d);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  ss = _mm512_reduce_add_ps(acc);
#endif
  for (; d < dim; ++d) {
    const float v = bf2f(x[d]);
    ss += v * v;
  }
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
  d = 0;
#if defined(PS_OPS_AVX512)
  const __m512 vi = _mm512_set1_ps(inv);
  for (; d + 32 <= dim; d += 32) {
    __m512 xe, xo, we, wo;
    vload2(x + d, xe, xo);
    vload2(w + d, we, wo);
    vstore2(out + d, _mm512_mul_ps(we, vrbf_hi(_mm512_mul_ps(xe, vi))), _mm512_mul_ps(wo, vrbf_hi(_mm512_mul_ps(xo, vi))));
  }
  for (; d + 16 <= dim; d += 16) vstore(out + d, _mm512_mul_ps(vload(w + d), vrbf(_mm512_mul_ps(vload(x + d), vi))));
#endif
  for (; d < dim; ++d) out[d] = f2bf(bf2f(w[d]) * rbf(bf2f(x[d]) * inv));
}

// x = bf16(x + delta), one row.
inline void add_row(uint16_t* x, const uint16_t* delta, int64_t dim) {
  int64_t d = 0;
#if defined(PS_OPS_AVX512)
  for (; d + 32 <= dim; d += 32) {
    __m512 xe, xo, de, dd;
    vload2(x + d, xe, xo);
    vload2(delta + d, de, dd);
    vstore2(x + d, _mm512_add_ps(xe, de), _mm512_add_ps(xo, dd));
  }
  for (; d + 16 <= dim; d += 16) vstore(x + d, _mm512_add_ps(vload(x + d), vload(delta + d)));
#endif
  for (; d < dim; ++d) x[d] = f2bf(bf2f(x[d]) + bf2f(delta[d]));
}

// The SiLU-gated MLP's middle for one row: o[i] = bf16(bf16(silu(g)) * u).
inline void silu_mul_row(const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t inter) {
  int64_t i = 0;
#if defined(PS_OPS_AVX512)
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i + 32 <= inter; i += 32) {
    __m512 ge, go, ue, uo;
    vload2(g + i, ge, go);
    vload2(u + i, ue, uo);
    const __m512 se = _mm512_div_ps(ge, _mm512_add_ps(one, vexp(_mm512_sub_ps(_mm512_setzero_ps(), ge))));
    const __m512 so = _mm512_div_ps(go, _mm512_add_ps(one, vexp(_mm512_sub_ps(_mm512_setzero_ps(), go))));
    vstore2(o + i, _mm512_mul_ps(vrbf_hi(se), ue), _mm512_mul_ps(vrbf_hi(so), uo));
  }
  for (; i + 16 <= inter; i += 16) {
    const __m512 v = vload(g + i);
    const __m512 s = _mm512_div_ps(v, _mm512_add_ps(one, vexp(_mm512_sub_ps(_mm512_setzero_ps(), v))));
    vstore(o + i, _mm512_mul_ps(vrbf(s), vload(u + i)));
  }
#endif
  for (; i < inter; ++i) {
    const float v = bf2f(g[i]);
    o[i] = f2bf(rbf(v / (1.0f + exp_clamped(-v))) * bf2f(u[i]));
  }
}

// Rotate-half rotary of one head of hd = 2 * half (v: its values, c/s: its token's cos/sin):
// v = bf16(bf16(v * cos) + bf16(rotate_half(v) * sin)). NOTE: always inlined, as the loop over heads held it before
// row_ops.h (GCC's size limit would make it a call a head).
__attribute__((always_inline)) inline void rope_head(uint16_t* v, const uint16_t* c, const uint16_t* s, int64_t half) {
#if defined(PS_OPS_AVX512)
  if (half % 32 == 0) {
    for (int64_t d = 0; d < half; d += 32) {
      __m512 le, lo, he, ho, cle, clo, che, cho, sle, slo, she, sho;
      vload2(v + d, le, lo);
      vload2(v + d + half, he, ho);
      vload2(c + d, cle, clo);
      vload2(c + d + half, che, cho);
      vload2(s + d, sle, slo);
      vload2(s + d + half, she, sho);
      const __m512 z = _mm512_setzero_ps();
      vstore2(v + d, _mm512_add_ps(vrbf_hi(_mm512_mul_ps(le, cle)), vrbf_hi(_mm512_mul_ps(_mm512_sub_ps(z, he), sle))),
              _mm512_add_ps(vrbf_hi(_mm512_mul_ps(lo, clo)), vrbf_hi(_mm512_mul_ps(_mm512_sub_ps(z, ho), slo))));
      vstore2(v + d + half, _mm512_add_ps(vrbf_hi(_mm512_mul_ps(he, che)), vrbf_hi(_mm512_mul_ps(le, she))),
              _mm512_add_ps(vrbf_hi(_mm512_mul_ps(ho, cho)), vrbf_hi(_mm512_mul_ps(lo, sho))));
    }
    return;
  }
  if (half % 16 == 0) {
    for (int64_t d = 0; d < half; d += 16) {
      const __m512 lo = vload(v + d), hi = vload(v + d + half);
      const __m512 nlo = _mm512_add_ps(vrbf(_mm512_mul_ps(lo, vload(c + d))),
                                       vrbf(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), hi), vload(s + d))));
      const __m512 nhi = _mm512_add_ps(vrbf(_mm512_mul_ps(hi, vload(c + d + half))),
                                       vrbf(_mm512_mul_ps(lo, vload(s + d + half))));
      vstore(v + d, nlo);
      vstore(v + d + half, nhi);
    }
    return;
  }
#endif
  float lo[256], hi[256];
  for (int64_t d = 0; d < half; ++d) {
    lo[d] = bf2f(v[d]);
    hi[d] = bf2f(v[d + half]);
  }
#pragma omp simd
  for (int64_t d = 0; d < half; ++d) {
    v[d] = f2bf(rbf(lo[d] * bf2f(c[d])) + rbf(-hi[d] * bf2f(s[d])));
    v[d + half] = f2bf(rbf(hi[d] * bf2f(c[d + half])) + rbf(lo[d] * bf2f(s[d + half])));
  }
}

}  // namespace

#include "kernels/row_ops.h"  // NOTE: after the row functions it calls (see there)

extern "C" {

// RMSNorm of `rows` rows of `dim` bfloat16 values (transformers' LlamaRMSNorm in bfloat16).
void ps_rms_norm_bf16(const uint16_t* x, const uint16_t* w, float eps, int64_t rows, int64_t dim, uint16_t* out) {
  rms_norm_rows(x, w, eps, rows, dim, out);
}

// The residual add, then the next RMSNorm: x = bf16(x + delta) in place, out = rms_norm(x).
void ps_add_rms_norm_bf16(uint16_t* x, const uint16_t* delta, const uint16_t* w, float eps, int64_t rows,
                          int64_t dim, uint16_t* out) {
  add_rms_norm_rows(x, delta, w, eps, rows, dim, out);
}

// The SiLU-gated MLP's middle: gu is [rows, 2 * inter] (gate | up); out[r, i] = bf16(bf16(silu(g)) * u).
void ps_silu_mul_bf16(const uint16_t* gu, int64_t rows, int64_t inter, uint16_t* out) {
  silu_mul_rows(gu, rows, inter, out);
}

// Rotate-half rotary embedding in place: x is [tokens, heads, hd] with rows `x_stride` elements apart (heads are
// contiguous within a row), cos/sin [tokens, hd]; x = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)).
void ps_rope_bf16(uint16_t* x, int64_t x_stride, const uint16_t* cos, const uint16_t* sin, int64_t tokens,
                  int64_t heads, int64_t hd) {
  rope_rows(x, x_stride, cos, sin, tokens, heads, hd);
}

// Greedy sampling's argmax: out[r] = the lowest index of row r's maximum (NaN never wins; a row of only -inf or
// NaN gives 0), rows of `cols` values `row_stride` elements apart; dtype 0 = float32, 1 = bfloat16. torch's argmax
// over a [64, 49,152] bfloat16 batch takes ~10 ms a step on one core, this ~0.3 ms.
int ps_argmax_rows(const void* x, int dtype, int64_t rows, int64_t cols, int64_t row_stride, int64_t* out) {
  if (dtype != 0 && dtype != 1) return 2;
#pragma omp parallel for if (rows * cols >= 4 * kParallelElems)
  for (int64_t r = 0; r < rows; ++r) {
    float best = -INFINITY;
    int64_t at = -1;
    int64_t c = 0;
    const float* xf = static_cast<const float*>(x) + r * row_stride;
    const uint16_t* xb = static_cast<const uint16_t*>(x) + r * row_stride;
#if defined(PS_OPS_AVX512)
    // per lane: its maximum and the first column where it was seen (columns only grow: ties keep the first)
    __m512 vbest = _mm512_set1_ps(-INFINITY);
    __m512i vat = _mm512_set1_epi32(-1);
    const __m512i step = _mm512_set1_epi32(16);
    __m512i col = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if (cols < (int64_t{1} << 31)) {
      for (; c + 16 <= cols; c += 16) {
        const __m512 v = dtype == 0 ? _mm512_loadu_ps(xf + c) : vload(xb + c);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, vbest, _CMP_GT_OQ);
        vbest = _mm512_mask_mov_ps(vbest, gt, v);
        vat = _mm512_mask_mov_epi32(vat, gt, col);
        col = _mm512_add_epi32(col, step);
      }
      alignas(64) float lb[16];
      alignas(64) int32_t la[16];
      _mm512_store_ps(lb, vbest);
      _mm512_store_si512(la, vat);
      for (int i = 0; i < 16; ++i) {
        if (la[i] < 0) continue;
        if (lb[i] > best || (lb[i] == best && la[i] < at)) { best = lb[i]; at = la[i]; }
      }
    }
#endif
    for (; c < cols; ++c) {
      const float v = dtype == 0 ? xf[c] : bf2f(xb[c]);
      if (v > best) { best = v; at = c; }
    }
    out[r] = at < 0 ? 0 : at;
  }
  return 0;
}

}  // extern "C"
