// The float32 / bfloat16 pools' group path (AVX-512): the group's key counts and score rows, and its online softmax
// (group_softmax: float32 P, or P rounded to bfloat16 for the bf16 and AMX P.V), shared by group_step.h and
// bf16_dot.h.
#pragma once

#include "block16.h"

namespace {

#if defined(PS_AVX512)
// The float32 / bfloat16 pools' whole item, 16-key blocks taken kGroup at a time: the per-row softmax chain (the
// maxima, exp, sums: latency-bound, ~150 cycles a row) runs once per group instead of once per block; a group's
// scores sit in kGroup vectors per row. Same arithmetic as block16 otherwise.
constexpr int kGroup = 4;
// The next group's lines are prefetched a few per V row of this group's P.V, not in one burst before it: a burst
// fills the core's line-fill buffers and stalls it until they drain, so memory and compute did not overlap
// (bf16 decode, 64 x 192, 2 threads: 20.7 -> 19.5 ms a step with 4 a row; 2 and 8 measured no better). Into L2,
// not L1: a group of one head's K and V is 32 KB in float32 (16 in bfloat16), and on top of the group being
// computed in a 48 KB L1 it evicted that group's own lines (decode, 64 x 192, 2 threads, bench/attention_cpu.py:
// float32 26.5 -> 24.6 ms a step, bfloat16 15.9 -> 15.0).
constexpr int kPrefetchPerKey = 4;
#define PS_NEXT_GROUP_HINT _MM_HINT_T1  // a macro: _mm_prefetch takes GCC's enum, clang's int

// Keys of the group's block b (its first key `base`) that each row sees (causal: keys 0..pos[r], none past `last`)
// into nk[r][b]; returns the most any row sees.
inline int64_t key_counts(const int64_t* pos, int64_t rows, int64_t base, int64_t last, int b,
                          int64_t (*nk)[kGroup]) {
  int64_t nmax = 0;
  for (int64_t r = 0; r < rows; ++r) {
    nk[r][b] = std::max<int64_t>(0, std::min<int64_t>(std::min<int64_t>(16, last + 1 - base), pos[r] + 1 - base));
    nmax = std::max(nmax, nk[r][b]);
  }
  return nmax;
}

// sbuf's row r, block b: the 16 scores sc where the row sees the key (its first nk), -inf elsewhere (and all of
// them when no row of the item sees one: nmax 0, sc unset).
inline void put_scores(float* sbuf, int64_t r, int b, int64_t nk, int64_t nmax, __m512 sc) {
  const __mmask16 valid = static_cast<__mmask16>((1u << nk) - 1u);
  _mm512_store_ps(sbuf + (r * kGroup + b) * 16,
                  nmax > 0 ? _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), sc) : _mm512_set1_ps(-INFINITY));
}

// 16 float32 -> bfloat16, round to nearest even (finite values: probabilities).
inline __m256i round_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd);
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, bias), 16));
}

// The group's online softmax, row by row over sbuf's scores: the new running max m, the correction corr of what
// was accumulated under the old one, P = exp(s - m) (0 where the row sees no key) and the sum l. kBf16: P rounded
// to bfloat16 into pb and l summing the rounded values; else P in float32 into p.
template <bool kBf16>
inline void group_softmax(const float* sbuf, const int64_t (*nk)[kGroup], int64_t rows, int nb, float* m, float* l,
                          float* corr, float* p, uint16_t* pb) {
  for (int64_t r = 0; r < rows; ++r) {
    __m512 sv[kGroup];
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    __mmask16 valid[kGroup];
    for (int b = 0; b < nb; ++b) {
      valid[b] = static_cast<__mmask16>((1u << nk[r][b]) - 1u);
      sv[b] = _mm512_load_ps(sbuf + (r * kGroup + b) * 16);
      vmax = _mm512_max_ps(vmax, sv[b]);
    }
    const float bmax = _mm512_reduce_max_ps(vmax);
    if (bmax == -INFINITY) {  // no key of this group is visible to this row
      corr[r] = 1.0f;
      for (int b = 0; b < nb; ++b) {
        if constexpr (kBf16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + (r * kGroup + b) * 16),
                                                 _mm256_setzero_si256());
        else _mm512_storeu_ps(p + (r * kGroup + b) * 16, _mm512_setzero_ps());
      }
      continue;
    }
    const float m_new = bmax > m[r] ? bmax : m[r];
    corr[r] = fast_exp(m[r] - m_new);  // m[r] = -inf on the first group: corr = 0
    const __m512 mv = _mm512_set1_ps(m_new);
    __m512 psum = _mm512_setzero_ps();
    for (int b = 0; b < nb; ++b) {
      const __m512 pv = _mm512_maskz_mov_ps(valid[b], fast_exp16(_mm512_sub_ps(sv[b], mv)));
      if constexpr (kBf16) {
        const __m256i h = round_bf16(pv);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + (r * kGroup + b) * 16), h);
        psum = _mm512_add_ps(psum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
      } else {
        _mm512_storeu_ps(p + (r * kGroup + b) * 16, pv);
        psum = _mm512_add_ps(psum, pv);
      }
    }
    l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(psum);
    m[r] = m_new;
  }
}

#endif

}  // namespace
