// The 8-bit caches' Q.K paths: int8 in int8 (VNNI: AVX-512 or AVX-VNNI, one key at a time or 16 transposed), and
// dequantise-then-float on 16 transposed int8 keys (AVX-512). fp8 codes are widened (elements.h), never scored here.
#pragma once

#include "common.h"

// The int8 Q.K path: vpdpbusd multiplies u8 by s8, so a query row goes in as u = q + 128 (1..255) and
// u . k = q . k + 128 * sum(k): the bias is subtracted lane-wise (one more vpdpbusd per key, shared by all rows).
#if defined(__AVX512VNNI__) && defined(PS_AVX512)
#define PS_INT8_QK 512
#elif defined(__AVXVNNI__) && defined(__AVX2__)
#define PS_INT8_QK 256
#else
#define PS_INT8_QK 0
#endif

namespace {

#if PS_INT8_QK == 512
// The int8 Q.K path's vectors of one width behind one interface (as simd.h's float32 ones), so that int8_scores is
// written once: each member is the one intrinsic (or the one reduction) the width's hand-written copy had.
struct VnniWidth {
  using V = __m512i;
  static constexpr int kBytes = 64;
  static V zero() { return _mm512_setzero_si512(); }
  static V set1_i8(char x) { return _mm512_set1_epi8(x); }
  static V load(const void* p) { return _mm512_loadu_si512(p); }
  static V sub(V a, V b) { return _mm512_sub_epi32(a, b); }
  static V dpbusd(V acc, V u, V s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static int32_t sum(V v) { return _mm512_reduce_add_epi32(v); }
};
#elif PS_INT8_QK == 256
struct VnniWidth {
  using V = __m256i;
  static constexpr int kBytes = 32;
  static V zero() { return _mm256_setzero_si256(); }
  static V set1_i8(char x) { return _mm256_set1_epi8(x); }
  static V load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static V sub(V a, V b) { return _mm256_sub_epi32(a, b); }
  static V dpbusd(V acc, V u, V s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
  static int32_t sum(V v) {
    __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4e));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0xb1));
    return _mm_cvtsi128_si32(x);
  }
};
#endif

// Quantises one query row: u[d] = round_half_even(q[d] / qs) + 128 with qs = absmax / 127; returns qs.
inline float quantize_query(const float* q, int64_t D, uint8_t* u) {
  float amax = 0.0f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(q[d]));
  const float qs = std::max(amax / 127.0f, 1e-30f);
  const float inv = 1.0f / qs;
  for (int64_t d = 0; d < D; ++d) {
    const float c = std::min(127.0f, std::max(-127.0f, std::nearbyint(q[d] * inv)));
    u[d] = static_cast<uint8_t>(static_cast<int32_t>(c) + 128);
  }
  return qs;
}

// sc[r * ld + k] = qs[r] * ks[k] * (q_r . key_k) for keys k < nr[r] of row r (u: the rows' biased codes).
inline void int8_scores(const uint8_t* u, const float* qs, int64_t rows, const int64_t* nr, const int8_t* keys,
                        int64_t stride, const float* ks, int64_t ks_stride, int64_t n, int64_t D, float* sc,
                        int64_t ld) {
  for (int64_t k = 0; k < n; ++k) {
    const int8_t* key = keys + k * stride;
    int64_t d = 0;
    int32_t tail_sum = 0;
#if PS_INT8_QK
    using W = VnniWidth;
    W::V kv[kMaxHeadDim / W::kBytes];
    W::V bias = W::zero();
    const W::V b128 = W::set1_i8(static_cast<char>(128));
    const int64_t nv = D / W::kBytes;
    for (int64_t i = 0; i < nv; ++i) {
      kv[i] = W::load(key + W::kBytes * i);
      bias = W::dpbusd(bias, b128, kv[i]);
    }
    d = nv * W::kBytes;
#endif
    const int64_t d_vec = d;
    for (; d < D; ++d) tail_sum += key[d];
    const float kscale = ks[k * ks_stride];
    for (int64_t r = 0; r < rows; ++r) {
      if (k >= nr[r]) continue;
      const uint8_t* ur = u + r * D;
      int32_t dot = 0;
#if PS_INT8_QK
      W::V acc = W::sub(W::zero(), bias);
      for (int64_t i = 0; i < nv; ++i) acc = W::dpbusd(acc, W::load(ur + W::kBytes * i), kv[i]);
      dot = W::sum(acc);
#endif
      for (int64_t e = d_vec; e < D; ++e) dot += static_cast<int32_t>(ur[e]) * key[e];
      dot -= 128 * tail_sum;
      sc[r * ld + k] = qs[r] * kscale * static_cast<float>(dot);
    }
  }
}

#if defined(PS_AVX512)
// A block's int8 keys transposed 16 at a time, so that one vector holds the same dims of 16 keys and a score
// row needs no horizontal sums (the reductions dominated the per-key dot products).
// Keys 0..n-1 (n <= 16) of one 64-byte chunk, `stride` bytes apart: col[c] lane i = key i's bytes 4c..4c+3
// (zero for i >= n: rows past n are never loaded).
inline void load_transposed(const int8_t* keys, int64_t stride, int64_t n, __m512i col[16]) {
  __m512i r[16], t[16], u[4][4];
  for (int i = 0; i < 16; ++i) r[i] = i < n ? _mm512_loadu_si512(keys + i * stride) : _mm512_setzero_si512();
  for (int i = 0; i < 16; i += 2) {  // 128-bit lane L: [a(4L) b(4L) a(4L+1) b(4L+1)], [a(4L+2) b(4L+2) ...]
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // u[g][j] lane L = dword column 4L+j of rows 4g..4g+3
    const __m512i* tg = t + 4 * g;
    u[g][0] = _mm512_unpacklo_epi64(tg[0], tg[2]);
    u[g][1] = _mm512_unpackhi_epi64(tg[0], tg[2]);
    u[g][2] = _mm512_unpacklo_epi64(tg[1], tg[3]);
    u[g][3] = _mm512_unpackhi_epi64(tg[1], tg[3]);
  }
  for (int j = 0; j < 4; ++j) {  // a 4x4 transpose of 128-bit lanes across the groups
    const __m512i s0 = _mm512_shuffle_i32x4(u[0][j], u[1][j], 0x44), s1 = _mm512_shuffle_i32x4(u[0][j], u[1][j], 0xEE);
    const __m512i s2 = _mm512_shuffle_i32x4(u[2][j], u[3][j], 0x44), s3 = _mm512_shuffle_i32x4(u[2][j], u[3][j], 0xEE);
    col[j] = _mm512_shuffle_i32x4(s0, s2, 0x88);
    col[4 + j] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
    col[8 + j] = _mm512_shuffle_i32x4(s1, s3, 0x88);
    col[12 + j] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
  }
}

// The scales of keys 0..cnt-1 (zero past them) as one vector.
inline __m512 key_scales(const float* ks, int64_t ks_stride, int64_t cnt) {
  alignas(64) float v[16];
  for (int i = 0; i < 16; ++i) v[i] = i < cnt ? ks[i * ks_stride] : 0.0f;
  return _mm512_load_ps(v);
}

// Dequantise-then-float Q.K for an int8 block, D % 64 == 0: sc[r * ld + k] = (q_r . codes_k) * ks[k] for k < n.
// kt: scratch of 16 * D floats (the group's keys as floats, dim-major).
inline void dequant_scores_t(const float* q, int64_t rows, const int64_t* nr, const int8_t* keys, int64_t stride,
                             const float* ks, int64_t ks_stride, int64_t n, int64_t D, float* kt, float* sc,
                             int64_t ld) {
  __m512i col[16];
  for (int64_t k0 = 0; k0 < n; k0 += 16) {
    const int64_t cnt = std::min<int64_t>(16, n - k0);
    for (int64_t c = 0; c < D / 64; ++c) {
      load_transposed(keys + k0 * stride + 64 * c, stride, cnt, col);
      for (int j = 0; j < 16; ++j) {  // the 4 bytes of each dword: 4 consecutive dims, sign-extended
        float* dst = kt + (64 * c + 4 * j) * 16;
        _mm512_store_ps(dst, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(col[j], 24), 24)));
        _mm512_store_ps(dst + 16, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(col[j], 16), 24)));
        _mm512_store_ps(dst + 32, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(col[j], 8), 24)));
        _mm512_store_ps(dst + 48, _mm512_cvtepi32_ps(_mm512_srai_epi32(col[j], 24)));
      }
    }
    const __m512 kscale = key_scales(ks + k0 * ks_stride, ks_stride, cnt);
    const __mmask16 keep = static_cast<__mmask16>((1u << cnt) - 1);
    for (int64_t r = 0; r < rows; ++r) {
      if (nr[r] <= k0) continue;
      const float* qr = q + r * D;
      __m512 a0 = _mm512_setzero_ps(), a1 = a0;
      for (int64_t d = 0; d < D; d += 2) {
        a0 = _mm512_fmadd_ps(_mm512_set1_ps(qr[d]), _mm512_load_ps(kt + d * 16), a0);
        a1 = _mm512_fmadd_ps(_mm512_set1_ps(qr[d + 1]), _mm512_load_ps(kt + (d + 1) * 16), a1);
      }
      _mm512_mask_storeu_ps(sc + r * ld + k0, keep, _mm512_mul_ps(_mm512_add_ps(a0, a1), kscale));
    }
  }
}
#endif

#if PS_INT8_QK == 512
// int8_scores for D % 64 == 0 on 16 transposed keys at a time: one vpdpbusd per 4 dims gives 16 keys' partial
// dots, the query's 4 codes broadcast.
inline void int8_scores_t(const uint8_t* u, const float* qs, int64_t rows, const int64_t* nr, const int8_t* keys,
                          int64_t stride, const float* ks, int64_t ks_stride, int64_t n, int64_t D, float* sc,
                          int64_t ld) {
  __m512i col[kMaxHeadDim / 4];
  const __m512i b128 = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t k0 = 0; k0 < n; k0 += 16) {
    const int64_t cnt = std::min<int64_t>(16, n - k0);
    for (int64_t c = 0; c < D / 64; ++c) load_transposed(keys + k0 * stride + 64 * c, stride, cnt, col + 16 * c);
    __m512i bias = _mm512_setzero_si512();  // 128 * sum of each key's codes
    for (int64_t i = 0; i < D / 4; ++i) bias = _mm512_dpbusd_epi32(bias, b128, col[i]);
    const __m512 kscale = key_scales(ks + k0 * ks_stride, ks_stride, cnt);
    const __mmask16 keep = static_cast<__mmask16>((1u << cnt) - 1);
    for (int64_t r = 0; r < rows; ++r) {
      if (nr[r] <= k0) continue;
      const uint8_t* ur = u + r * D;
      __m512i acc = _mm512_sub_epi32(_mm512_setzero_si512(), bias);
      for (int64_t i = 0; i < D / 4; ++i) {
        int32_t w;
        std::memcpy(&w, ur + 4 * i, 4);
        acc = _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(w), col[i]);
      }
      const __m512 s = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc), kscale), _mm512_set1_ps(qs[r]));
      _mm512_mask_storeu_ps(sc + r * ld + k0, keep, s);
    }
  }
}
#endif

}  // namespace
