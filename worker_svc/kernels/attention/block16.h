// The 16-key block path's pieces (AVX-512): a block's 16 scores a row in one vector, and block16, the path for the
// widened 8-bit caches (the float pools take group_step.h's, 4 blocks at a time).
#pragma once

#include "elements.h"

namespace {

#if defined(PS_AVX512)
// The 16-key block path (block_size 16, head_dim 64 or 128, float K/V rows: a float pool in place, others widened):
// each row's 16 scores come out in ONE vector (16 per-key partial-sum vectors, then a transpose-add tree: 45 ops
// instead of 16 horizontal reductions), the online softmax runs on that vector (one max, one exp, one sum), and
// each V row is loaded once for up to 16 / (D / 16) rows' accumulators. Measured 2-3x the general loop's speed.

// exp(x) for x <= 0, 16 lanes: fast_exp's polynomial, 2^n applied with scalef.
inline __m512 fast_exp16(__m512 x) { return exp_poly16(_mm512_max_ps(x, _mm512_set1_ps(-87.0f))); }

// Lanes 4i..4i+3 of the result: per 128-bit chunk c, the sums of a, b, c, d's lanes in chunk c.
inline __m512 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  return _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
}

// out lane k = the sum of v[k]'s 16 lanes. NOTE: every lane of the result adds up one input vector only, so a NaN
// (a garbage slot) stays in its own key's lane, which the caller masks.
inline __m512 transpose_sum16(const __m512 v[16]) {
  const __m512 y0 = sum4(v[0], v[1], v[2], v[3]), y1 = sum4(v[4], v[5], v[6], v[7]);
  const __m512 y2 = sum4(v[8], v[9], v[10], v[11]), y3 = sum4(v[12], v[13], v[14], v[15]);
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xDD));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(y2, y3, 0x88), _mm512_shuffle_f32x4(y2, y3, 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

// The scores q . key_k of one block's keys k < n <= 16 in one vector (lanes from n on: -inf). q: D floats
// (pre-scaled); key rows `stride` elements apart.
template <int D, typename E>
inline __m512 scores16(const float* q, const E* kb, int64_t stride, int64_t n) {
  constexpr int NV = D / 16;
  __m512 part[16];
  __m512 qv[NV];
#pragma GCC unroll 8
  for (int i = 0; i < NV; ++i) qv[i] = _mm512_loadu_ps(q + 16 * i);
#pragma GCC unroll 16
  for (int k = 0; k < 16; ++k) {
    if (k < n) {
      const E* kr = kb + k * stride;
      __m512 a = _mm512_mul_ps(qv[0], load16(kr));
#pragma GCC unroll 8
      for (int i = 1; i < NV; ++i) a = _mm512_fmadd_ps(qv[i], load16(kr + 16 * i), a);
      part[k] = a;
    } else {
      part[k] = _mm512_setzero_ps();
    }
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
  return _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), transpose_sum16(part));
}

// The transpose-add tree of scores16, a quarter at a time: after quarter kc (keys 4kc..4kc+3 of each row's partial
// sums in part[r]), y0/s01 hold the partial folds and after the last out[r] the row's 16 scores.
template <int RS>
inline void fold_keys(int kc, const __m512 (*part)[4], __m512* y0, __m512* s01, __m512* out) {
#pragma GCC unroll 4
  for (int r = 0; r < RS; ++r) {
    const __m512 y = sum4(part[r][0], part[r][1], part[r][2], part[r][3]);
    if (kc == 0 || kc == 2) {
      y0[r] = y;
    } else {
      const __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(y0[r], y, 0x88), _mm512_shuffle_f32x4(y0[r], y, 0xDD));
      if (kc == 1) s01[r] = s;
      else out[r] = _mm512_add_ps(_mm512_shuffle_f32x4(s01[r], s, 0x88), _mm512_shuffle_f32x4(s01[r], s, 0xDD));
    }
  }
}

// The key loop of scores_rows16 and dot_scores_rows16: for key k = 4 kc + j of the block, the statement block given
// last where k < n (it reads k and sets part[r][j] for r < RS: row r's partial sums for key k), zeros from n on;
// each quarter of keys folded into out by fold_keys. NOTE: a macro, not a template over the scoring:
// dot_scores_rows16's bf16 intrinsics need its target attribute in every function whose body holds them, which a
// template shared with the float path cannot carry (a lambda loses it). The generated code is the two hand-written
// loops' (the same disassembly, every -march).
#define PS_ROWS16_KEYS(RS, n, out, ...)                                                                        \
  __m512 y0[RS], s01[RS];                                                                                      \
  _Pragma("GCC unroll 4") for (int kc = 0; kc < 4; ++kc) {                                                     \
    __m512 part[RS][4];                                                                                        \
    _Pragma("GCC unroll 4") for (int j = 0; j < 4; ++j) {                                                      \
      const int k = kc * 4 + j;                                                                                \
      if (k < (n)) __VA_ARGS__                                                                                 \
      else {                                                                                                   \
        _Pragma("GCC unroll 4") for (int r = 0; r < RS; ++r) part[r][j] = _mm512_setzero_ps();                 \
      }                                                                                                        \
    }                                                                                                          \
    fold_keys<RS>(kc, part, y0, s01, out);                                                                     \
  }

// scores16 for RS rows at once: each key row is loaded (bf16: widened) once for all RS rows, where scores16 per
// row reloads it (bf16 decode, 64 x 192, 1 thread: 40 -> 36 ms a step of 30 layers; prefill 2 x 256: 49 -> 44).
// Keys k < n (the block's furthest-seeing row's count) are scored for every row; the caller masks
// each row's own causal tail. Per (row, key) the same chain of FMAs and the same transpose-add tree as scores16,
// so a valid lane has scores16's bits. out[r]: row r's 16 scores (lanes from n on: 0 sums, masked by the caller).
template <int D, int RS, typename E>
inline void scores_rows16(const float* q, const E* kb, int64_t stride, int64_t n, __m512 out[RS]) {
  constexpr int NV = D / 16;
  PS_ROWS16_KEYS(RS, n, out, {
    const E* kr = kb + k * stride;
    __m512 kv[NV];
    _Pragma("GCC unroll 8") for (int i = 0; i < NV; ++i) kv[i] = load16(kr + 16 * i);
    _Pragma("GCC unroll 4") for (int r = 0; r < RS; ++r) {
      const float* qr = q + r * D;
      __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qr), kv[0]);
      _Pragma("GCC unroll 8") for (int i = 1; i < NV; ++i) a = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * i), kv[i], a);
      part[r][j] = a;
    }
  });
}

// KERNEL<D, RS>(...) for the run-time row count rs (1..4) as RS, which the row-block kernels (scores_rows16,
// dot_scores_rows16) take as a template argument so that their row loops unroll. NOTE: a macro, not a template
// over a lambda: the lambda would lose bf16_dot.h's target attribute (dot_scores_rows16 then stays a call), and
// its closure changes the code GCC makes for the float path too (a larger stack frame in attend_item).
#define PS_WITH_ROW_COUNT(rs, KERNEL, D, ...)                                                          \
  do {                                                                                                 \
    if ((rs) == 4) KERNEL<D, 4>(__VA_ARGS__);                                                          \
    else if ((rs) == 3) KERNEL<D, 3>(__VA_ARGS__);                                                     \
    else if ((rs) == 2) KERNEL<D, 2>(__VA_ARGS__);                                                     \
    else KERNEL<D, 1>(__VA_ARGS__);                                                                    \
  } while (0)

// One block of n <= 16 keys for `rows` rows: scores, the online-softmax update of m/l, and acc = acc * corr + P.V.
// q: [rows, D] (pre-scaled), acc: [rows, D], nr[r]: keys row r sees in this block (causal), kb/vb: key/value rows
// `stride` floats apart. p: scratch [rows, 16].
template <int D, typename E>
inline void block16(const float* q, float* acc, float* m, float* l, const int64_t* nr, int64_t rows, const E* kb,
                    const E* vb, int64_t stride, float* p) {
  constexpr int NV = D / 16;
  constexpr int RG = 16 / NV;  // rows per accumulation group: RG * NV accumulators
  float corr[kMaxRows];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t nk = nr[r];
    if (nk <= 0) { corr[r] = 1.0f; _mm512_storeu_ps(p + 16 * r, _mm512_setzero_ps()); continue; }
    const __mmask16 valid = static_cast<__mmask16>((1u << nk) - 1u);
    const __m512 sc = scores16<D>(q + r * D, kb, stride, nk);
    const float bmax = _mm512_reduce_max_ps(sc);
    const float m_new = bmax > m[r] ? bmax : m[r];
    corr[r] = fast_exp(m[r] - m_new);  // m[r] = -inf on the first block: corr = 0
    const __m512 pv = _mm512_maskz_mov_ps(valid, fast_exp16(_mm512_sub_ps(sc, _mm512_set1_ps(m_new))));
    l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(pv);
    m[r] = m_new;
    _mm512_storeu_ps(p + 16 * r, pv);
  }
  for (int64_t r0 = 0; r0 < rows; r0 += RG) {
    const int64_t g = std::min<int64_t>(RG, rows - r0);
    int64_t nmax = 0;
    for (int64_t r = r0; r < r0 + g; ++r) nmax = std::max(nmax, nr[r]);
    __m512 a[RG][NV];
    for (int64_t r = 0; r < g; ++r) {
      const __m512 c = _mm512_set1_ps(corr[r0 + r]);
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i) a[r][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r0 + r) * D + 16 * i), c);
    }
    for (int64_t k = 0; k < nmax; ++k) {  // p is 0 past a row's own nr: rows of a group may see fewer keys
      const E* vr = vb + k * stride;
      __m512 v[NV];
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i) v[i] = load16(vr + 16 * i);
      if (g == RG) {
#pragma GCC unroll 16
        for (int r = 0; r < RG; ++r) {
          const __m512 pk = _mm512_set1_ps(p[16 * (r0 + r) + k]);
#pragma GCC unroll 8
          for (int i = 0; i < NV; ++i) a[r][i] = _mm512_fmadd_ps(pk, v[i], a[r][i]);
        }
      } else {
        for (int64_t r = 0; r < g; ++r) {
          const __m512 pk = _mm512_set1_ps(p[16 * (r0 + r) + k]);
#pragma GCC unroll 8
          for (int i = 0; i < NV; ++i) a[r][i] = _mm512_fmadd_ps(pk, v[i], a[r][i]);
        }
      }
    }
    for (int64_t r = 0; r < g; ++r) {
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + (r0 + r) * D + 16 * i, a[r][i]);
    }
  }
}
#endif

}  // namespace
