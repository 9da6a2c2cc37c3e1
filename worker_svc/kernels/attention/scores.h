// The general path's Q.K and P.V for float K/V rows (any block size and head dim): scores() and accumulate(), on
// AVX-512 or AVX2 + FMA where the head dim fits the vectors (one template over the width: F32x16 / F32x8, the same
// instructions as a copy per width), else in scalar order.
#pragma once

#include "common.h"

namespace {

// scores() on vectors of V where D is a whole number of them: keys k..n-1 of the row (k ends at n), else none.
template <class V>
inline void scores_vec(const float* q, const float* keys, int64_t stride, int64_t n, int64_t D, float* out,
                       int64_t& k) {
  constexpr int W = V::kLanes;
  if (D % W != 0) return;
  for (; k + 4 <= n; k += 4) {  // 4 keys share each load of q
    const float *k0 = keys + k * stride, *k1 = k0 + stride, *k2 = k1 + stride, *k3 = k2 + stride;
    typename V::V a0 = V::zero(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < D; d += W) {
      const typename V::V qv = V::load(q + d);
      a0 = V::fmadd(qv, V::load(k0 + d), a0);
      a1 = V::fmadd(qv, V::load(k1 + d), a1);
      a2 = V::fmadd(qv, V::load(k2 + d), a2);
      a3 = V::fmadd(qv, V::load(k3 + d), a3);
    }
    out[k] = V::sum(a0);
    out[k + 1] = V::sum(a1);
    out[k + 2] = V::sum(a2);
    out[k + 3] = V::sum(a3);
  }
  for (; k < n; ++k) {  // the last n % 4 keys: each the same FMA chain and sum as in a group of 4
    const float* k0 = keys + k * stride;
    typename V::V a0 = V::zero();
    for (int64_t d = 0; d < D; d += W) a0 = V::fmadd(V::load(q + d), V::load(k0 + d), a0);
    out[k] = V::sum(a0);
  }
}

// out[k] = q . keys[k] for n keys of D floats, `stride` floats apart.
inline void scores(const float* q, const float* keys, int64_t stride, int64_t n, int64_t D, float* out) {
  int64_t k = 0;
#if defined(PS_AVX512)
  scores_vec<F32x16>(q, keys, stride, n, D, out, k);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  scores_vec<F32x8>(q, keys, stride, n, D, out, k);
#endif
  // NOTE: in order, no `omp simd reduction`: how GCC splits a reduction depends on the alignment it peels for,
  // which differs between threads' scratch rows, so a row's bits would depend on the thread and tile it ran in.
  for (; k < n; ++k) {
    const float* kk = keys + k * stride;
    float dot = 0.0f;
    for (int64_t d = 0; d < D; ++d) dot += q[d] * kk[d];
    out[k] = dot;
  }
}

// accumulate() on vectors of V, for D a whole number of at most 16 vectors (the accumulators stay in registers);
// false (nothing done) for another D.
template <class V>
inline bool accumulate_vec(float* acc, float corr, const float* p, const float* values, int64_t stride, int64_t n,
                           int64_t D) {
  constexpr int W = V::kLanes;
  if (D % W != 0 || D > 16 * W) return false;
  typename V::V a[16];
  const typename V::V c = V::set1(corr);
  for (int64_t i = 0; i < D / W; ++i) a[i] = V::mul(V::load(acc + W * i), c);
  for (int64_t k = 0; k < n; ++k) {
    const typename V::V pk = V::set1(p[k]);
    const float* v = values + k * stride;
    for (int64_t i = 0; i < D / W; ++i) a[i] = V::fmadd(pk, V::load(v + W * i), a[i]);
  }
  for (int64_t i = 0; i < D / W; ++i) V::store(acc + W * i, a[i]);
  return true;
}

// acc = acc * corr + sum_k p[k] * values[k]
inline void accumulate(float* acc, float corr, const float* p, const float* values, int64_t stride, int64_t n,
                       int64_t D) {
  static_assert(kMaxHeadDim == 16 * 16, "AVX-512 holds every head dim in 16 accumulators");
#if defined(PS_AVX512)
  if (accumulate_vec<F32x16>(acc, corr, p, values, stride, n, D)) return;
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (accumulate_vec<F32x8>(acc, corr, p, values, stride, n, D)) return;
#endif
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) acc[d] *= corr;
  for (int64_t k = 0; k < n; ++k) {
    const float pk = p[k];
    const float* v = values + k * stride;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] += pk * v[d];
  }
}

}  // namespace
