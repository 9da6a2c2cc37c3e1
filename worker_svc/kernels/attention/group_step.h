// The float32 / bfloat16 pools' 16-key blocks, 4 a group (AVX-512): group_step (float32 queries, scores on FMAs or
// AMX tiles) and attend_grouped, an item's walk over its blocks with the next group's lines prefetched, handing a
// bfloat16 model's groups to bf16_dot.h.
#pragma once

#include "bf16_dot.h"

namespace {

#if defined(PS_AVX512)

// One group of nb <= kGroup blocks for `rows` rows: scores (scores_rows16, 4 rows a key row read), the online-softmax
// update of m/l, acc = acc * corr + P.V. kb[b]/vb[b]: block b's key/value rows, `stride` elements apart. pf[0..npf):
// cache lines to prefetch meanwhile (the next group's).
template <int D, typename E>
inline void group_step(const float* q, float* acc, float* m, float* l, const int64_t* pos, int64_t rows,
                       const E* const* kb, const E* const* vb, int64_t stride, int nb, int64_t j0, int64_t last,
                       float* p, const char* const* pf, int npf, const uint16_t* qb, float qscale) {
  constexpr int NV = D / 16;
  constexpr int RG = 16 / NV;
  float corr[kMaxRows];
  int64_t nk[kMaxRows][kGroup];
  alignas(64) float sbuf[kMaxRows * kGroup * 16];  // row r, block b: 16 scores (-inf past the row's keys)
  for (int b = 0; b < nb; ++b) {
    const int64_t nmax = key_counts(pos, rows, (j0 + b) * 16, last, b, nk);
#if defined(PS_AMX_SCORES)
    if constexpr (std::is_same_v<E, uint16_t>) {
      if (qb != nullptr) {  // AMX: qb holds the rows' unscaled bfloat16 queries, padded to whole row tiles
        amx_block_scores<D>(qb, rows, kb[b], stride, nmax, nk, b, qscale, sbuf);
        continue;
      }
    }
#endif
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const int64_t rs = std::min<int64_t>(4, rows - r0);
      __m512 sc[4];
      if (nmax > 0) {
        PS_WITH_ROW_COUNT(rs, scores_rows16, D, q + r0 * D, kb[b], stride, nmax, sc);
      }
      for (int64_t i = 0; i < rs; ++i) put_scores(sbuf, r0 + i, b, nk[r0 + i][b], nmax, sc[i]);
    }
  }
  group_softmax<false>(sbuf, nk, rows, nb, m, l, corr, p, nullptr);
  int ip = 0;  // pf[ip..npf): the next group's lines not yet prefetched
  for (int64_t r0 = 0; r0 < rows; r0 += RG) {
    const int64_t g = std::min<int64_t>(RG, rows - r0);
    __m512 a[RG][NV];
    for (int64_t r = 0; r < g; ++r) {
      const __m512 c = _mm512_set1_ps(corr[r0 + r]);
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i) a[r][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r0 + r) * D + 16 * i), c);
    }
    for (int b = 0; b < nb; ++b) {
      int64_t nmax = 0;
      for (int64_t r = r0; r < r0 + g; ++r) nmax = std::max(nmax, nk[r][b]);
      for (int64_t k = 0; k < nmax; ++k) {  // p is 0 past a row's own keys
        for (int t = 0; t < kPrefetchPerKey && ip < npf; ++t) _mm_prefetch(pf[ip++], PS_NEXT_GROUP_HINT);
        const E* vr = vb[b] + k * stride;
        __m512 v[NV];
#pragma GCC unroll 8
        for (int i = 0; i < NV; ++i) v[i] = load16(vr + 16 * i);
        for (int64_t r = 0; r < g; ++r) {
          const __m512 pk = _mm512_set1_ps(p[((r0 + r) * kGroup + b) * 16 + k]);
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
  while (ip < npf) _mm_prefetch(pf[ip++], PS_NEXT_GROUP_HINT);
}

template <int D, typename E>
void attend_grouped(const float* q, float* acc, float* m, float* l,
                    const int64_t* pos, int64_t rows, const E* K, const E* V, const int32_t* table,
                    int64_t num_kv_blocks, int64_t last, int64_t tok_stride, int64_t head_off,
                    const NextWalk& next, const uint16_t* qb, float qscale, bool amx_qk, bool dot) {
  thread_local std::vector<float> pbuf;
  pbuf.resize(kMaxRows * 16 * kGroup);
  float* const p = pbuf.data();
  for (int64_t j0 = 0; j0 < num_kv_blocks; j0 += kGroup) {
    const int nb = static_cast<int>(std::min<int64_t>(kGroup, num_kv_blocks - j0));
    const E* kb[kGroup];
    const E* vb[kGroup];
    for (int b = 0; b < nb; ++b) {
      const int64_t off = static_cast<int64_t>(table[j0 + b]) * 16 * tok_stride + head_off;
      kb[b] = K + off;
      vb[b] = V + off;
    }
    const char* pf[kGroup * 16 * 2 * (D * sizeof(E) / 64 + 1)];
    int npf = 0;
    // The next group's rows of this head (scattered blocks), or after the last group the next walk's first.
    const int32_t* pf_table = table;
    int64_t pf_j0 = j0 + kGroup, pf_off = head_off, pf_last = last, pf_blocks = num_kv_blocks;
    if (pf_j0 >= num_kv_blocks && next.table != nullptr) {
      pf_table = next.table;
      pf_j0 = 0;
      pf_off = next.head_off;
      pf_last = next.last;
      pf_blocks = next.num_kv_blocks;
    }
    const int64_t next_end = std::min<int64_t>(pf_blocks, pf_j0 + kGroup);
    for (int64_t j = pf_j0; j < next_end; ++j) {
      const int64_t off = static_cast<int64_t>(pf_table[j]) * 16 * tok_stride + pf_off;
      const int64_t n_next = std::min<int64_t>(16, pf_last + 1 - j * 16);
      for (int64_t k = 0; k < n_next; ++k) {
        const char* kr = reinterpret_cast<const char*>(K + off + k * tok_stride);
        const char* vr = reinterpret_cast<const char*>(V + off + k * tok_stride);
        for (int64_t c = 0; c < D * static_cast<int64_t>(sizeof(E)); c += 64) {
          pf[npf++] = kr + c;
          pf[npf++] = vr + c;
        }
      }
    }
#if defined(PS_BF16_DOT)
    if constexpr (std::is_same_v<E, uint16_t>) {
      if (dot) {
        group_step_bf16<D>(qb, amx_qk, qscale, acc, m, l, pos, rows, kb, vb, tok_stride, nb, j0, last, pf, npf);
        continue;
      }
    }
#endif
    group_step<D>(q, acc, m, l, pos, rows, kb, vb, tok_stride, nb, j0, last, p, pf, npf, amx_qk ? qb : nullptr,
                  qscale);
  }
}
#endif

}  // namespace
