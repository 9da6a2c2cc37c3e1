// Weight-only quantised matmuls (worker_svc/quant/ops.py): out = x . W^T (+ bias) for x [M, K] float32 or
// bfloat16 and W [N, K] kept in a GGML block format (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K), dequantised in registers and
// never stored as floats. Built into the CPU kernel library (cpu_build.py).
//
// Layout: at load the file's blocks are repacked (ps_q_pack) into panels of kCols = 48 output columns, each a run of
// groups of G k-steps (G = 32; 16 for Q6_K, whose scales change every 16 weights): a group's header (the scales of
// its 48 columns, as the file holds them: fp16 d and m, 6-bit sub-block scales) and then its quants, k-step by
// k-step (4-bit formats: 24 bytes a step, byte j of each 8-byte run holding columns j and j + 8; 8-bit: 48 bytes).
// Q5_0 keeps its 5 bits: its low 4 in nibbles by pairs of k-steps (pair t: 48 bytes, byte j column j, k-step 2t in
// the low nibble and 2t + 1 in the high one: one load gives two steps, and a zero-extended byte is already a table
// index, see q5_pair16), then its fifth bits as a bit plane (6 bytes a k-step, bit j column j): 5.5 bits a weight,
// the file's size (it was widened to int8, 8.5 bits, until the plane). Q6_K's 6-bit quants are widened to int8 (8
// bits a weight instead of 6.56). The other formats keep their size.
//
// Arithmetic: a group is dequantised into 32 x 48 floats in L1, each weight the float32 value GGML's own
// dequantisation gives, in its order of operations (so a weight's bits are the reference's, gguf-py's
// `dequantize`, worker_svc/quant/formats.py):
//   Q4_0  d * (q - 8)          Q4_1  d * q + m (one rounding: d * q is exact)      Q8_0  d * q   Q5_0  d * (q - 16)
//   Q4_K  (d * sc) * q - dmin * mn (the products exact; one rounding)              Q6_K  (d * sc) * q (one rounding)
// then every row takes one FMA chain per output over k in order, as the float32 panel kernel does (f32_gemm.cpp):
// an output's bits are those of f32_gemm's on the dequantised weight, whatever M, the row's place in the batch, the
// thread count or the ISA (the AVX2 + FMA + F16C kernel computes the AVX-512 one's bits): batch invariant.
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernels/ggml_blocks.h"

extern "C" int ps_cpu_path_cap();  // cpu_path.cpp

namespace {

constexpr int kRows = 8, kRows2 = 4;  // rows a register block: AVX-512 (8 x 3 accumulators), AVX2 (4 x 3)
constexpr int kCap512 = 2, kCap256 = 1;  // cpu_path.cpp's levels
constexpr int kMaxGroup = 32;

// -- repacking the file's blocks ------------------------------------------------------------------------------------
// Column j's quants of group g (of its block `dec`), k-step by k-step, into the group's quants at `q`.
void put_quants(const Layout& lay, const Decoded& dec, int g, int j, uint8_t* q) {
  for (int kk = 0; kk < lay.group; ++kk) {
    const int v = dec.q[g * lay.group + kk];
    if (lay.planes) {  // Q5_0: k-steps 2t, 2t + 1 in byte j of pair t's 48 (low, high nibble); plane: step kk 6 bytes
      q[(kk / 2) * kCols + j] |= static_cast<uint8_t>((v & 0xF) << (4 * (kk % 2)));
      put_plane_bits(lay, v, kk * kCols + j, q + lay.group * (kCols / 2));
    } else if (lay.nibbles) {  // step kk: 24 bytes; column j in run j / 16, byte j % 8, low nibble for j % 16 < 8
      uint8_t& byte = q[kk * (kCols / 2) + (j / 16) * 8 + (j % 8)];
      byte = (j % 16) < 8 ? static_cast<uint8_t>((byte & 0xF0) | v) : static_cast<uint8_t>((byte & 0x0F) | (v << 4));
    } else {
      q[kk * kCols + j] = static_cast<uint8_t>(static_cast<int8_t>(v));
    }
  }
}

#if defined(__x86_64__)
#define PS_Q512 __attribute__((target("avx512f,avx512vl,avx512bw,fma,f16c")))
#define PS_Q256 __attribute__((target("avx2,fma,f16c")))

// -- dequantising a group ------------------------------------------------------------------------------------------
// Columns [16c, 16c + 16) of k-step kk of a group whose quants start at q (a layout without planes).
PS_Q512 inline __m512 quants16(bool nibbles, const uint8_t* q, int kk, int c) {
  if (nibbles) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + kk * (kCols / 2) + 8 * c));
    const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(lo, hi)));
  }
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + kk * kCols + 16 * c))));
}
PS_Q512 inline __m512 weight16(int fmt, bool nibbles, const uint8_t* q, int kk, int c, __m512 a, __m512 b) {
  const __m512 v = quants16(nibbles, q, kk, c);
  if (fmt == kQ4_0) return _mm512_mul_ps(a, _mm512_sub_ps(v, _mm512_set1_ps(8.0f)));
  if (fmt == kQ4_1 || fmt == kQ4_K) return _mm512_fmadd_ps(a, v, b);
  return _mm512_mul_ps(a, v);
}

// Q5_0's weights of columns [16c, 16c + 16), k-steps 2t (even) and 2t + 1 (odd), of a group whose quants start at q:
// each a * float(q - 16), the nibble indexing a table of q - 16 for a clear fifth bit (-16..-1) or a set one
// (0..15), the fifth bits of the step a mask (vpermps reads an index's low 4 bits only: no nibble masking).
PS_Q512 inline void q5_pair16(const uint8_t* q, int group, int t, int c, __m512 a, __m512& even, __m512& odd) {
  const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + t * kCols + 16 * c)));
  const uint8_t* plane = q + group * (kCols / 2) + 2 * t * (kCols / 8) + 2 * c;
  uint16_t even_bits, odd_bits;
  std::memcpy(&even_bits, plane, 2);
  std::memcpy(&odd_bits, plane + kCols / 8, 2);
  const __m512 clear = _mm512_setr_ps(-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5, -4, -3, -2, -1);
  const __m512 set = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i idx_odd = _mm512_srli_epi32(idx, 4);
  even = _mm512_mul_ps(a, _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(idx, clear), even_bits, idx, set));
  odd = _mm512_mul_ps(a, _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(idx_odd, clear), odd_bits, idx_odd, set));
}

// w [G][48] = the group at `grp` dequantised.
PS_Q512 void dequant_group512(int fmt, const Layout& lay, const uint8_t* grp, float* w) {
  const uint8_t* q = grp + lay.header;
  for (int c = 0; c < 3; ++c) {
    __m512 a, b;
    scales16(fmt, grp, c, a, b);
    if (lay.planes) {
      for (int t = 0; t < lay.group / 2; ++t) {
        __m512 even, odd;
        q5_pair16(q, lay.group, t, c, a, even, odd);
        _mm512_store_ps(w + 2 * t * kCols + 16 * c, even);
        _mm512_store_ps(w + (2 * t + 1) * kCols + 16 * c, odd);
      }
    } else {
      for (int kk = 0; kk < lay.group; ++kk)
        _mm512_store_ps(w + kk * kCols + 16 * c, weight16(fmt, lay.nibbles, q, kk, c, a, b));
    }
  }
}

// The AVX2 copy: 8 columns at a time, the same operations on the same values (the same bits).
// (Q5_0: the quant q, its nibble from its pair's byte and its fifth bit from the step's plane byte.)
PS_Q256 inline __m256 quants8(const Layout& lay, const uint8_t* q, int kk, int h) {
  const int c = h / 2, upper = h % 2;
  if (lay.planes) {
    const __m128i pair = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + (kk / 2) * kCols + 8 * h));
    const __m256i b = _mm256_cvtepu8_epi32(pair);
    __m256i v = kk % 2 ? _mm256_srli_epi32(b, 4) : _mm256_and_si256(b, _mm256_set1_epi32(0xF));
    const uint8_t* plane = q + lay.group * (kCols / 2) + kk * (kCols / 8) + h;
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);  // lane i: bit i of the plane's byte
    for (int p = 0; p < lay.planes; ++p) {
      const __m256i byte = _mm256_set1_epi32(plane[p * lay.plane_bytes()]);
      const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(byte, bit), bit);
      v = _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi32(16 << p)));
    }
    return _mm256_cvtepi32_ps(v);
  }
  if (lay.nibbles) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + kk * (kCols / 2) + 8 * c));
    const __m128i v = upper ? _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F)) : _mm_and_si128(b, _mm_set1_epi8(0x0F));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
  }
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + kk * kCols + 8 * h))));
}
PS_Q256 void dequant_group256(int fmt, const Layout& lay, const uint8_t* grp, float* w) {
  const uint8_t* q = grp + lay.header;
  for (int h = 0; h < 6; ++h) {
    __m256 a, b;
    scales8(fmt, grp, h, a, b);
    for (int kk = 0; kk < lay.group; ++kk) {
      __m256 v = quants8(lay, q, kk, h);
      if (zero_of(fmt)) v = _mm256_mul_ps(a, _mm256_sub_ps(v, _mm256_set1_ps(static_cast<float>(zero_of(fmt)))));
      else if (fmt == kQ4_1 || fmt == kQ4_K) v = _mm256_fmadd_ps(a, v, b);
      else v = _mm256_mul_ps(a, v);
      _mm256_store_ps(w + kk * kCols + 8 * h, v);
    }
  }
}

// -- the FMA chains -------------------------------------------------------------------------------------------------
// acc rows [0, R) (48 floats each, rows 48 apart) += x rows [0, R) (lda apart) over k-steps [0, G) of w [G][48].
template <int R, typename T>
PS_Q512 void fma_block512(const T* x, int64_t lda, const float* w, int group, float* acc) {
  __m512 s[R][3];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 3; ++c) s[r][c] = _mm512_load_ps(acc + r * kCols + 16 * c);
  for (int kk = 0; kk < group; ++kk) {
    const __m512 w0 = _mm512_load_ps(w + kk * kCols), w1 = _mm512_load_ps(w + kk * kCols + 16),
                 w2 = _mm512_load_ps(w + kk * kCols + 32);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(widen(x[r * lda + kk]));
      s[r][0] = _mm512_fmadd_ps(xv, w0, s[r][0]);
      s[r][1] = _mm512_fmadd_ps(xv, w1, s[r][1]);
      s[r][2] = _mm512_fmadd_ps(xv, w2, s[r][2]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 3; ++c) _mm512_store_ps(acc + r * kCols + 16 * c, s[r][c]);
}

template <int R, typename T>
PS_Q256 void fma_block256(const T* x, int64_t lda, const float* w, int group, float* acc) {
  for (int c0 = 0; c0 < kCols; c0 += 24) {  // 24 columns (3 vectors) at a time: 4 x 3 accumulators fit 16 registers
    __m256 s[R][3];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 3; ++c) s[r][c] = _mm256_load_ps(acc + r * kCols + c0 + 8 * c);
    for (int kk = 0; kk < group; ++kk) {
      const float* wk = w + kk * kCols + c0;
      const __m256 w0 = _mm256_load_ps(wk), w1 = _mm256_load_ps(wk + 8), w2 = _mm256_load_ps(wk + 16);
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_set1_ps(widen(x[r * lda + kk]));
        s[r][0] = _mm256_fmadd_ps(xv, w0, s[r][0]);
        s[r][1] = _mm256_fmadd_ps(xv, w1, s[r][1]);
        s[r][2] = _mm256_fmadd_ps(xv, w2, s[r][2]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 3; ++c) _mm256_store_ps(acc + r * kCols + c0 + 8 * c, s[r][c]);
  }
}

template <typename T>
using FmaFn = void (*)(const T*, int64_t, const float*, int, float*);
template <typename T>
constexpr FmaFn<T> kFma512[kRows + 1] = {nullptr, fma_block512<1, T>, fma_block512<2, T>, fma_block512<3, T>,
                                         fma_block512<4, T>, fma_block512<5, T>, fma_block512<6, T>,
                                         fma_block512<7, T>, fma_block512<8, T>};
template <typename T>
constexpr FmaFn<T> kFma256[kRows2 + 1] = {nullptr, fma_block256<1, T>, fma_block256<2, T>, fma_block256<3, T>,
                                          fma_block256<4, T>};

// A few rows (decode): each k-step's weights dequantised into registers and used at once, the accumulators kept in
// registers over the whole panel (no group in L1, no stores between groups). Every output is the same FMA chain
// over k from 0.0f on the same weight values as fma_block512's: the same bits, so a row's result does not depend
// on which path its batch's size picks.
constexpr int kDirectRows = 4;
template <int FMT, int R, typename T>
PS_Q512 void direct512(const Layout& lay, const T* x, int64_t lda, const uint8_t* pan, int64_t groups, float* acc) {
  constexpr Layout kLay = layout_of(FMT);  // the layout's, as constants: the k-loop unrolled, no branches
  constexpr int kGroup = kLay.group;
  constexpr bool kNibbles = kLay.nibbles;
  __m512 s[R][3];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 3; ++c) s[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* grp = pan + g * lay.group_bytes();
    const uint8_t* q = grp + lay.header;
    prefetch_group(grp + lay.group_bytes(), lay.group_bytes());
    __m512 a[3], b[3];
    for (int c = 0; c < 3; ++c) scales16(FMT, grp, c, a[c], b[c]);
    const T* xg = x + g * kGroup;
    if constexpr (kLay.planes) {  // Q5_0: k-steps by pairs, each pair's quants one load
#pragma GCC unroll 2
      for (int t = 0; t < kGroup / 2; ++t) {
        __m512 even[3], odd[3];
        for (int c = 0; c < 3; ++c) q5_pair16(q, kGroup, t, c, a[c], even[c], odd[c]);
        for (int r = 0; r < R; ++r) {
          const __m512 xv = _mm512_set1_ps(widen(xg[r * lda + 2 * t]));
          for (int c = 0; c < 3; ++c) s[r][c] = _mm512_fmadd_ps(xv, even[c], s[r][c]);
        }
        for (int r = 0; r < R; ++r) {
          const __m512 xv = _mm512_set1_ps(widen(xg[r * lda + 2 * t + 1]));
          for (int c = 0; c < 3; ++c) s[r][c] = _mm512_fmadd_ps(xv, odd[c], s[r][c]);
        }
      }
    } else {
#pragma GCC unroll 4
      for (int kk = 0; kk < kGroup; ++kk) {
        const __m512 w0 = weight16(FMT, kNibbles, q, kk, 0, a[0], b[0]),
                     w1 = weight16(FMT, kNibbles, q, kk, 1, a[1], b[1]),
                     w2 = weight16(FMT, kNibbles, q, kk, 2, a[2], b[2]);
        for (int r = 0; r < R; ++r) {
          const __m512 xv = _mm512_set1_ps(widen(xg[r * lda + kk]));
          s[r][0] = _mm512_fmadd_ps(xv, w0, s[r][0]);
          s[r][1] = _mm512_fmadd_ps(xv, w1, s[r][1]);
          s[r][2] = _mm512_fmadd_ps(xv, w2, s[r][2]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 3; ++c) _mm512_store_ps(acc + r * kCols + 16 * c, s[r][c]);
}

template <int FMT, typename T>
PS_Q512 void direct512_rows(const Layout& lay, const T* x, int64_t m, int64_t k, const uint8_t* pan, float* acc) {
  const int64_t groups = k / lay.group;
  switch (m) {
    case 1: direct512<FMT, 1>(lay, x, k, pan, groups, acc); break;
    case 2: direct512<FMT, 2>(lay, x, k, pan, groups, acc); break;
    case 3: direct512<FMT, 3>(lay, x, k, pan, groups, acc); break;
    default: direct512<FMT, 4>(lay, x, k, pan, groups, acc); break;
  }
}

template <typename T>
PS_Q512 void direct512_any(int fmt, const Layout& lay, const T* x, int64_t m, int64_t k, const uint8_t* pan, float* acc) {
  switch (fmt) {
    case kQ4_0: direct512_rows<kQ4_0>(lay, x, m, k, pan, acc); break;
    case kQ4_1: direct512_rows<kQ4_1>(lay, x, m, k, pan, acc); break;
    case kQ5_0: direct512_rows<kQ5_0>(lay, x, m, k, pan, acc); break;
    case kQ8_0: direct512_rows<kQ8_0>(lay, x, m, k, pan, acc); break;
    case kQ4_K: direct512_rows<kQ4_K>(lay, x, m, k, pan, acc); break;
    default: direct512_rows<kQ6_K>(lay, x, m, k, pan, acc); break;
  }
}

#endif

// The widest kernel this CPU runs within the process's CPU path: 512, 256 or 0.
int q_width() {
#if defined(__x86_64__)
  static const int native = cpu_has_avx512() ? 512 : cpu_has(5, false) ? 256 : 0;
  const int cap = ps_cpu_path_cap();
  if (native == 512 && cap >= kCap512) return 512;
  return native >= 256 && cap >= kCap256 ? 256 : 0;
#else
  return 0;
#endif
}

#if defined(__x86_64__)
// One panel's rows through the group-in-L1 path: each group dequantised once into w, then every row's FMA chains.
template <typename T>
void grouped(int width, int fmt, const Layout& lay, const T* x, int64_t m, int64_t k, const uint8_t* pan, float* acc,
             float* w) {
  std::memset(acc, 0, sizeof(float) * static_cast<size_t>(m * kCols));
  for (int64_t g = 0; g < k / lay.group; ++g) {
    const uint8_t* grp = pan + g * lay.group_bytes();
    prefetch_group(grp + lay.group_bytes(), lay.group_bytes());
    if (width == 512) dequant_group512(fmt, lay, grp, w);
    else dequant_group256(fmt, lay, grp, w);
    const T* xg = x + g * lay.group;
    if (width == 512) {
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const int64_t rows = m - r0 < kRows ? m - r0 : kRows;
        kFma512<T>[rows](xg + r0 * k, k, w, lay.group, acc + r0 * kCols);
      }
    } else {
      for (int64_t r0 = 0; r0 < m; r0 += kRows2) {
        const int64_t rows = m - r0 < kRows2 ? m - r0 : kRows2;
        kFma256<T>[rows](xg + r0 * k, k, w, lay.group, acc + r0 * kCols);
      }
    }
  }
}

// One panel: every row of x against its groups (a few rows: the direct path; the same bits), then bias and the
// stores. acc: M x 48 floats (64-byte aligned).
template <typename T>
void panel(int width, int fmt, const Layout& lay, const T* x, int64_t m, int64_t k, const uint8_t* pan,
           const T* bias, T* out, int64_t n, int64_t cols, float* acc, float* w) {
  if (width == 512 && m <= kDirectRows) direct512_any(fmt, lay, x, m, k, pan, acc);
  else grouped(width, fmt, lay, x, m, k, pan, acc, w);
  for (int64_t r = 0; r < m; ++r)  // the epilogue f32_gemm.cpp's store_rows has: acc + bias (float32), stored as T
    for (int64_t c = 0; c < cols; ++c) store(out + r * n + c, acc[r * kCols + c] + (bias ? widen(bias[c]) : 0.0f));
}

template <typename T>
void linear(int width, int fmt, const T* x, int64_t m, int64_t k, const uint8_t* packed, int64_t n, const T* bias,
            T* out) {
  const Layout lay = layout_of(fmt);
  const int64_t panels = (n + kCols - 1) / kCols, panel_bytes = k / lay.group * lay.group_bytes();
#pragma omp parallel if (panels > 1)
  {
    const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t p0 = panels * me / threads, p1 = panels * (me + 1) / threads;
    // NOTE: the accumulators of every row and one dequantised group, per thread (L2 and L1)
    std::vector<float> scratch(static_cast<size_t>((m + kMaxGroup) * kCols + 16));
    float* acc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
    float* w = acc + m * kCols;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t cols = n - p * kCols < kCols ? n - p * kCols : kCols;
      panel(width, fmt, lay, x, m, k, packed + p * panel_bytes, bias ? bias + p * kCols : nullptr, out + p * kCols, n,
            cols, acc, w);
    }
  }
}
#endif

template <typename T>
int run_linear(int fmt, const T* x, int64_t m, int64_t k, const uint8_t* packed, int64_t n, const T* bias, T* out) {
  const Layout lay = layout_of(fmt);
  if (!lay.group || m < 0 || n <= 0 || k <= 0 || k % lay.block_k) return 1;
  const int width = q_width();
  if (width == 0) return 2;
  if (m == 0) return 0;
#if defined(__x86_64__)
  linear(width, fmt, x, m, k, packed, n, bias, out);
#endif
  return 0;
}

}  // namespace

extern "C" {

// The kernel this CPU runs within the process's CPU path: 512 (AVX-512), 256 (AVX2 + FMA + F16C) or 0 (none).
int ps_q_available() { return q_width(); }

// Bytes ps_q_pack writes for W [n, k] in format `fmt` (a GGML type id); 0 for a format or shape it does not take.
int64_t ps_q_packed_size(int fmt, int64_t n, int64_t k) {
  const Layout lay = layout_of(fmt);
  if (!lay.group || n <= 0 || k <= 0 || k % lay.block_k) return 0;
  return (n + kCols - 1) / kCols * (k / lay.group) * lay.group_bytes();
}

// The file's blocks of W [n, k] (row j: k / block_k blocks, `blocks + j * row_bytes`) repacked into panels at
// `packed` (ps_q_packed_size bytes). 1: an unknown format or a k that is not whole blocks.
int ps_q_pack(int fmt, const uint8_t* blocks, int64_t n, int64_t k, uint8_t* packed) {
  return pack_panels(fmt, blocks, n, k, packed, put_quants);
}

// out [m, n] = x [m, k] . W^T (+ bias [n]), x and out contiguous, W packed by ps_q_pack. 1: bad arguments; 2: no
// kernel runs here (ps_q_available() == 0).
int ps_q_linear_f32(int fmt, const float* x, int64_t m, int64_t k, const uint8_t* packed, int64_t n, const float* bias,
                    float* out) {
  return run_linear(fmt, x, m, k, packed, n, bias, out);
}
int ps_q_linear_bf16(int fmt, const bf16* x, int64_t m, int64_t k, const uint8_t* packed, int64_t n, const bf16* bias,
                     bf16* out) {
  return run_linear(fmt, x, m, k, packed, n, bias, out);
}

}  // extern "C"
