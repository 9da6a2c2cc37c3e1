// The bfloat16 dot-product path (AVX512-BF16, compiled by target attribute into every AVX-512 build on x86-64 and
// chosen at run time): a bfloat16 model's queries over a bfloat16 pool, Q.K and P.V as bf16 dot products, or a
// prefill tile's on AMX tiles (amx.h).
#pragma once

#include "amx.h"

namespace {

#if defined(PS_AMX_SCORES)
// --- bfloat16 queries over a bfloat16 pool (a bfloat16 model's steps), on CPUs with AVX512-BF16 ---
// Q.K and P.V as bfloat16 dot products (vdpbf16ps: two exact bf16 products summed into a float32 lane). Where the
// float path widens a key row's 64 dims (2 ops a 16) and runs 4 FMAs a query row, this loads 2 vectors and runs 2
// dot products a row; P.V takes two keys a product. P is rounded to bfloat16 for P.V (as flash attention does on
// GPUs) and the row sums l add up the rounded p, so the weights applied are exactly the ones normalised. Every
// build compiles these by target attribute (the same code, the same bits); bf16_dot_available() says at run time
// whether this CPU has the instructions. Only a caller that handed bfloat16 queries (and takes bfloat16 out)
// gets this path: a float32 model over a bfloat16 cache keeps the float path's precision.
#define PS_BF16_DOT 1
#define PS_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

extern "C" int ps_cpu_path_cap();  // cpu_path.cpp: 3 and up let a CPU's AVX512-BF16 be used

bool bf16_dot_available() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5)) != 0;  // CPUID.(7,1):EAX[5] AVX512_BF16
  }();
  return ok && ps_cpu_path_cap() >= 3;
}

PS_BF16_TARGET inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// scores_rows16 on bf16 dot products: out[r] lane k = q_r . key_k (unscaled) for keys k < n; qb: RS rows of D
// bfloat16, D apart. Per (row, key) one chain of D / 32 dot products, then scores_rows16's transpose-add tree.
template <int D, int RS>
PS_BF16_TARGET inline void dot_scores_rows16(const uint16_t* qb, const uint16_t* kb, int64_t stride, int64_t n,
                                             __m512 out[RS]) {
  constexpr int NC = D / 32;
  __m512bh qv[RS][NC];
#pragma GCC unroll 4
  for (int r = 0; r < RS; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) qv[r][c] = as_bh(_mm512_loadu_si512(qb + r * D + 32 * c));
  PS_ROWS16_KEYS(RS, n, out, {
    const uint16_t* kr = kb + k * stride;
    __m512bh kv[NC];
    _Pragma("GCC unroll 4") for (int c = 0; c < NC; ++c) kv[c] = as_bh(_mm512_loadu_si512(kr + 32 * c));
    _Pragma("GCC unroll 4") for (int r = 0; r < RS; ++r) {
      __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[r][0], kv[0]);
      _Pragma("GCC unroll 4") for (int c = 1; c < NC; ++c) a = _mm512_dpbf16_ps(a, qv[r][c], kv[c]);
      part[r][j] = a;
    }
  });
}

// group_step for bfloat16 queries (qb: the item's rows, D apart, padded to whole row tiles): scores on AMX tiles
// (amx_qk: a prefill tile) or bf16 dot products, scaled by qscale; the online softmax as group_step's with p
// rounded to bf16; P.V two keys a dot product. The accumulators of P.V hold a 32-dim chunk as the two vectors
// vpunpck{l,h}wd make of two key rows (dims 0-3, 8-11, 16-19, 24-27 and 4-7, 12-15, ...): acc is permuted into
// that order at the group's start and back at its end.
template <int D>
PS_BF16_TARGET void group_step_bf16(const uint16_t* qb, bool amx_qk, float qscale, float* acc, float* m, float* l,
                                    const int64_t* pos, int64_t rows, const uint16_t* const* kb,
                                    const uint16_t* const* vb, int64_t stride, int nb, int64_t j0, int64_t last,
                                    const char* const* pf, int npf) {
  constexpr int NC = D / 32;
  constexpr int RG = 8 / NC;  // rows per P.V group: RG * 2 * NC = 16 accumulators
  float corr[kMaxRows];
  int64_t nk[kMaxRows][kGroup];
  alignas(64) float sbuf[kMaxRows * kGroup * 16];  // row r, block b: 16 scores (-inf past the row's keys)
  alignas(64) uint16_t pb[kMaxRows * kGroup * 16];  // row r, block b: 16 probabilities in bfloat16
  const __m512 sv = _mm512_set1_ps(qscale);
  for (int b = 0; b < nb; ++b) {
    const int64_t nmax = key_counts(pos, rows, (j0 + b) * 16, last, b, nk);
    if (amx_qk) {
      amx_block_scores<D>(qb, rows, kb[b], stride, nmax, nk, b, qscale, sbuf);
      continue;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const int64_t rs = std::min<int64_t>(4, rows - r0);
      __m512 sc[4];
      if (nmax > 0) {
        PS_WITH_ROW_COUNT(rs, dot_scores_rows16, D, qb + r0 * D, kb[b], stride, nmax, sc);
      }
      for (int64_t i = 0; i < rs; ++i) put_scores(sbuf, r0 + i, b, nk[r0 + i][b], nmax, _mm512_mul_ps(sc[i], sv));
    }
  }
  group_softmax<true>(sbuf, nk, rows, nb, m, l, corr, nullptr, pb);
  if (amx_qk) {  // a prefill tile: P.V on tiles too
    for (int i = 0; i < npf; ++i) _mm_prefetch(pf[i], PS_NEXT_GROUP_HINT);  // the tile products hide these
    amx_pv<D>(pb, rows, nb, vb, stride, j0, last, corr, acc);
    return;
  }
  const __m512i lo_dims = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i hi_dims = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const __m512i back0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i back1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  int ip = 0;  // pf[ip..npf): the next group's lines not yet prefetched
  for (int64_t r0 = 0; r0 < rows; r0 += RG) {
    const int64_t g = std::min<int64_t>(RG, rows - r0);
    __m512 a[RG][2 * NC];
#pragma GCC unroll 8
    for (int r = 0; r < RG; ++r) {
      if (r >= g) break;
      const __m512 c = _mm512_set1_ps(corr[r0 + r]);
      const float* src = acc + (r0 + r) * D;
#pragma GCC unroll 4
      for (int ch = 0; ch < NC; ++ch) {
        const __m512 x0 = _mm512_loadu_ps(src + 32 * ch), x1 = _mm512_loadu_ps(src + 32 * ch + 16);
        a[r][2 * ch] = _mm512_mul_ps(_mm512_permutex2var_ps(x0, lo_dims, x1), c);
        a[r][2 * ch + 1] = _mm512_mul_ps(_mm512_permutex2var_ps(x0, hi_dims, x1), c);
      }
    }
    for (int b = 0; b < nb; ++b) {
      int64_t nmax = 0;
      for (int64_t r = r0; r < r0 + g; ++r) nmax = std::max(nmax, nk[r][b]);
      for (int64_t k = 0; k < nmax; k += 2) {  // p is 0 past a row's own keys; a key past nmax is never read
        for (int t = 0; t < 2 * kPrefetchPerKey && ip < npf; ++t) _mm_prefetch(pf[ip++], PS_NEXT_GROUP_HINT);
        const uint16_t* v0 = vb[b] + k * stride;
        const bool pair = k + 1 < nmax;
        __m512i lo[NC], hi[NC];
#pragma GCC unroll 4
        for (int ch = 0; ch < NC; ++ch) {
          const __m512i x = _mm512_loadu_si512(v0 + 32 * ch);
          const __m512i y = pair ? _mm512_loadu_si512(v0 + stride + 32 * ch) : _mm512_setzero_si512();
          lo[ch] = _mm512_unpacklo_epi16(x, y);
          hi[ch] = _mm512_unpackhi_epi16(x, y);
        }
#pragma GCC unroll 8
        for (int r = 0; r < RG; ++r) {
          if (r >= g) break;
          uint32_t two;  // p[k] in the low half, p[k + 1] in the high: lane pairs (key k, key k + 1)
          std::memcpy(&two, pb + ((r0 + r) * kGroup + b) * 16 + k, 4);
          const __m512bh pp = as_bh(_mm512_set1_epi32(static_cast<int>(two)));
#pragma GCC unroll 4
          for (int ch = 0; ch < NC; ++ch) {
            a[r][2 * ch] = _mm512_dpbf16_ps(a[r][2 * ch], as_bh(lo[ch]), pp);
            a[r][2 * ch + 1] = _mm512_dpbf16_ps(a[r][2 * ch + 1], as_bh(hi[ch]), pp);
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < RG; ++r) {
      if (r >= g) break;
      float* dst = acc + (r0 + r) * D;
#pragma GCC unroll 4
      for (int ch = 0; ch < NC; ++ch) {
        _mm512_storeu_ps(dst + 32 * ch, _mm512_permutex2var_ps(a[r][2 * ch], back0, a[r][2 * ch + 1]));
        _mm512_storeu_ps(dst + 32 * ch + 16, _mm512_permutex2var_ps(a[r][2 * ch], back1, a[r][2 * ch + 1]));
      }
    }
  }
  while (ip < npf) _mm_prefetch(pf[ip++], PS_NEXT_GROUP_HINT);
}
#endif

}  // namespace
