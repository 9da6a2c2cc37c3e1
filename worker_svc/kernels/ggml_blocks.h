// GGML's block formats as the quantised matmuls (q_gemm.cpp: float activations; q8a_gemm.cpp: int8 activations)
// read them: the formats' ids, a file block decoded into its quants and scales, and the packed panels' headers (the
// scales of 48 output columns a group, as the file holds them). Shared so that both kernels decode a block one way.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "bf16.h"

namespace {

constexpr int64_t kCols = 48;  // output columns a panel

enum Format : int { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14 };  // GGML's type ids

struct Layout {
  int block_k = 0, block_bytes = 0;  // the file's block: weights and bytes
  int group = 0;                     // k-steps a packed group
  int header = 0;                    // header bytes a packed group (48 columns)
  bool nibbles = false;              // 4-bit quants (else int8)
  // Bit planes after a group's nibbles, one a bit above them (Q5_0: 1, the fifth bit): a quant is its nibble | plane
  // 0's bit << 4 | ..., unsigned; each plane one bit a weight (group * 48 / 8 bytes), in the kernel's own order.
  int planes = 0;
  constexpr int64_t plane_bytes() const { return group * kCols / 8; }
  constexpr int64_t group_bytes() const {
    return header + group * (nibbles ? kCols / 2 : kCols) + planes * plane_bytes();
  }
};

constexpr Layout layout_of(int fmt) {
  switch (fmt) {
    case kQ4_0: return {32, 18, 32, 2 * kCols, true};
    case kQ4_1: return {32, 20, 32, 4 * kCols, true};
    case kQ8_0: return {32, 34, 32, 2 * kCols, false};
    case kQ5_0: return {32, 22, 32, 2 * kCols, true, 1};  // d (fp16); nibbles and the fifth bits' plane: 5.5 bits
    case kQ4_K: return {256, 144, 32, 6 * kCols, true};  // d, dmin (fp16), sc, mn (6-bit, a byte each)
    case kQ6_K: return {256, 210, 16, 3 * kCols, false};  // d (fp16), sc (int8)
    default: return {};
  }
}

// The unsigned quant that dequantises to 0 (Q4_0: 8, Q5_0: 16), which the kernels subtract; 0: the quants are signed
// or a min is added.
constexpr int zero_of(int fmt) { return fmt == kQ4_0 ? 8 : fmt == kQ5_0 ? 16 : 0; }

// Quant v's bits above its nibble into the planes at `planes` (the layout's count, plane_bytes() apart), as bit
// `bit` of each: the place a kernel's own order gives the weight.
inline void put_plane_bits(const Layout& lay, int v, int64_t bit, uint8_t* planes) {
  for (int p = 0; p < lay.planes; ++p)
    planes[p * lay.plane_bytes() + bit / 8] |= static_cast<uint8_t>(((v >> (4 + p)) & 1) << (bit % 8));
}

inline void store(float* p, float v) { *p = v; }
inline void store(bf16* p, float v) { *p = narrow_bf16(v); }

// One block of the file decoded: each weight's quant (4-bit formats: 0..15; Q5_0: 0..31; Q8_0: int8; Q6_K: q - 32)
// and, per group of the block, its header fields.
struct Decoded {
  int q[256];
  uint16_t d[16], m[16];  // fp16 bits by group (m: Q4_1's min, Q4_K's dmin)
  int sc[16], mn[16];     // Q4_K: 6-bit scale and min by group; Q6_K: int8 scale by group
};

inline void decode_block(int fmt, const uint8_t* b, Decoded& out) {
  auto u16 = [](const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); };
  switch (fmt) {
    case kQ4_0:
    case kQ4_1: {
      const int off = fmt == kQ4_0 ? 2 : 4;
      out.d[0] = u16(b);
      out.m[0] = fmt == kQ4_1 ? u16(b + 2) : 0;
      for (int j = 0; j < 16; ++j) out.q[j] = b[off + j] & 0xF, out.q[j + 16] = b[off + j] >> 4;
      return;
    }
    case kQ8_0:
      out.d[0] = u16(b);
      for (int j = 0; j < 32; ++j) out.q[j] = static_cast<int8_t>(b[2 + j]);
      return;
    case kQ5_0: {  // weight i's fifth bit: bit i of qh (little-endian); nibbles as Q4_0's
      out.d[0] = u16(b);
      const uint32_t qh = b[2] | (b[3] << 8) | (b[4] << 16) | (static_cast<uint32_t>(b[5]) << 24);
      for (int j = 0; j < 16; ++j) {
        out.q[j] = (b[6 + j] & 0xF) | (((qh >> j) & 1) << 4);
        out.q[j + 16] = (b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      }
      return;
    }
    case kQ4_K: {
      const uint8_t* s = b + 4;
      for (int j = 0; j < 8; ++j) {
        out.d[j] = u16(b), out.m[j] = u16(b + 2);
        if (j < 4) out.sc[j] = s[j] & 63, out.mn[j] = s[j + 4] & 63;
        else out.sc[j] = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), out.mn[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
      }
      const uint8_t* qs = b + 16;
      for (int c = 0; c < 4; ++c)  // 64 weights a chunk: sub-block 2c in the low nibbles, 2c + 1 in the high ones
        for (int l = 0; l < 32; ++l) out.q[64 * c + l] = qs[32 * c + l] & 0xF, out.q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
      return;
    }
    case kQ6_K: {
      const uint8_t *ql = b, *qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const uint16_t d = u16(b + 208);
      for (int h = 0; h < 2; ++h)  // two halves of 128 weights: ql 64 bytes, qh 32 bytes each
        for (int l = 0; l < 32; ++l) {
          const uint8_t *L = ql + 64 * h, *H = qh + 32 * h;
          int* q = out.q + 128 * h;
          q[l] = ((L[l] & 0xF) | (((H[l] >> 0) & 3) << 4)) - 32;
          q[l + 32] = ((L[l + 32] & 0xF) | (((H[l] >> 2) & 3) << 4)) - 32;
          q[l + 64] = ((L[l] >> 4) | (((H[l] >> 4) & 3) << 4)) - 32;
          q[l + 96] = ((L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4)) - 32;
        }
      for (int g = 0; g < 16; ++g) out.d[g] = d, out.sc[g] = sc[g];
      return;
    }
  }
}

// Writes column j's scales of group g (of its block `dec`) into the header of the packed group at `dst`: each
// field a row of 48 columns (fp16 d; Q4_1's m; Q4_K's dmin, then its 6-bit sc and mn a byte each; Q6_K's int8 sc).
inline void put_header(int fmt, const Decoded& dec, int g, int j, uint8_t* dst) {
  auto put16 = [&](int slot, uint16_t v) { std::memcpy(dst + 2 * (slot * kCols + j), &v, 2); };
  switch (fmt) {
    case kQ4_0: case kQ5_0: case kQ8_0: put16(0, dec.d[g]); break;
    case kQ4_1: put16(0, dec.d[g]), put16(1, dec.m[g]); break;
    case kQ4_K:
      put16(0, dec.d[g]), put16(1, dec.m[g]);
      dst[4 * kCols + j] = static_cast<uint8_t>(dec.sc[g]), dst[5 * kCols + j] = static_cast<uint8_t>(dec.mn[g]);
      break;
    case kQ6_K: put16(0, dec.d[g]), dst[2 * kCols + j] = static_cast<uint8_t>(static_cast<int8_t>(dec.sc[g])); break;
  }
}

// The file's blocks of W [n, k] repacked into panels of 48 columns and groups of the layout's k-steps at `packed`: each
// group's header (put_header), then its quants (nibbles or int8, then any bit planes) as the kernel's
// put_quants(lay, dec, g, j, quants) lays them out (it ORs plane bits into the zeroed group).
// Columns past n are zero. 1: an unknown format or a k that is not whole blocks.
template <typename PutQuants>
int pack_panels(int fmt, const uint8_t* blocks, int64_t n, int64_t k, uint8_t* packed, PutQuants put_quants) {
  const Layout lay = layout_of(fmt);
  if (!lay.group || n <= 0 || k <= 0 || k % lay.block_k) return 1;
  const int64_t groups = k / lay.group, row_bytes = k / lay.block_k * lay.block_bytes;
  const int64_t panels = (n + kCols - 1) / kCols, per_block = lay.block_k / lay.group;
  std::memset(packed, 0, static_cast<size_t>(panels * groups * lay.group_bytes()));
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    Decoded dec;
    for (int64_t j = 0; j < kCols && p * kCols + j < n; ++j) {
      const uint8_t* row = blocks + (p * kCols + j) * row_bytes;
      for (int64_t blk = 0; blk < k / lay.block_k; ++blk) {
        decode_block(fmt, row + blk * lay.block_bytes, dec);
        for (int64_t g = 0; g < per_block; ++g) {
          uint8_t* dst = packed + (p * groups + blk * per_block + g) * lay.group_bytes();
          put_header(fmt, dec, static_cast<int>(g), static_cast<int>(j), dst);
          put_quants(lay, dec, static_cast<int>(g), static_cast<int>(j), dst + lay.header);
        }
      }
    }
  }
  return 0;
}

#if defined(__x86_64__)
// -- a packed group's scales, in registers --------------------------------------------------------------------------
// Columns [16c, 16c + 16) (AVX-512) or [8h, 8h + 8) (AVX2) of a group: w = a * q + b (Q4_1, Q4_K), a * (q - 8)
// (Q4_0: the - 8 is the kernel's; Q5_0: a * (q - 16)), a * q (Q8_0, Q6_K). The same operations in both widths and
// both kernels: the same scale bits. NOTE: a function of fewer target features inlines into one of more.
#define PS_GGML512 __attribute__((target("avx512f,avx512vl,avx512bw,fma,f16c")))
#define PS_GGML256 __attribute__((target("avx2,fma,f16c")))
PS_GGML512 inline __m512 half16(const uint8_t* h, int slot, int c) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 2 * (slot * kCols + 16 * c))));
}
PS_GGML512 inline __m512 bytes16(const uint8_t* h, int offset, int c, bool is_signed) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + offset + 16 * c));
  return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
}
PS_GGML512 inline void scales16(int fmt, const uint8_t* grp, int c, __m512& a, __m512& b) {
  a = half16(grp, 0, c), b = _mm512_setzero_ps();
  if (fmt == kQ4_1) b = half16(grp, 1, c);
  if (fmt == kQ4_K) {
    a = _mm512_mul_ps(a, bytes16(grp, 4 * kCols, c, false));
    b = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(half16(grp, 1, c), bytes16(grp, 5 * kCols, c, false)));
  }
  if (fmt == kQ6_K) a = _mm512_mul_ps(a, bytes16(grp, 2 * kCols, c, true));
}

PS_GGML256 inline __m256 half8(const uint8_t* grp, int slot, int h) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(grp + 2 * (slot * kCols + 8 * h))));
}
PS_GGML256 inline __m256 bytes8(const uint8_t* grp, int offset, int h, bool is_signed) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(grp + offset + 8 * h));
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
}
PS_GGML256 inline void scales8(int fmt, const uint8_t* grp, int h, __m256& a, __m256& b) {
  a = half8(grp, 0, h), b = _mm256_setzero_ps();
  if (fmt == kQ4_1) b = half8(grp, 1, h);
  if (fmt == kQ4_K) {
    a = _mm256_mul_ps(a, bytes8(grp, 4 * kCols, h, false));
    b = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(half8(grp, 1, h), bytes8(grp, 5 * kCols, h, false)));
  }
  if (fmt == kQ6_K) a = _mm256_mul_ps(a, bytes8(grp, 2 * kCols, h, true));
}

// The packed group at `grp` (`bytes`) fetched towards L1 ahead of its use: a kernel asks for a group ahead of the
// one it works on (q_gemm: the next; q8a_gemm, whose groups take less time: the one after). NOTE: a weight streamed
// from memory (a model's layers, past the L3) otherwise stalls on each group's first lines: the grouped path's FMA
// phase issues no loads, so the hardware prefetcher falls behind (the float kernel at 8 rows, 1536 x 576 Q8_0 or
// Q5_0 weights: ~1.3x the time of the same weight in cache without it). A prefetch past the panel's end is harmless
// (it never faults).
inline void prefetch_group(const uint8_t* grp, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(grp + b), _MM_HINT_T0);
}

// -- the CPU's features -------------------------------------------------------------------------------------------
inline bool cpu_has(int leaf7_ebx_bit, bool need_avx512_state) {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(b & (1u << leaf7_ebx_bit))) return false;
  // OSXSAVE, FMA, F16C
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27)) || !(c & (1u << 12)) || !(c & (1u << 29))) return false;
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return need_avx512_state ? (lo & 0xe6u) == 0xe6u : (lo & 0x6u) == 0x6u;
}

inline bool cpu_has_avx512() {
  unsigned a, b, c, d;
  return cpu_has(16, true) && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & (1u << 31)) && (b & (1u << 30));
}
#endif

}  // namespace
