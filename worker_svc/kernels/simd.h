// float32 vectors of one width behind one interface (F32x16: AVX-512, F32x8: AVX2), so that a loop written once as
// a template over the width compiles to the same instructions as the two hand-written copies did. Each member is
// the one intrinsic it names: no width gets an operation the other's copy did not have.
// NOTE: internal linkage on purpose (see exp.h): f32_ops.cpp includes this under `fp-contract=off`.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
struct F32x16 {
  using V = __m512;
  using I = __m512i;
  static constexpr int kLanes = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V floor(V v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  // where lane x < bound: v, else e (and where x > bound for where_gt); NaN lanes keep e (ordered compares)
  static V where_lt(V x, float bound, V v, V e) {
    return _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, set1(bound), _CMP_LT_OQ), v);
  }
  static V where_gt(V x, float bound, V v, V e) {
    return _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, set1(bound), _CMP_GT_OQ), v);
  }
  static I to_int(V v) { return _mm512_cvtps_epi32(v); }
  static I set1i(int x) { return _mm512_set1_epi32(x); }
  static I addi(I a, I b) { return _mm512_add_epi32(a, b); }
  static I subi(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I srai1(I a) { return _mm512_srai_epi32(a, 1); }
  static V exponent(I e) { return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23)); }  // 2^(e - 127) for a biased e
};
#endif

#if defined(__AVX2__)
struct F32x8 {
  using V = __m256;
  using I = __m256i;
  static constexpr int kLanes = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
#if defined(__FMA__)
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
#endif
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V floor(V v) { return _mm256_floor_ps(v); }
  static float sum(V v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
  }
  static V where_lt(V x, float bound, V v, V e) {
    return _mm256_blendv_ps(e, v, _mm256_cmp_ps(x, set1(bound), _CMP_LT_OQ));
  }
  static V where_gt(V x, float bound, V v, V e) {
    return _mm256_blendv_ps(e, v, _mm256_cmp_ps(x, set1(bound), _CMP_GT_OQ));
  }
  static I to_int(V v) { return _mm256_cvtps_epi32(v); }
  static I set1i(int x) { return _mm256_set1_epi32(x); }
  static I addi(I a, I b) { return _mm256_add_epi32(a, b); }
  static I subi(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I srai1(I a) { return _mm256_srai_epi32(a, 1); }
  static V exponent(I e) { return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)); }
};
#endif

}  // namespace
