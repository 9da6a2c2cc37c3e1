// Paged attention on the CPU: one call per layer attends every sequence of a step (decodes and prefill
// chunks) straight out of the block pool, with an online softmax over blocks (flash-decoding on the CPU).
//
// Built at first use by worker_svc/attention/cpu_backend.py with g++ -O3 -march=native -fopenmp and called
// through ctypes with raw pointers of torch tensors. NOTE: it links the libgomp.so.1 that torch has already
// loaded (same soname), so its threads are torch's threads: torch.set_num_threads governs both.
//
// Layout (see worker_svc/attention/backend.py): kv_layer is [2, num_blocks, block_size, kv_heads, head_dim];
// query/out rows are the step's packed new tokens, [T, heads, head_dim]; sequence b owns rows
// qsl[b]..qsl[b+1]-1, which sit at positions seq_len - q_len .. seq_len - 1; row at position p sees keys 0..p.
//
// 8-bit caches (int8, fp8 e4m3 / e5m2): kv holds codes and `scales` the layer's float32 [2, num_blocks,
// block_size, kv_heads], one per (token, kv head) row of K and of V: value = code * scale. Each block's valid rows
// are dequantised into per-thread scratch as they are read (never a float copy of the cache). With int8_qk (an
// int8 cache, built with AVX-512 VNNI or AVX-VNNI) Q.K runs in int8: each query row is quantised to int8 with its
// own scale and score = q_scale * k_scale * int32 dot; softmax and P.V stay float.
//
// ISA paths, chosen at compile time by the -march macros: AVX-512 (f/bw/vl), AVX2 + FMA (+ F16C), scalar.
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace {

constexpr int kMaxRows = 64;     // query rows (tokens x group heads) one work item holds
constexpr int kMaxHeadDim = 256;
constexpr int kMaxBlock = 256;

// What a walk's last group prefetches for the walk this thread does next: the first group of rows of the item's
// next kv head, or of the next item in this thread's chunk of the schedule. Without it each walk's first group came
// from memory unprefetched (bf16 decode, 64 x 192, 2 threads, bench/attention_cpu.py: 18.2-19.8 -> 16.0-16.7 ms).
struct NextWalk {
  const int32_t* table = nullptr;  // null: nothing known to follow
  int64_t head_off = 0, num_kv_blocks = 0, last = 0;
};

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

// exp(x) for x <= 0 in float: 2^(x log2 e) as 2^n * p(f); rel. error < 2e-7, vectorizes (no libm call).
inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : x;
  float t = x * 1.44269504088896341f;
  float n = std::floor(t);
  float f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PS_AVX512 1
#endif

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
    const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c8 + d)));
    const __m256i mag = _mm256_and_si256(x, m7f);
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(x, m80), 8), _mm256_slli_epi16(mag, 7));
    const __mmask16 is_nan = _mm256_cmpeq_epi16_mask(mag, m7f);
    _mm512_storeu_ps(dst + d, _mm512_mask_blend_ps(is_nan, _mm512_mul_ps(_mm512_cvtph_ps(h), sv), nan));
  }
#elif defined(__AVX2__) && defined(__F16C__)
  const __m256 sv = _mm256_set1_ps(256.0f * s), nan = _mm256_set1_ps(NAN);
  const __m128i m7f = _mm_set1_epi16(0x7f), m80 = _mm_set1_epi16(0x80);
  for (; d + 8 <= D; d += 8) {
    const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c8 + d)));
    const __m128i mag = _mm_and_si128(x, m7f);
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(x, m80), 8), _mm_slli_epi16(mag, 7));
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

// out[k] = q . keys[k] for n keys of D floats, `stride` floats apart.
inline void scores(const float* q, const float* keys, int64_t stride, int64_t n, int64_t D, float* out) {
  int64_t k = 0;
#if defined(PS_AVX512)
  if (D % 16 == 0) {
    for (; k + 4 <= n; k += 4) {  // 4 keys share each load of q
      const float *k0 = keys + k * stride, *k1 = k0 + stride, *k2 = k1 + stride, *k3 = k2 + stride;
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 qv = _mm512_loadu_ps(q + d);
        a0 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + d), a0);
        a1 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k1 + d), a1);
        a2 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k2 + d), a2);
        a3 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k3 + d), a3);
      }
      out[k] = _mm512_reduce_add_ps(a0);
      out[k + 1] = _mm512_reduce_add_ps(a1);
      out[k + 2] = _mm512_reduce_add_ps(a2);
      out[k + 3] = _mm512_reduce_add_ps(a3);
    }
    for (; k < n; ++k) {  // the last n % 4 keys: each the same FMA chain and sum as in a group of 4
      const float* k0 = keys + k * stride;
      __m512 a0 = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k0 + d), a0);
      out[k] = _mm512_reduce_add_ps(a0);
    }
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    for (; k + 4 <= n; k += 4) {  // 4 keys share each load of q
      const float *k0 = keys + k * stride, *k1 = k0 + stride, *k2 = k1 + stride, *k3 = k2 + stride;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
      }
      out[k] = hsum8(a0);
      out[k + 1] = hsum8(a1);
      out[k + 2] = hsum8(a2);
      out[k + 3] = hsum8(a3);
    }
    for (; k < n; ++k) {  // the last n % 4 keys: each the same FMA chain and sum as in a group of 4
      const float* k0 = keys + k * stride;
      __m256 a0 = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k0 + d), a0);
      out[k] = hsum8(a0);
    }
  }
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

// acc = acc * corr + sum_k p[k] * values[k]
inline void accumulate(float* acc, float corr, const float* p, const float* values, int64_t stride, int64_t n,
                       int64_t D) {
#if defined(PS_AVX512)
  if (D % 16 == 0 && D <= kMaxHeadDim) {
    __m512 a[kMaxHeadDim / 16];
    const __m512 c = _mm512_set1_ps(corr);
    for (int64_t i = 0; i < D / 16; ++i) a[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * i), c);
    for (int64_t k = 0; k < n; ++k) {
      const __m512 pk = _mm512_set1_ps(p[k]);
      const float* v = values + k * stride;
      for (int64_t i = 0; i < D / 16; ++i) a[i] = _mm512_fmadd_ps(pk, _mm512_loadu_ps(v + 16 * i), a[i]);
    }
    for (int64_t i = 0; i < D / 16; ++i) _mm512_storeu_ps(acc + 16 * i, a[i]);
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0 && D <= 128) {
    __m256 a[16];
    const __m256 c = _mm256_set1_ps(corr);
    for (int64_t i = 0; i < D / 8; ++i) a[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * i), c);
    for (int64_t k = 0; k < n; ++k) {
      const __m256 pk = _mm256_set1_ps(p[k]);
      const float* v = values + k * stride;
      for (int64_t i = 0; i < D / 8; ++i) a[i] = _mm256_fmadd_ps(pk, _mm256_loadu_ps(v + 8 * i), a[i]);
    }
    for (int64_t i = 0; i < D / 8; ++i) _mm256_storeu_ps(acc + 8 * i, a[i]);
    return;
  }
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

// The int8 Q.K path: vpdpbusd multiplies u8 by s8, so a query row goes in as u = q + 128 (1..255) and
// u . k = q . k + 128 * sum(k): the bias is subtracted lane-wise (one more vpdpbusd per key, shared by all rows).
#if defined(__AVX512VNNI__) && defined(PS_AVX512)
#define PS_INT8_QK 512
#elif defined(__AVXVNNI__) && defined(__AVX2__)
#define PS_INT8_QK 256
#else
#define PS_INT8_QK 0
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
#if PS_INT8_QK == 512
    __m512i kv[kMaxHeadDim / 64];
    __m512i bias = _mm512_setzero_si512();
    const __m512i b128 = _mm512_set1_epi8(static_cast<char>(128));
    const int64_t nv = D / 64;
    for (int64_t i = 0; i < nv; ++i) {
      kv[i] = _mm512_loadu_si512(key + 64 * i);
      bias = _mm512_dpbusd_epi32(bias, b128, kv[i]);
    }
    d = nv * 64;
#elif PS_INT8_QK == 256
    __m256i kv[kMaxHeadDim / 32];
    __m256i bias = _mm256_setzero_si256();
    const __m256i b128 = _mm256_set1_epi8(static_cast<char>(128));
    const int64_t nv = D / 32;
    for (int64_t i = 0; i < nv; ++i) {
      kv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + 32 * i));
      bias = _mm256_dpbusd_avx_epi32(bias, b128, kv[i]);
    }
    d = nv * 32;
#endif
    const int64_t d_vec = d;
    for (; d < D; ++d) tail_sum += key[d];
    const float kscale = ks[k * ks_stride];
    for (int64_t r = 0; r < rows; ++r) {
      if (k >= nr[r]) continue;
      const uint8_t* ur = u + r * D;
      int32_t dot = 0;
#if PS_INT8_QK == 512
      __m512i acc = _mm512_sub_epi32(_mm512_setzero_si512(), bias);
      for (int64_t i = 0; i < nv; ++i) acc = _mm512_dpbusd_epi32(acc, _mm512_loadu_si512(ur + 64 * i), kv[i]);
      dot = _mm512_reduce_add_epi32(acc);
#elif PS_INT8_QK == 256
      __m256i acc = _mm256_sub_epi32(_mm256_setzero_si256(), bias);
      for (int64_t i = 0; i < nv; ++i)
        acc = _mm256_dpbusd_avx_epi32(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ur + 32 * i)), kv[i]);
      __m128i x = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
      x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4e));
      x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0xb1));
      dot = _mm_cvtsi128_si32(x);
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

#if defined(__x86_64__)
// Prefill tiles of a bfloat16 pool score on AMX tiles (amx_gemm.cpp grants and configures them): S = Q . K^T with
// Q's rows as A tiles and each 32-dim chunk of the block's keys transposed into a B tile (load_transposed: a key's
// dim pair is one dword), float32 accumulation of exact bfloat16 products. A 48-row prefill tile's Q.K was ~half of
// its FLOPs on FMAs; AMX does a block's in 2 products a row tile.
extern "C" int ps_amx_init();
extern "C" void ps_amx_configure();
#define PS_AMX_SCORES 1
constexpr int64_t kAmxMinRows = 16;  // items of fewer rows (decodes: the group's heads) keep the FMA path

// s [16 * row_tiles, 16] = qb [16 * row_tiles, D] . keys 0..n-1 of the block (rows `stride` elements apart; keys
// from n on score 0), unscaled. kt: 64-byte aligned scratch of D * 16 bfloat16. D: 64 or 128.
template <int D>
__attribute__((target("avx512f,avx512bw,avx512vl,amx-tile,amx-bf16")))
void amx_scores16(const uint16_t* qb, int64_t row_tiles, const uint16_t* kb, int64_t stride, int64_t n,
                  uint16_t* kt, float* s) {
  __m512i col[16];
  for (int c = 0; c < D / 32; ++c) {
    load_transposed(reinterpret_cast<const int8_t*>(kb + 32 * c), stride * 2, n, col);
    for (int i = 0; i < 16; ++i) _mm512_store_si512(kt + c * 512 + i * 32, col[i]);
  }
#define PS_QK_TILE(t)                                                                       \
  if (row_tiles > t) {                                                                    \
    _tile_loadd(4, qb + t * 16 * D + c * 32, D * 2);                                      \
    _tile_loadd(5, qb + t * 16 * D + (c + 1) * 32, D * 2);                                \
    _tile_dpbf16ps(t, 4, 6);                                                              \
    _tile_dpbf16ps(t, 5, 7);                                                              \
  }
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int c = 0; c < D / 32; c += 2) {
    _tile_loadd(6, kt + c * 512, 64);
    _tile_loadd(7, kt + (c + 1) * 512, 64);
    PS_QK_TILE(0)
    PS_QK_TILE(1)
    PS_QK_TILE(2)
    PS_QK_TILE(3)
  }
#undef PS_QK_TILE
  _tile_stored(0, s, 64);
  if (row_tiles > 1) _tile_stored(1, s + 256, 64);
  if (row_tiles > 2) _tile_stored(2, s + 512, 64);
  if (row_tiles > 3) _tile_stored(3, s + 768, 64);
}
#endif

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

#if defined(PS_AVX512)
// The 16-key block path (block_size 16, head_dim 64 or 128, float K/V rows: a float pool in place, others widened):
// each row's 16 scores come out in ONE vector (16 per-key partial-sum vectors, then a transpose-add tree: 45 ops
// instead of 16 horizontal reductions), the online softmax runs on that vector (one max, one exp, one sum), and
// each V row is loaded once for up to 16 / (D / 16) rows' accumulators. Measured 2-3x the general loop's speed.

// exp(x) for x <= 0, 16 lanes: fast_exp's polynomial, 2^n applied with scalef.
inline __m512 fast_exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

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

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 bfloat16 -> float32 (exact: the high halves)
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
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

// scores16 for RS rows at once: each key row is loaded (bf16: widened) once for all RS rows, where scores16 per
// row reloads it (bf16 decode, 64 x 192, 1 thread: 40 -> 36 ms a step of 30 layers; prefill 2 x 256: 49 -> 44). Keys k < n (the block's furthest-seeing row's count) are scored for every row; the caller masks
// each row's own causal tail. Per (row, key) the same chain of FMAs and the same transpose-add tree as scores16,
// so a valid lane has scores16's bits. out[r]: row r's 16 scores (lanes from n on: 0 sums, masked by the caller).
template <int D, int RS, typename E>
inline void scores_rows16(const float* q, const E* kb, int64_t stride, int64_t n, __m512 out[RS]) {
  constexpr int NV = D / 16;
  __m512 y0[RS], s01[RS];
#pragma GCC unroll 4
  for (int kc = 0; kc < 4; ++kc) {
    __m512 part[RS][4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const int k = kc * 4 + j;
      if (k < n) {
        const E* kr = kb + k * stride;
        __m512 kv[NV];
#pragma GCC unroll 8
        for (int i = 0; i < NV; ++i) kv[i] = load16(kr + 16 * i);
#pragma GCC unroll 4
        for (int r = 0; r < RS; ++r) {
          const float* qr = q + r * D;
          __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qr), kv[0]);
#pragma GCC unroll 8
          for (int i = 1; i < NV; ++i) a = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * i), kv[i], a);
          part[r][j] = a;
        }
      } else {
#pragma GCC unroll 4
        for (int r = 0; r < RS; ++r) part[r][j] = _mm512_setzero_ps();
      }
    }
    fold_keys<RS>(kc, part, y0, s01, out);
  }
}

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

#if defined(PS_AMX_SCORES)
// Block b's scores for all rows on AMX tiles (qb: the rows' unscaled bfloat16 queries, padded to whole row tiles),
// times qscale, into sbuf.
template <int D>
inline void amx_block_scores(const uint16_t* qb, int64_t rows, const uint16_t* kb, int64_t stride, int64_t nmax,
                             const int64_t (*nk)[kGroup], int b, float qscale, float* sbuf) {
  alignas(64) uint16_t kt[D * 16];
  alignas(64) float st[kMaxRows * 16];
  if (nmax > 0) amx_scores16<D>(qb, (rows + 15) / 16, kb, stride, nmax, kt, st);
  const __m512 sv = _mm512_set1_ps(qscale);
  for (int64_t r = 0; r < rows; ++r)
    put_scores(sbuf, r, b, nk[r][b], nmax, _mm512_mul_ps(_mm512_load_ps(st + r * 16), sv));
}
#endif

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
        if (rs == 4) scores_rows16<D, 4>(q + r0 * D, kb[b], stride, nmax, sc);
        else if (rs == 3) scores_rows16<D, 3>(q + r0 * D, kb[b], stride, nmax, sc);
        else if (rs == 2) scores_rows16<D, 2>(q + r0 * D, kb[b], stride, nmax, sc);
        else scores_rows16<D, 1>(q + r0 * D, kb[b], stride, nmax, sc);
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
  __m512 y0[RS], s01[RS];
#pragma GCC unroll 4
  for (int kc = 0; kc < 4; ++kc) {
    __m512 part[RS][4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const int k = kc * 4 + j;
      if (k < n) {
        const uint16_t* kr = kb + k * stride;
        __m512bh kv[NC];
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) kv[c] = as_bh(_mm512_loadu_si512(kr + 32 * c));
#pragma GCC unroll 4
        for (int r = 0; r < RS; ++r) {
          __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[r][0], kv[0]);
#pragma GCC unroll 4
          for (int c = 1; c < NC; ++c) a = _mm512_dpbf16_ps(a, qv[r][c], kv[c]);
          part[r][j] = a;
        }
      } else {
#pragma GCC unroll 4
        for (int r = 0; r < RS; ++r) part[r][j] = _mm512_setzero_ps();
      }
    }
    fold_keys<RS>(kc, part, y0, s01, out);
  }
}

// P.V of a prefill tile's group on AMX tiles: acc[r] = acc[r] * corr[r] + P_r . V for the group's nb blocks. pb: the
// rows' bfloat16 probabilities (row r, block b at pb[(r * kGroup + b) * 16]; zeroed here past the rows and the
// blocks); V's rows `stride` elements apart, slots past `last` never read (their keys' B-tile rows are zeros: AMX
// would carry a garbage NaN through p = 0). V goes into B tiles two keys a row (VNNI order), 16 output dims a tile;
// P's 32-key chunks are the A tiles. A 63-row tile's P.V took 4 dot products a row a key pair on vectors; here
// 2 tile products per 16 rows x 16 dims x 64 keys.
template <int D>
__attribute__((target("avx512f,avx512bw,avx512vl,amx-tile,amx-bf16")))
void amx_pv(uint16_t* pb, int64_t rows, int nb, const uint16_t* const* vb, int64_t stride, int64_t j0, int64_t last,
            const float* corr, float* acc) {
  constexpr int NCH = D / 16;  // 16-dim output chunks
  const int64_t row_tiles = (rows + 15) / 16;
  const int nkc = (nb * 16 + 31) / 32;  // 32-key chunks (A tiles a row tile)
  for (int64_t r = 0; r < row_tiles * 16; ++r)
    for (int b = 0; b < kGroup; ++b)
      if (r >= rows || b >= nb)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + (r * kGroup + b) * 16), _mm256_setzero_si256());
  alignas(64) uint16_t inter_idx[32];
  for (int j = 0; j < 16; ++j) {
    inter_idx[2 * j] = static_cast<uint16_t>(j);
    inter_idx[2 * j + 1] = static_cast<uint16_t>(32 + j);
  }
  const __m512i inter = _mm512_load_si512(inter_idx);  // x[0], y[0], x[1], y[1], ...: a key pair a dword
  alignas(64) uint16_t vt[NCH * 2 * 512];  // chunk c, 32-key chunk kc: one B tile
  for (int kc = 0; kc < nkc; ++kc) {
    for (int i = 0; i < 16; ++i) {
      const int k = 32 * kc + 2 * i, b = k / 16, kin = k % 16;
      const int64_t nvalid = b < nb ? std::min<int64_t>(16, last + 1 - (j0 + b) * 16) : 0;
      const uint16_t* v0 = b < nb ? vb[b] + kin * stride : nullptr;
      for (int c = 0; c < NCH; ++c) {
        const __m512i x = kin < nvalid ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                             reinterpret_cast<const __m256i*>(v0 + 16 * c)))
                                       : _mm512_setzero_si512();
        const __m512i y = kin + 1 < nvalid ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                                 reinterpret_cast<const __m256i*>(v0 + stride + 16 * c)))
                                           : _mm512_setzero_si512();
        _mm512_store_si512(vt + (c * 2 + kc) * 512 + i * 32, _mm512_permutex2var_epi16(x, inter, y));
      }
    }
  }
  alignas(64) float ct[4][256];
  for (int64_t rt = 0; rt < row_tiles; ++rt) {
    for (int c0 = 0; c0 < NCH; c0 += 4) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int kc = 0; kc < nkc; ++kc) {
        _tile_loadd(4, pb + rt * 16 * kGroup * 16 + kc * 32, kGroup * 16 * 2);
        _tile_loadd(5, vt + ((c0 + 0) * 2 + kc) * 512, 64);
        _tile_loadd(6, vt + ((c0 + 1) * 2 + kc) * 512, 64);
        _tile_loadd(7, vt + ((c0 + 2) * 2 + kc) * 512, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, vt + ((c0 + 3) * 2 + kc) * 512, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
      _tile_stored(0, ct[0], 64);
      _tile_stored(1, ct[1], 64);
      _tile_stored(2, ct[2], 64);
      _tile_stored(3, ct[3], 64);
      for (int64_t r = 0; r < 16 && rt * 16 + r < rows; ++r) {
        const int64_t row = rt * 16 + r;
        const __m512 cr = _mm512_set1_ps(corr[row]);
        for (int cc = 0; cc < 4; ++cc) {
          float* dst = acc + row * D + (c0 + cc) * 16;
          _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_loadu_ps(dst), cr, _mm512_load_ps(ct[cc] + r * 16)));
        }
      }
    }
  }
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
        if (rs == 4) dot_scores_rows16<D, 4>(qb + r0 * D, kb[b], stride, nmax, sc);
        else if (rs == 3) dot_scores_rows16<D, 3>(qb + r0 * D, kb[b], stride, nmax, sc);
        else if (rs == 2) dot_scores_rows16<D, 2>(qb + r0 * D, kb[b], stride, nmax, sc);
        else dot_scores_rows16<D, 1>(qb + r0 * D, kb[b], stride, nmax, sc);
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

struct Args {
  const void* q;  // float32, or bfloat16 where io_bf16
  int64_t q_stride_t, q_stride_h;
  const void* kv;
  const float* scales;  // 8-bit caches: [2, num_blocks, block_size, kv_heads]; else null
  void* out;  // contiguous [T, H, D]: float32, or bfloat16 where io_bf16
  bool io_bf16;
  const int64_t* qsl;
  const int64_t* seq_lens;
  const int32_t* block_tables;
  int64_t bt_stride;
  int64_t num_heads, num_kv_heads, head_dim, num_blocks, block_size, q_tile, max_q_len;
  float scale;
  bool int8_qk;
  bool invariant;  // batch invariant: a row's path never depends on how many rows its item holds (no AMX tiles)
};

// One work item: sequence b, kv head h, query tokens [t0, t1) of the sequence's chunk, all `group` query
// heads of h. K/V of each block is read once for all of the item's rows.
template <typename T>
void attend_item(const Args& a, int64_t b, int64_t h, int64_t t0, int64_t t1, const NextWalk& next) {
  const int64_t D = a.head_dim, BS = a.block_size, G = a.num_heads / a.num_kv_heads;
  const int64_t q_begin = a.qsl[b], q_len = a.qsl[b + 1] - q_begin, s = a.seq_lens[b];
  const int64_t first_pos = s - q_len;
  const int64_t rows = (t1 - t0) * G;
  const T* K = static_cast<const T*>(a.kv);
  const T* V = K + a.num_blocks * BS * a.num_kv_heads * D;
  const int64_t tok_stride = a.num_kv_heads * D;
  const float* KS = a.scales;
  const float* VS = KS ? KS + a.num_blocks * BS * a.num_kv_heads : nullptr;
  const bool int8_qk = std::is_same_v<T, int8_t> && a.int8_qk;
  // int8 keys are read transposed (no float copy of K per row; see load_transposed) where AVX-512 has it.
#if defined(PS_AVX512)
  const bool k_transposed = std::is_same_v<T, int8_t> && D % 64 == 0;
#else
  const bool k_transposed = false;
#endif
  const bool k_scored = int8_qk || k_transposed;  // scores of the whole block come from one call
#if defined(PS_AVX512)
  const bool fast16 = !k_scored && BS == 16 && (D == 64 || D == 128);
#endif

  // NOTE: per-thread scratch on the heap (kept across calls): a few hundred KB is too much for a stack.
  thread_local std::vector<float> scratch;
  thread_local std::vector<uint8_t> qcodes;
  scratch.resize(2 * kMaxRows * D + 2 * BS * D + kMaxRows * BS + 16 * D + 16);
  float* const qbuf = scratch.data();
  float* const abuf = qbuf + kMaxRows * D;
  float* const kf = abuf + kMaxRows * D;
  float* const vf = kf + BS * D;
  float* const sc = vf + BS * D;  // [rows, BS] scores, then probabilities
  // 64-byte aligned [D, 16] scratch for transposed keys
  float* const kt = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(sc + kMaxRows * BS) + 63) & ~uintptr_t{63});
  float m[kMaxRows], l[kMaxRows], qs[kMaxRows];
  int64_t pos[kMaxRows], nr[kMaxRows];
  if (int8_qk) qcodes.resize(kMaxRows * D);

  // Query row r's first element (float32, or bfloat16 where io_bf16).
  const auto q_row = [&](int64_t r) {
    const int64_t t = t0 + r / G, head = h * G + r % G;
    return (q_begin + t) * a.q_stride_t + head * a.q_stride_h;
  };
  const float* const qf = static_cast<const float*>(a.q);
  const uint16_t* const qh = static_cast<const uint16_t*>(a.q);
  // The queries as bfloat16 rows (qb) for AMX scores (prefill tiles of a bfloat16 pool) and the bf16 dot path
  // (bfloat16 queries handed over: a bfloat16 model's steps). AMX scores take float32 queries too where every one
  // is a bfloat16 value (exact products either way); a float32 model's other queries keep the exact FMA path.
  const uint16_t* qb = nullptr;
  bool amx_qk = false, dot = false;
#if defined(PS_BF16_DOT)
  thread_local std::vector<uint16_t> qbits;
  if constexpr (std::is_same_v<T, uint16_t>) {
    // NOTE: AMX's sums run in another order than the dot products' (other bits): a batch-invariant call keeps every
    // row on the dot path, whether it is a decode's or one of a 16-token prefill tile's.
    amx_qk = fast16 && !a.invariant && rows >= kAmxMinRows && ps_amx_init();
    dot = fast16 && a.io_bf16 && bf16_dot_available();
  }
  if (amx_qk || dot) {
    qbits.assign(((rows + 15) / 16 * 16) * D + 32, 0);  // + 32: room to align to 64 bytes
    uint16_t* qa = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(qbits.data()) + 63) & ~uintptr_t{63});
    bool exact = true;
    for (int64_t r = 0; r < rows; ++r) {
      if (a.io_bf16) {
        std::memcpy(qa + r * D, qh + q_row(r), D * sizeof(uint16_t));
        continue;
      }
      for (int64_t d = 0; d < D; ++d) {
        uint32_t u;
        std::memcpy(&u, qf + q_row(r) + d, 4);
        exact = exact && (u & 0xFFFFu) == 0;
        qa[r * D + d] = static_cast<uint16_t>(u >> 16);
      }
    }
    amx_qk = amx_qk && exact;
    if (amx_qk) ps_amx_configure();
    if (amx_qk || dot) qb = qa;
  }
#endif
  (void)qb;  // builds without AMX scores never read it
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / G;
    if (a.io_bf16) {
      for (int64_t d = 0; d < D; ++d) qbuf[r * D + d] = to_f32(qh[q_row(r) + d]) * a.scale;
    } else {
      for (int64_t d = 0; d < D; ++d) qbuf[r * D + d] = qf[q_row(r) + d] * a.scale;  // scale the query, not every score
    }
    if (int8_qk) qs[r] = quantize_query(qbuf + r * D, D, qcodes.data() + r * D);
    std::memset(abuf + r * D, 0, sizeof(float) * D);
    m[r] = -INFINITY;
    l[r] = 0.0f;
    pos[r] = first_pos + t;
  }
  const int64_t last = first_pos + t1 - 1;  // the item's furthest-seeing row
  const int64_t num_kv_blocks = last / BS + 1;
  const int32_t* table = a.block_tables + b * a.bt_stride;
  bool grouped = false;
#if defined(PS_AVX512)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, uint16_t>) {
    if (fast16) {
      if (D == 64) attend_grouped<64>(qbuf, abuf, m, l, pos, rows, K, V, table, num_kv_blocks, last,
                                      tok_stride, h * D, next, qb, a.scale, amx_qk, dot);
      else attend_grouped<128>(qbuf, abuf, m, l, pos, rows, K, V, table, num_kv_blocks, last,
                               tok_stride, h * D, next, qb, a.scale, amx_qk, dot);
      grouped = true;
    }
  }
#endif
  for (int64_t j = 0; j < num_kv_blocks && !grouped; ++j) {
    const int64_t base = j * BS;
    const int64_t n_in_block = std::min(BS, last + 1 - base);
    const int64_t row0 = static_cast<int64_t>(table[j]) * BS;  // the block's first token row in the pool
    const int64_t off = row0 * tok_stride + h * D;
    const int64_t soff = row0 * a.num_kv_heads + h;  // its first (token, kv head) scale
    for (int64_t r = 0; r < rows; ++r) nr[r] = std::min(n_in_block, pos[r] + 1 - base);  // causal: keys 0..pos[r]
#if defined(__x86_64__)
    if (j + 1 < num_kv_blocks) {  // the next block's rows of this head, while this one computes (scattered blocks)
      const int64_t next = static_cast<int64_t>(table[j + 1]) * BS * tok_stride + h * D;
      const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
      const int64_t n_next = std::min(BS, last + 1 - base - BS);
      for (int64_t k = 0; k < n_next; ++k) {
        const char* kr = reinterpret_cast<const char*>(K + next + k * tok_stride);
        const char* vr = reinterpret_cast<const char*>(V + next + k * tok_stride);
        for (int64_t c = 0; c < row_bytes; c += 64) {
          _mm_prefetch(kr + c, _MM_HINT_T0);
          _mm_prefetch(vr + c, _MM_HINT_T0);
        }
      }
    }
#endif
    // float32 pools are read in place; other dtypes are widened (8-bit: dequantised) once per block into kf/vf.
    // NOTE: slots past `last` are garbage (NaN codes and scales included): never read.
    const float *kb, *vb;
    int64_t stride;
    if constexpr (std::is_same_v<T, float>) {
      kb = K + off;
      vb = V + off;
      stride = tok_stride;
    } else {
      for (int64_t k = 0; k < n_in_block; ++k) {
        const int64_t so = soff + k * a.num_kv_heads;
        if (!k_scored) widen_row(K + off + k * tok_stride, kQuantized<T> ? KS[so] : 1.0f, kf + k * D, D);
        widen_row(V + off + k * tok_stride, kQuantized<T> ? VS[so] : 1.0f, vf + k * D, D);
      }
      kb = kf;
      vb = vf;
      stride = D;
    }
    if constexpr (std::is_same_v<T, int8_t>) {
      const int8_t* kc = K + off;
      const float* ks = KS + soff;
      const int64_t kh = a.num_kv_heads;
      if (int8_qk) {
#if PS_INT8_QK == 512
        if (D % 64 == 0) int8_scores_t(qcodes.data(), qs, rows, nr, kc, tok_stride, ks, kh, n_in_block, D, sc, BS);
        else
#endif
        int8_scores(qcodes.data(), qs, rows, nr, kc, tok_stride, ks, kh, n_in_block, D, sc, BS);
      } else if (k_transposed) {
#if defined(PS_AVX512)
        dequant_scores_t(qbuf, rows, nr, kc, tok_stride, ks, kh, n_in_block, D, kt, sc, BS);
#endif
      }
    }
#if defined(PS_AVX512)
    if (fast16) {  // 8-bit caches: dequantised rows
      if (D == 64) block16<64, float>(qbuf, abuf, m, l, nr, rows, kb, vb, stride, sc);
      else block16<128, float>(qbuf, abuf, m, l, nr, rows, kb, vb, stride, sc);
      continue;
    }
#endif
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = nr[r];
      if (n <= 0) continue;
      float* const p = sc + r * BS;
      if (!k_scored) scores(qbuf + r * D, kb, stride, n, D, p);
      float bmax = -INFINITY;
      for (int64_t k = 0; k < n; ++k) bmax = p[k] > bmax ? p[k] : bmax;
      // Online softmax: rescale what was accumulated under the old running max.
      const float m_new = bmax > m[r] ? bmax : m[r];
      const float corr = fast_exp(m[r] - m_new);  // m[r] = -inf on the first block: corr = 0
      float psum = 0.0f;
#pragma omp simd
      for (int64_t k = 0; k < n; ++k) p[k] = fast_exp(p[k] - m_new);
      for (int64_t k = 0; k < n; ++k) psum += p[k];  // in order: see scores()
      l[r] = l[r] * corr + psum;
      m[r] = m_new;
      accumulate(abuf + r * D, corr, p, vb, stride, n, D);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / G, head = h * G + r % G;
    const int64_t o = ((q_begin + t) * a.num_heads + head) * D;
    const float inv = 1.0f / l[r];
    if (a.io_bf16) {
      uint16_t* dst = static_cast<uint16_t*>(a.out) + o;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) dst[d] = to_bf16(abuf[r * D + d] * inv);
    } else {
      float* dst = static_cast<float*>(a.out) + o;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) dst[d] = abuf[r * D + d] * inv;
    }
  }
}

template <typename T>
void run(const Args& a, int64_t num_seqs) {
  const int64_t G = a.num_heads / a.num_kv_heads;
  const int64_t tile = std::max<int64_t>(1, std::min<int64_t>(a.q_tile, kMaxRows / G));
  // Work items: (sequence, query tile, kv heads), dynamic schedule. An item takes all kv heads of its tile when
  // the tiles alone keep every thread busy: a pool row holds a token's kv heads side by side, so one thread then
  // reads each block row whole, where items of one head each read 1 / kv_heads of every row (and a neighbour's
  // prefetch is wasted on another core). Few tiles (a small decode batch): one head an item, for parallelism.
  std::vector<int64_t> item_start(num_seqs + 1, 0);  // first the tiles' prefix sums
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = a.qsl[b + 1] - a.qsl[b];
    const int64_t tiles = q_len <= a.max_q_len ? (q_len + tile - 1) / tile : 0;  // longer: the caller's
    item_start[b + 1] = item_start[b] + tiles;
  }
  const int64_t heads_per_item = item_start[num_seqs] >= 4 * omp_get_max_threads() ? a.num_kv_heads : 1;
  const int64_t head_items = a.num_kv_heads / heads_per_item;
  for (int64_t& start : item_start) start *= head_items;  // then the items'
  const int64_t num_items = item_start[num_seqs];
  // Item i: its sequence, first kv head, query tile [t0, t1).
  const auto item = [&](int64_t i, int64_t& b, int64_t& h0, int64_t& t0, int64_t& t1) {
    int64_t lo = 0, hi = num_seqs;  // the sequence whose items contain i
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (item_start[mid] <= i) lo = mid; else hi = mid;
    }
    b = lo;
    const int64_t local = i - item_start[b];
    h0 = (local % head_items) * heads_per_item;
    t0 = (local / head_items) * tile;
    t1 = std::min(a.qsl[b + 1] - a.qsl[b], t0 + tile);
  };
  // The walk over sequence b's blocks for kv head h up to the item's furthest-seeing row, as NextWalk names it.
  const auto walk = [&](int64_t b, int64_t h, int64_t t1) {
    const int64_t last = a.seq_lens[b] - (a.qsl[b + 1] - a.qsl[b]) + t1 - 1;
    return NextWalk{a.block_tables + b * a.bt_stride, h * a.head_dim, last / a.block_size + 1, last};
  };
  // A decode-only step with plenty of items takes them 4 a chunk: a thread then knows the item it takes next, and
  // prefetches it. Prefill tiles (unequal: causal) stay one a chunk, for balance (4 cost 2 x 256 prefill 8%).
  bool decode_only = true;
  for (int64_t b = 0; b < num_seqs && decode_only; ++b) decode_only = a.qsl[b + 1] - a.qsl[b] <= 1;
  const int64_t chunk = decode_only && num_items >= 16 * omp_get_max_threads() ? 4 : 1;
#pragma omp parallel for schedule(dynamic, chunk)
  for (int64_t i = 0; i < num_items; ++i) {
    int64_t b, h0, t0, t1;
    item(i, b, h0, t0, t1);
    NextWalk after;  // what follows this item's last head on this thread
    if ((i + 1) % chunk != 0 && i + 1 < num_items) {
      int64_t b2, h2, t2, t3;
      item(i + 1, b2, h2, t2, t3);
      after = walk(b2, h2, t3);
    }
    for (int64_t h = h0; h < h0 + heads_per_item; ++h)
      attend_item<T>(a, b, h, t0, t1, h + 1 < h0 + heads_per_item ? walk(b, h + 1, t1) : after);
  }
}

}  // namespace

extern "C" {

int ps_max_head_dim() { return kMaxHeadDim; }
int ps_max_block_size() { return kMaxBlock; }
int ps_max_group() { return kMaxRows; }
// The int8 Q.K path this build has: 512 (AVX-512 VNNI), 256 (AVX-VNNI) or 0 (none).
int ps_int8_qk_width() { return PS_INT8_QK; }
// 1 where a bfloat16 query over a bfloat16 pool takes the bf16 dot products (this CPU has AVX512-BF16, this build
// AVX-512), else 0.
int ps_bf16_dot() {
#if defined(PS_BF16_DOT)
  return bf16_dot_available() ? 1 : 0;
#else
  return 0;
#endif
}
// The widest float path this build has: 512 (AVX-512), 256 (AVX2 + FMA) or 0 (scalar).
int ps_simd_width() {
#if defined(PS_AVX512)
  return 512;
#elif defined(__AVX2__) && defined(__FMA__)
  return 256;
#else
  return 0;
#endif
}

enum Dtype { kFloat32 = 0, kBFloat16 = 1, kInt8 = 2, kE4M3 = 3, kE5M2 = 4 };

// Dequantises n rows of D codes of an 8-bit dtype (2, 3, 4) through the kernel's own widening path:
// out[i, d] = decode(codes[i, d]) * scales[i]. For tests (bit-exactness against torch).
int ps_dequantize(const void* codes, int dtype, const float* scales, int64_t n, int64_t D, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* row = static_cast<const uint8_t*>(codes) + i * D;
    if (dtype == kInt8) widen_row(reinterpret_cast<const int8_t*>(row), scales[i], out + i * D, D);
    else if (dtype == kE4M3) widen_row(reinterpret_cast<const E4M3*>(row), scales[i], out + i * D, D);
    else if (dtype == kE5M2) widen_row(reinterpret_cast<const E5M2*>(row), scales[i], out + i * D, D);
    else return 2;
  }
  return 0;
}

// dtype: a Dtype. io_bf16 = 0: the query and output are float32; 1: bfloat16 (a bfloat16 model's: on a bfloat16
// pool and a CPU with AVX512-BF16 its steps take the bf16 dot products, P rounded to bf16). scales: an 8-bit cache's float32 scales (see the top), null
// for float pools. batch_invariant: every query row takes the same arithmetic whatever its item's row count (a
// decode's row and the same row in a prefill tile: the same bits). int8_qk: Q.K in int8 (an int8 cache, a build with ps_int8_qk_width() > 0). Sequences whose
// q_len exceeds max_q_len are skipped (their rows of `out` are left as they are): long prefill chunks are
// GEMM-shaped work that the caller hands to a matmul-based attention instead.
// Returns 0, or 1 (shapes the kernel has no instance for), 2 (unknown dtype), 3 (scales missing or given to a
// float pool), 4 (int8_qk for another dtype or in a build without it).
int ps_paged_attention(const void* q, int64_t q_stride_t, int64_t q_stride_h, const void* kv, int dtype,
                       const float* scales, int int8_qk, void* out, const int64_t* qsl, const int64_t* seq_lens,
                       const int32_t* block_tables, int64_t bt_stride, int64_t num_seqs, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size, float scale,
                       int64_t q_tile, int64_t max_q_len, int io_bf16, int batch_invariant) {
  if (head_dim > kMaxHeadDim || block_size > kMaxBlock || num_heads % num_kv_heads ||
      num_heads / num_kv_heads > kMaxRows)
    return 1;
  if (dtype < kFloat32 || dtype > kE5M2) return 2;
  if ((dtype >= kInt8) != (scales != nullptr)) return 3;
  if (int8_qk && (dtype != kInt8 || PS_INT8_QK == 0)) return 4;
  Args a{q, q_stride_t, q_stride_h, kv, scales, out, io_bf16 != 0, qsl, seq_lens, block_tables, bt_stride, num_heads,
         num_kv_heads, head_dim, num_blocks, block_size, q_tile, max_q_len, scale, int8_qk != 0,
         batch_invariant != 0};
  switch (dtype) {
    case kFloat32: run<float>(a, num_seqs); break;
    case kBFloat16: run<uint16_t>(a, num_seqs); break;
    case kInt8: run<int8_t>(a, num_seqs); break;
    case kE4M3: run<E4M3>(a, num_seqs); break;
    default: run<E5M2>(a, num_seqs); break;
  }
  return 0;
}

// This step's K and V rows into their pool slots, for float pools (the kernel's pool layout, plane 0 = K, 1 = V):
// row t of key and of value (row_bytes each, key_stride / value_stride bytes apart) to row slots[t] of its plane of
// num_slots rows. One call a layer in place of two index_copy_ ops (6 us against 18: 64 rows, 2 threads).
// Returns 0, or 1 when a slot is out of range (then nothing is written: all are checked first).
int ps_write_kv(void* pool, int64_t num_slots, int64_t row_bytes, const void* key, int64_t key_stride,
                const void* value, int64_t value_stride, const int64_t* slots, int64_t n) {
  for (int64_t t = 0; t < n; ++t)
    if (slots[t] < 0 || slots[t] >= num_slots) return 1;
  char* const k_plane = static_cast<char*>(pool);
  char* const v_plane = k_plane + num_slots * row_bytes;
  for (int64_t t = 0; t < n; ++t) {
    std::memcpy(k_plane + slots[t] * row_bytes, static_cast<const char*>(key) + t * key_stride, row_bytes);
    std::memcpy(v_plane + slots[t] * row_bytes, static_cast<const char*>(value) + t * value_stride, row_bytes);
  }
  return 0;
}

}  // extern "C"
