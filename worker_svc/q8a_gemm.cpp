// Quantised matmuls with int8 activations (worker_svc/quant/kernel.py's Int8ActKernel; a worker's
// --activation-dtype int8): out = x . W^T (+ bias) for x [M, K] float32 or bfloat16 and W [N, K] kept in a GGML block
// format (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K), as llama.cpp's CPU kernels multiply them: each row of x is quantised
// to int8 per 32 inputs, then every product of a group is an integer dot product (AVX-512 VNNI vpdpbusd; AVX2
// vpmaddubsw), scaled once in float32. Built into the CPU kernel library (cpu_build.py).
//
// The numbers (the contract tests/support/q8a_reference.py computes in numpy, bit for bit, on both instruction sets):
//   activations, each block of 32 inputs of a row: d = amax / 127 (float32 division), id = d ? 1 / d : 0,
//     q = round-half-even(x * id) (in [-127, 127]); s = the sum of the q's of each weight group (16 or 32 inputs)
//   a weight group (G inputs, one output column): w = a * q_w + b as the file defines it (formats.py: Q4_0 a(q - 8),
//     Q4_1 d q + m, Q5_0 d (q - 16), Q8_0 d q, Q4_K (d sc) q - dmin mn, Q6_K (d sc) (q - 32)); i = sum q * q_w in
//     int32 (exact: no rounding, whatever the instruction set)
//   acc = fma(d * a, float(i), acc), then for formats with a min (Q4_1, Q4_K) acc = fma(d * b, float(s), acc),
//     over the groups in order from 0.0f; out = acc + bias, stored as x's dtype (bfloat16: nearest even)
// A row's result depends on nothing but that row: batch invariant, and the AVX2 kernel computes the VNNI one's bits.
//
// Layout (ps_q8a_pack): q_gemm.cpp's panels of 48 output columns and groups of G k-steps with the same headers, but
// the quants of a group in VNNI order: 4 consecutive k-steps of one column are 4 adjacent bytes, so one 32-bit lane
// of vpdpbusd is one output column. int8 formats (Q8_0, Q6_K widened to int8 as q - 32): G / 4 runs of 48 x 4 signed
// bytes; 4-bit formats: k-steps 8p..8p+3 in the low nibbles and 8p+4..8p+7 in the high nibbles of run p (4 runs of
// 48 x 4 bytes). Q5_0: its low 4 bits as the 4-bit formats', then its fifth bits as a bit plane in the int8 order (bit
// ((kk / 4) * 48 + j) * 4 + kk % 4 for k-step kk of column j: one bit a byte of a vpdpbusd operand, a byte mask),
// added to the nibbles as 16 to make the unsigned 5-bit q; the - 16 comes off the integer sum as Q4_0's - 8 does.
// Same size as q_gemm's packing (ps_q_packed_size).
#include <cmath>
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

constexpr int kCapVnni = 3, kCap256 = 1;  // cpu_path.cpp's levels: VNNI is hidden below avx512-bf16
constexpr int kActBlock = 32;              // inputs an activation scale covers
constexpr int kRowBlock = 4;               // rows a register block (VNNI: 4 x (3 int + 3 float) accumulators)

// -- packing --------------------------------------------------------------------------------------------------------
void put_quants(const Layout& lay, const Decoded& dec, int g, int j, uint8_t* q) {
  for (int kk = 0; kk < lay.group; ++kk) {
    const int v = dec.q[g * lay.group + kk];
    if (lay.nibbles) {  // run kk / 8; the high nibble for kk % 8 >= 4
      uint8_t& byte = q[((kk / 8) * kCols + j) * 4 + kk % 4];
      const int nib = v & 0xF;
      byte = (kk % 8) < 4 ? static_cast<uint8_t>((byte & 0xF0) | nib)
                          : static_cast<uint8_t>((byte & 0x0F) | (nib << 4));
      // a plane: the bit at the place the weight's byte has in the int8 order (4 k-steps of a column adjacent)
      put_plane_bits(lay, v, ((kk / 4) * kCols + j) * 4 + kk % 4, q + lay.group * (kCols / 2));
    } else {
      q[((kk / 4) * kCols + j) * 4 + kk % 4] = static_cast<uint8_t>(static_cast<int8_t>(v));
    }
  }
}

// -- the activations ------------------------------------------------------------------------------------------------
// Row r of x quantised: qx [k] int8, dx [k / 32] (each block's scale d), sx [k / 16] (the sums of 16 q's).
template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* qx, float* dx, int32_t* sx) {
  for (int64_t b = 0; b < k / kActBlock; ++b) {
    float amax = 0.0f;
    for (int j = 0; j < kActBlock; ++j) amax = std::fmax(amax, std::fabs(widen(x[b * kActBlock + j])));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    dx[b] = d;
    for (int h = 0; h < 2; ++h) {
      int32_t sum = 0;
      for (int j = 16 * h; j < 16 * h + 16; ++j) {
        const float v = std::nearbyint(widen(x[b * kActBlock + j]) * id);  // round half even (the default mode)
        const int q = static_cast<int>(v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v);
        qx[b * kActBlock + j] = static_cast<int8_t>(q);
        sum += q;
      }
      sx[2 * b + h] = sum;
    }
  }
}

struct Rows {  // the quantised activations of the rows a call multiplies
  const int8_t* qx;
  const float* dx;
  const int32_t* sx;
  int64_t k;
};

// The integer correction and the float epilogue of one group, the same for every instruction set: i is the raw
// integer sum the instructions give (VNNI: int8 weights offset by 128; AVX2: signed), s the group's activation sum.
constexpr bool has_min(int fmt) { return fmt == kQ4_1 || fmt == kQ4_K; }
constexpr int offset_of(int fmt, bool offset_int8) {
  return zero_of(fmt) ? zero_of(fmt) : (fmt == kQ8_0 || fmt == kQ6_K) && offset_int8 ? 128 : 0;
}

#if defined(__x86_64__)
#define PS_Q8A512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512vnni,fma,f16c")))
#define PS_Q8A256 __attribute__((target("avx2,fma,f16c")))

// R rows [r0, r0 + R) against one panel: acc [R][48].
template <int FMT, int R>
PS_Q8A512 void rows512(const Rows& x, int64_t r0, const uint8_t* pan, float* acc) {
  constexpr Layout lay = layout_of(FMT);
  constexpr int kGroup = lay.group, kOffset = offset_of(FMT, true);
  const int64_t groups = x.k / kGroup;
  __m512 f[R][3];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 3; ++c) f[r][c] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* grp = pan + g * lay.group_bytes();
    const uint8_t* q = grp + lay.header;
    const uint8_t* plane = q + kGroup * (kCols / 2);
    prefetch_group(grp + 2 * lay.group_bytes(), lay.group_bytes());
    __m512i acc_i[R][3];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 3; ++c) acc_i[r][c] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int i = 0; i < kGroup / 4; ++i) {
      __m512i w[3];
      for (int c = 0; c < 3; ++c) {
        if constexpr (lay.nibbles) {
          const __m512i v = _mm512_loadu_si512(q + ((i / 2) * kCols + 16 * c) * 4);
          w[c] = i % 2 ? _mm512_and_si512(_mm512_srli_epi16(v, 4), low4) : _mm512_and_si512(v, low4);
          for (int p = 0; p < lay.planes; ++p) {  // bits (i * 48 + 16c) * 4 on: one a byte of w, a mask
            uint64_t bits;
            std::memcpy(&bits, plane + p * lay.plane_bytes() + i * (kCols / 2) + 8 * c, 8);
            w[c] = _mm512_mask_add_epi8(w[c], bits, w[c], _mm512_set1_epi8(static_cast<char>(16 << p)));
          }
        } else {  // signed int8 as unsigned: q + 128 (the offset comes off below)
          w[c] = _mm512_xor_si512(_mm512_loadu_si512(q + (i * kCols + 16 * c) * 4), flip);
        }
      }
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, x.qx + (r0 + r) * x.k + g * kGroup + 4 * i, 4);
        const __m512i xv = _mm512_set1_epi32(four);
        for (int c = 0; c < 3; ++c) acc_i[r][c] = _mm512_dpbusd_epi32(acc_i[r][c], w[c], xv);
      }
    }
    __m512 a[3], b[3];
    for (int c = 0; c < 3; ++c) scales16(FMT, grp, c, a[c], b[c]);
    for (int r = 0; r < R; ++r) {
      const int32_t* sx = x.sx + (r0 + r) * (x.k / 16) + g * (kGroup / 16);
      const int32_t s = kGroup == 32 ? sx[0] + sx[1] : sx[0];
      const __m512 d = _mm512_set1_ps(x.dx[(r0 + r) * (x.k / kActBlock) + g * kGroup / kActBlock]);
      const __m512i off = _mm512_set1_epi32(kOffset * s);
      for (int c = 0; c < 3; ++c) {
        const __m512 i_f = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc_i[r][c], off));
        f[r][c] = _mm512_fmadd_ps(_mm512_mul_ps(d, a[c]), i_f, f[r][c]);
        if constexpr (has_min(FMT))
          f[r][c] = _mm512_fmadd_ps(_mm512_mul_ps(d, b[c]), _mm512_set1_ps(static_cast<float>(s)), f[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 3; ++c) _mm512_store_ps(acc + r * kCols + 16 * c, f[r][c]);
}

template <int FMT>
PS_Q8A512 void panel512(const Rows& x, int64_t m, const uint8_t* pan, float* acc) {
  for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
    float* a = acc + r0 * kCols;
    switch (m - r0 < kRowBlock ? m - r0 : kRowBlock) {
      case 1: rows512<FMT, 1>(x, r0, pan, a); break;
      case 2: rows512<FMT, 2>(x, r0, pan, a); break;
      case 3: rows512<FMT, 3>(x, r0, pan, a); break;
      default: rows512<FMT, 4>(x, r0, pan, a); break;
    }
  }
}

// 32 bits spread over 32 bytes: byte n 0xFF where bit n is set, else 0.
PS_Q8A256 inline __m256i spread_bits(uint32_t bits) {
  const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3,
                                        3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));  // byte n: bit n % 8
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(bits)), pick);
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

// The AVX2 kernel: one row, 8 columns a vector, vpmaddubsw (unsigned x signed byte pairs summed into int16, which
// cannot saturate here: 4-bit weights give at most 2 x 15 x 127, Q5_0's 5-bit ones 2 x 31 x 127; int8 weights go in
// as |w| against x with w's sign, at most 2 x 128 x 127) and vpmaddwd by ones into int32: the same integer sums as
// vpdpbusd, the same epilogue.
template <int FMT>
PS_Q8A256 void row256(const Rows& x, int64_t r, const uint8_t* pan, float* acc) {
  constexpr Layout lay = layout_of(FMT);
  constexpr int kGroup = lay.group, kOffset = offset_of(FMT, false);
  const int64_t groups = x.k / kGroup;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 f[6];
  for (int h = 0; h < 6; ++h) f[h] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* grp = pan + g * lay.group_bytes();
    const uint8_t* q = grp + lay.header;
    const uint8_t* plane = q + kGroup * (kCols / 2);
    prefetch_group(grp + 2 * lay.group_bytes(), lay.group_bytes());
    __m256i acc_i[6];
    for (int h = 0; h < 6; ++h) acc_i[h] = _mm256_setzero_si256();
    for (int i = 0; i < kGroup / 4; ++i) {
      int32_t four;
      std::memcpy(&four, x.qx + r * x.k + g * kGroup + 4 * i, 4);
      const __m256i xv = _mm256_set1_epi32(four);
      for (int h = 0; h < 6; ++h) {
        __m256i pairs;
        if constexpr (lay.nibbles) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + ((i / 2) * kCols + 8 * h) * 4));
          __m256i w = i % 2 ? _mm256_and_si256(_mm256_srli_epi16(v, 4), low4) : _mm256_and_si256(v, low4);
          for (int p = 0; p < lay.planes; ++p) {  // bits (i * 48 + 8h) * 4 on: one a byte of w
            uint32_t bits;
            std::memcpy(&bits, plane + p * lay.plane_bytes() + i * (kCols / 2) + 4 * h, 4);
            w = _mm256_add_epi8(w, _mm256_and_si256(spread_bits(bits), _mm256_set1_epi8(static_cast<char>(16 << p))));
          }
          pairs = _mm256_maddubs_epi16(w, xv);
        } else {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (i * kCols + 8 * h) * 4));
          pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w));
        }
        acc_i[h] = _mm256_add_epi32(acc_i[h], _mm256_madd_epi16(pairs, ones));
      }
    }
    const int32_t* sx = x.sx + r * (x.k / 16) + g * (kGroup / 16);
    const int32_t s = kGroup == 32 ? sx[0] + sx[1] : sx[0];
    const __m256 d = _mm256_set1_ps(x.dx[r * (x.k / kActBlock) + g * kGroup / kActBlock]);
    const __m256i off = _mm256_set1_epi32(kOffset * s);
    for (int h = 0; h < 6; ++h) {
      __m256 a, b;
      scales8(FMT, grp, h, a, b);
      const __m256 i_f = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc_i[h], off));
      f[h] = _mm256_fmadd_ps(_mm256_mul_ps(d, a), i_f, f[h]);
      if constexpr (has_min(FMT))
        f[h] = _mm256_fmadd_ps(_mm256_mul_ps(d, b), _mm256_set1_ps(static_cast<float>(s)), f[h]);
    }
  }
  for (int h = 0; h < 6; ++h) _mm256_store_ps(acc + 8 * h, f[h]);
}

template <int FMT>
PS_Q8A256 void panel256(const Rows& x, int64_t m, const uint8_t* pan, float* acc) {
  for (int64_t r = 0; r < m; ++r) row256<FMT>(x, r, pan, acc + r * kCols);
}

using PanelFn = void (*)(const Rows&, int64_t, const uint8_t*, float*);

PanelFn panel_fn(int width, int fmt) {
  switch (fmt) {
    case kQ4_0: return width == 512 ? panel512<kQ4_0> : panel256<kQ4_0>;
    case kQ4_1: return width == 512 ? panel512<kQ4_1> : panel256<kQ4_1>;
    case kQ5_0: return width == 512 ? panel512<kQ5_0> : panel256<kQ5_0>;
    case kQ8_0: return width == 512 ? panel512<kQ8_0> : panel256<kQ8_0>;
    case kQ4_K: return width == 512 ? panel512<kQ4_K> : panel256<kQ4_K>;
    case kQ6_K: return width == 512 ? panel512<kQ6_K> : panel256<kQ6_K>;
    default: return nullptr;
  }
}

bool cpu_has_vnni() {
  unsigned a, b, c, d;
  return cpu_has_avx512() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (c & (1u << 11));  // AVX512_VNNI
}
#endif

// The kernel this CPU runs within the process's CPU path: 512 (AVX-512 VNNI), 256 (AVX2) or 0.
int q8a_width() {
#if defined(__x86_64__)
  static const int native = cpu_has_vnni() ? 512 : cpu_has(5, false) ? 256 : 0;
  const int cap = ps_cpu_path_cap();
  if (native == 512 && cap >= kCapVnni) return 512;
  return native >= 256 && cap >= kCap256 ? 256 : 0;
#else
  return 0;
#endif
}

template <typename T>
int run_linear(int fmt, const T* x, int64_t m, int64_t k, const uint8_t* packed, int64_t n, const T* bias, T* out) {
  const Layout lay = layout_of(fmt);
  if (!lay.group || m < 0 || n <= 0 || k <= 0 || k % lay.block_k || k % kActBlock) return 1;
  const int width = q8a_width();
  if (width == 0) return 2;
  if (m == 0) return 0;
#if defined(__x86_64__)
  std::vector<int8_t> qx(static_cast<size_t>(m * k));
  std::vector<float> dx(static_cast<size_t>(m * (k / kActBlock)));
  std::vector<int32_t> sx(static_cast<size_t>(m * (k / 16)));
#pragma omp parallel for schedule(static) if (m > 1)
  for (int64_t r = 0; r < m; ++r)
    quantize_row(x + r * k, k, qx.data() + r * k, dx.data() + r * (k / kActBlock), sx.data() + r * (k / 16));
  const Rows rows{qx.data(), dx.data(), sx.data(), k};
  const PanelFn fn = panel_fn(width, fmt);
  const int64_t panels = (n + kCols - 1) / kCols, panel_bytes = k / lay.group * lay.group_bytes();
#pragma omp parallel if (panels > 1)
  {
    const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t p0 = panels * me / threads, p1 = panels * (me + 1) / threads;
    std::vector<float> scratch(static_cast<size_t>(m * kCols + 16));  // every row's accumulators of one panel
    float* acc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
    for (int64_t p = p0; p < p1; ++p) {
      fn(rows, m, packed + p * panel_bytes, acc);
      const int64_t cols = n - p * kCols < kCols ? n - p * kCols : kCols;
      const T* b = bias ? bias + p * kCols : nullptr;
      for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < cols; ++c) store(out + r * n + p * kCols + c, acc[r * kCols + c] + (b ? widen(b[c]) : 0.0f));
    }
  }
#endif
  return 0;
}

}  // namespace

extern "C" {

// The kernel this CPU runs within the process's CPU path: 512 (AVX-512 VNNI), 256 (AVX2) or 0 (none).
int ps_q8a_available() { return q8a_width(); }

// The file's blocks of W [n, k] repacked for this kernel at `packed` (ps_q_packed_size bytes: the same size as
// q_gemm's packing, another order). 1: an unknown format or a k that is not whole blocks.
int ps_q8a_pack(int fmt, const uint8_t* blocks, int64_t n, int64_t k, uint8_t* packed) {
  return pack_panels(fmt, blocks, n, k, packed, put_quants);
}

// out [m, n] = x [m, k] . W^T (+ bias [n]) with x quantised to int8 (see the top). 1: bad arguments; 2: no kernel
// runs here (ps_q8a_available() == 0).
int ps_q8a_linear_f32(int fmt, const float* x, int64_t m, int64_t k, const uint8_t* packed, int64_t n,
                      const float* bias, float* out) {
  return run_linear(fmt, x, m, k, packed, n, bias, out);
}
int ps_q8a_linear_bf16(int fmt, const bf16* x, int64_t m, int64_t k, const uint8_t* packed, int64_t n,
                       const bf16* bias, bf16* out) {
  return run_linear(fmt, x, m, k, packed, n, bias, out);
}

}  // extern "C"
