// Element types and their widening to float32: bfloat16, the 8-bit caches' int8 and fp8 codes (times their scale),
// one row at a time (widen_row) or 16 lanes (load16), per ISA.
#pragma once

#include "common.h"

namespace {

inline float to_f32(float x) { return x; }
// float32 -> bfloat16, round to nearest even (torch's conversion: NaN stays a quiet NaN, denormals are kept).
inline uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline float to_f32(uint16_t x) {  // bfloat16: the high half of a float32
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The fp8 formats as torch defines them (float8_e4m3fn: bias 7, no infinities, S.1111.111 is NaN;
// float8_e5m2: bias 15, IEEE-like, the high byte of a float16). One 256-entry table per format (1 KB, in L1).
struct E4M3 { uint8_t bits; };
struct E5M2 { uint8_t bits; };

struct Fp8Table {
  float v[256];
  Fp8Table(int exp_bits, int man_bits) {
    const int bias = (1 << (exp_bits - 1)) - 1, emax = (1 << exp_bits) - 1;
    for (int c = 0; c < 256; ++c) {
      const int e = (c >> man_bits) & emax, m = c & ((1 << man_bits) - 1);
      float x;
      if (exp_bits == 4 && e == emax && m == (1 << man_bits) - 1) x = NAN;   // e4m3fn: only NaN, no inf
      else if (exp_bits == 5 && e == emax) x = m ? NAN : INFINITY;
      else if (e == 0) x = std::ldexp(static_cast<float>(m), 1 - bias - man_bits);  // subnormal
      else x = std::ldexp(static_cast<float>(m + (1 << man_bits)), e - bias - man_bits);
      v[c] = (c & 0x80) ? -x : x;
    }
  }
};
const Fp8Table kE4M3Table(4, 3);
const Fp8Table kE5M2Table(5, 2);

// Widening one row of D codes into floats: dst[d] = decode(src[d]) * s (bf16: no scale).
inline void widen_row(const uint16_t* src, float, float* dst, int64_t D) {
  int64_t d = 0;
#if defined(__AVX512F__)
  for (; d + 16 <= D; d += 16) {  // bfloat16 -> float32: the 16 bits become the high half
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d)));
    _mm512_storeu_ps(dst + d, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
  }
#endif
  for (; d < D; ++d) dst[d] = to_f32(src[d]);
}

inline void widen_row(const int8_t* src, float s, float* dst, int64_t D) {
  int64_t d = 0;
#if defined(PS_AVX512)
  const __m512 sv = _mm512_set1_ps(s);
  for (; d + 16 <= D; d += 16) {
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d));
    _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)), sv));
  }
#elif defined(__AVX2__)
  const __m256 sv = _mm256_set1_ps(s);
  for (; d + 8 <= D; d += 8) {
    const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + d));
    _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), sv));
  }
#endif
  for (; d < D; ++d) dst[d] = static_cast<float>(src[d]) * s;
}

#if defined(__AVX2__)
// 16-bit integer lanes of either width, by overload: __m256i for the AVX-512 path's 16 e4m3 codes, __m128i for
// AVX2's 8. Each is the one intrinsic the width's hand-written copy had (the second argument of widen_u8 only picks
// the width).
inline __m256i widen_u8(const uint8_t* p, __m256i) {
  return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m128i widen_u8(const uint8_t* p, __m128i) {
  return _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i and16(__m256i a, __m256i b) { return _mm256_and_si256(a, b); }
inline __m128i and16(__m128i a, __m128i b) { return _mm_and_si128(a, b); }
inline __m256i or16(__m256i a, __m256i b) { return _mm256_or_si256(a, b); }
inline __m128i or16(__m128i a, __m128i b) { return _mm_or_si128(a, b); }
inline __m256i shl16(__m256i a, int n) { return _mm256_slli_epi16(a, n); }
inline __m128i shl16(__m128i a, int n) { return _mm_slli_epi16(a, n); }

// The e4m3 codes at c8 (one per 16-bit lane) as float16 bits (see widen_row's NOTE); mag: each code without its
// sign, 0x7f where it is NaN. m7f, m80: 0x7f and 0x80 in every lane.
template <typename V>
inline V e4m3_half_bits(const uint8_t* c8, V m7f, V m80, V& mag) {
  const V x = widen_u8(c8, m7f);
  mag = and16(x, m7f);
  return or16(shl16(and16(x, m80), 8), shl16(mag, 7));
}
#endif

// NOTE: no table gather on the vector paths: vpgatherdd is microcoded (and slowed further by the Gather Data
// Sampling mitigation), measured 50x slower than this. An e4m3 code S.EEEE.MMM placed as the float16
// S.0EEEE.MMM0000000 reads as 2^(E-15) * 1.M (subnormals too), so value = half * 2^8; S.1111.111 is NaN.
// half * (256 * s) == (half * 256) * s exactly: both scale by a power of two that neither under- nor overflows.
inline void widen_row(const E4M3* src, float s, float* dst, int64_t D) {
  const uint8_t* c8 = reinterpret_cast<const uint8_t*>(src);
  int64_t d = 0;
#if defined(PS_AVX512)
  const __m512 sv = _mm512_set1_ps(256.0f * s), nan = _mm512_set1_ps(NAN);
  const __m256i m7f = _mm256_set1_epi16(0x7f), m80 = _mm256_set1_epi16(0x80);
  for (; d + 16 <= D; d += 16) {
    __m256i mag;
    const __m256i h = e4m3_half_bits(c8 + d, m7f, m80, mag);
    const __mmask16 is_nan = _mm256_cmpeq_epi16_mask(mag, m7f);
    _mm512_storeu_ps(dst + d, _mm512_mask_blend_ps(is_nan, _mm512_mul_ps(_mm512_cvtph_ps(h), sv), nan));
  }
#elif defined(__AVX2__) && defined(__F16C__)
  const __m256 sv = _mm256_set1_ps(256.0f * s), nan = _mm256_set1_ps(NAN);
  const __m128i m7f = _mm_set1_epi16(0x7f), m80 = _mm_set1_epi16(0x80);
  for (; d + 8 <= D; d += 8) {
    __m128i mag;
    const __m128i h = e4m3_half_bits(c8 + d, m7f, m80, mag);
    const __m256 is_nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, m7f)));
    _mm256_storeu_ps(dst + d, _mm256_blendv_ps(_mm256_mul_ps(_mm256_cvtph_ps(h), sv), nan, is_nan));
  }
#endif
  for (; d < D; ++d) dst[d] = kE4M3Table.v[c8[d]] * s;
}

inline void widen_row(const E5M2* src, float s, float* dst, int64_t D) {
  const uint8_t* c8 = reinterpret_cast<const uint8_t*>(src);
  int64_t d = 0;
  // NOTE: an e5m2 code is the high byte of a float16: the hardware half -> float conversion decodes it exactly.
#if defined(PS_AVX512)
  const __m512 sv = _mm512_set1_ps(s);
  for (; d + 16 <= D; d += 16) {
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c8 + d));
    const __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(c), 8);
    _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_cvtph_ps(h), sv));
  }
#elif defined(__AVX2__) && defined(__F16C__)
  const __m256 sv = _mm256_set1_ps(s);
  for (; d + 8 <= D; d += 8) {
    const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c8 + d));
    const __m128i h = _mm_slli_epi16(_mm_cvtepu8_epi16(c), 8);
    _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtph_ps(h), sv));
  }
#endif
  for (; d < D; ++d) dst[d] = kE5M2Table.v[c8[d]] * s;
}

template <typename T> constexpr bool kQuantized = !std::is_same_v<T, float> && !std::is_same_v<T, uint16_t>;

#if defined(PS_AVX512)

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 bfloat16 -> float32 (exact: the high halves)
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

#endif

}  // namespace
