// The lean forward's float32-accumulating panel matmuls (worker_svc/linear.py's "panels"): out = x . W^T (+ bias)
// for x [M, K], W [N, K], float32 in and out, or bfloat16 in and out (widened to float32, each output rounded once
// to bfloat16, nearest even). Built into the CPU kernel library with paged_attention_cpu.cpp.
//
// Why: a decode step multiplies a few rows by every weight of the model. MKL's sgemm on the transposed weight and
// oneDNN's prepacked one both read the weights from memory at about half the plain read rate there (the default
// model's 120 layer matmuls at 16 rows, 2 threads: ~27 ms for 0.42 GB), and at 64 rows they reach ~45% of the
// machine's float32 peak because the weight reads and the arithmetic do not overlap.
//
// Layout: W is packed once at load into panels of kCols = 48 output columns: panel p holds, for k = 0..K-1, the 48
// floats W[48p + j][k] (j = 0..47; columns past N are zero). A panel is one contiguous run of memory, read front to
// back. Rows go through a panel kRows = 8 at a time: 8 x 3 accumulator registers, 3 weight loads and 8 broadcasts
// per k. Each output element is one chain of FMAs over k in order, whatever the row count or thread count: the
// kernel's results do not depend on the batch a row is in.
//
// Overlap: while a thread works through panel p, it prefetches panel p + 1 into L2, spread over all the row
// groups of p: the weight read of the next panel runs under the arithmetic of this one.
//
// Batch invariance: every output is the same FMA chain, so its bits depend on neither M, the row's place in the
// batch, the thread count nor the ISA: the AVX2 + FMA kernel (24 columns, 4 rows a register block: its 16 ymm
// registers) computes the bits of the AVX-512 one, and the bfloat16 kernel is the M-invariant matmul of a bfloat16
// model on a CPU without AMX (linear.py, --batch-invariant on). Both compiled by target attribute, so the native
// build and the portable ones hold the same code; ps_f32_panels_available says at run time which one runs, within
// the CPU path this process is capped to (cpu_path.cpp).
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <omp.h>
#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "kernels/bf16.h"

extern "C" int ps_cpu_path_cap();  // cpu_path.cpp

namespace {

constexpr int64_t kCols = 48;  // output columns a panel (3 vectors of 16)
constexpr int kRows = 8;       // rows a register block (AVX-512)
constexpr int kRows2 = 4;      // rows a register block (AVX2: 4 x 3 accumulators, 3 weights, 1 broadcast)
constexpr int kCap512 = 2, kCap256 = 1;  // cpu_path.cpp's levels

// The epilogue every build shares: out[r][c] = acc[r][c] + bias[c] (float32), stored as T. `acc` rows 48 apart.
template <typename T>
inline void store_rows(const float* acc, int rows, const T* bias, T* out, int64_t ldo, int64_t cols) {
  for (int r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float v = acc[r * kCols + c] + (bias ? widen(bias[c]) : 0.0f);
      if constexpr (std::is_same_v<T, float>) out[r * ldo + c] = v;
      else out[r * ldo + c] = narrow_bf16(v);
    }
}

#if defined(__x86_64__)
#define PS_F32_TARGET __attribute__((target("avx512f,avx512vl,fma")))
#define PS_AVX2_TARGET __attribute__((target("avx2,fma")))

PS_F32_TARGET inline __m512 load16(const float* p) { return _mm512_load_ps(p); }
PS_F32_TARGET inline __m512 load16(const bf16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
PS_AVX2_TARGET inline __m256 load8(const float* p) { return _mm256_load_ps(p); }
PS_AVX2_TARGET inline __m256 load8(const bf16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// Rows [0, R) of a (rows `lda` apart) x one panel b (K x 48) into out (rows `ldo` apart; `cols` <= 48 valid).
// pf, num_pf: lines of the next panel to prefetch into L2 during this call, spread over the k steps.
template <int R, typename T>
PS_F32_TARGET void panel_block(const T* a, int64_t lda, const T* b, int64_t k, const T* bias,
                               T* out, int64_t ldo, int64_t cols, const char* pf, int64_t num_pf) {
  __m512 acc[R][3];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = _mm512_setzero_ps();
  // Prefetches spread evenly over the k steps (lines a step, in 1/65536ths): issued in bursts, they held the line
  // fill buffers that this panel's own loads need (64 rows: 43.4 -> 39.1 ms for the default model's 120 matmuls).
  const int64_t pf_step = num_pf * 65536 / k;
  int64_t pf_acc = 0, next_pf = 0;
  for (int64_t kk = 0; kk < k; ++kk) {
    const T* bk = b + kk * kCols;
    const __m512 b0 = load16(bk), b1 = load16(bk + 16), b2 = load16(bk + 32);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(widen(a[r * lda + kk]));
      acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(av, b2, acc[r][2]);
    }
    for (pf_acc += pf_step; pf_acc >= 65536; pf_acc -= 65536) _mm_prefetch(pf + 64 * next_pf++, _MM_HINT_T1);
  }
  for (; next_pf < num_pf; ++next_pf) _mm_prefetch(pf + 64 * next_pf, _MM_HINT_T1);
  if constexpr (std::is_same_v<T, float>) {
    __m512 bv[3];
    for (int c = 0; c < 3; ++c) bv[c] = bias ? _mm512_maskz_loadu_ps(c * 16 < cols ? 0xffff : 0, bias + c * 16)
                                             : _mm512_setzero_ps();
    if (cols == kCols) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < 3; ++c) _mm512_storeu_ps(out + r * ldo + 16 * c, _mm512_add_ps(acc[r][c], bv[c]));
      return;
    }
  }
  alignas(64) float tmp[R * kCols];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 3; ++c) _mm512_store_ps(tmp + r * kCols + 16 * c, acc[r][c]);
  store_rows(tmp, R, bias, out, ldo, cols);
}

// The AVX2 + FMA block: rows [0, R) x the 24 columns [c0, c0 + 24) of one panel, the same FMA chain per output as
// panel_block's (the same bits).
template <int R, typename T>
PS_AVX2_TARGET void panel_block2(const T* a, int64_t lda, const T* b, int64_t k, int64_t c0, const T* bias,
                                 T* out, int64_t ldo, int64_t cols) {
  __m256 acc[R][3];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = _mm256_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    const T* bk = b + kk * kCols + c0;
    const __m256 b0 = load8(bk), b1 = load8(bk + 8), b2 = load8(bk + 16);
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_set1_ps(widen(a[r * lda + kk]));
      acc[r][0] = _mm256_fmadd_ps(av, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(av, b1, acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(av, b2, acc[r][2]);
    }
  }
  alignas(64) float tmp[R * kCols];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 3; ++c) _mm256_store_ps(tmp + r * kCols + 8 * c, acc[r][c]);
  const int64_t n = cols - c0 < 24 ? cols - c0 : 24;
  if (n > 0) store_rows(tmp, R, bias ? bias + c0 : nullptr, out + c0, ldo, n);
}

template <typename T>
using BlockFn = void (*)(const T*, int64_t, const T*, int64_t, const T*, T*, int64_t, int64_t, const char*, int64_t);
template <typename T>
constexpr BlockFn<T> kBlocks[kRows + 1] = {nullptr, panel_block<1, T>, panel_block<2, T>, panel_block<3, T>,
                                           panel_block<4, T>, panel_block<5, T>, panel_block<6, T>,
                                           panel_block<7, T>, panel_block<8, T>};
template <typename T>
using Block2Fn = void (*)(const T*, int64_t, const T*, int64_t, int64_t, const T*, T*, int64_t, int64_t);
template <typename T>
constexpr Block2Fn<T> kBlocks2[kRows2 + 1] = {nullptr, panel_block2<1, T>, panel_block2<2, T>,
                                              panel_block2<3, T>, panel_block2<4, T>};

// One panel's rows on the widest kernel `width` (512 or 256) allows; `next`: the next panel to prefetch (AVX-512).
template <typename T>
void panel_rows(int width, const T* x, int64_t m, int64_t k, const T* b, const T* bias, T* out, int64_t n,
                int64_t cols, const char* next, int64_t panel_lines) {
  if (width == 512) {
    const int64_t groups = (m + kRows - 1) / kRows;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t r0 = g * kRows, rows = m - r0 < kRows ? m - r0 : kRows;
      // this group's share of the next panel's lines
      const int64_t l0 = next ? panel_lines * g / groups : 0, l1 = next ? panel_lines * (g + 1) / groups : 0;
      kBlocks<T>[rows](x + r0 * k, k, b, k, bias, out + r0 * n, n, cols, next ? next + 64 * l0 : nullptr, l1 - l0);
    }
    return;
  }
  for (int64_t r0 = 0; r0 < m; r0 += kRows2) {
    const int64_t rows = m - r0 < kRows2 ? m - r0 : kRows2;
    for (int64_t c0 = 0; c0 < cols; c0 += 24) kBlocks2<T>[rows](x + r0 * k, k, b, k, c0, bias, out + r0 * n, n, cols);
  }
}

template <typename T>
void linear(int width, const T* x, int64_t m, int64_t k, const T* packed, int64_t n, const T* bias, T* out) {
  const int64_t panels = (n + kCols - 1) / kCols, panel_elems = kCols * k;
  const int64_t panel_lines = panel_elems * static_cast<int64_t>(sizeof(T)) / 64;
#pragma omp parallel if (panels > 1)
  {
    const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    // Contiguous panel ranges a thread: each streams its own part of the weight front to back.
    const int64_t p0 = panels * me / threads, p1 = panels * (me + 1) / threads;
    for (int64_t p = p0; p < p1; ++p) {
      const T* b = packed + p * panel_elems;
      const char* next = p + 1 < p1 ? reinterpret_cast<const char*>(b + panel_elems) : nullptr;
      const int64_t cols = n - p * kCols < kCols ? n - p * kCols : kCols;
      panel_rows(width, x, m, k, b, bias ? bias + p * kCols : nullptr, out + p * kCols, n, cols, next, panel_lines);
    }
  }
}

bool cpu_has_avx512f() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(b & (1u << 16)) || !(b & (1u << 31))) return false;  // F, VL
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27)) || !(c & (1u << 12))) return false;  // OSXSAVE, FMA
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & 0xe6u) == 0xe6u;  // the OS saves the AVX-512 and AVX state
}

bool cpu_has_avx2_fma() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(b & (1u << 5))) return false;  // AVX2
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27)) || !(c & (1u << 12))) return false;  // OSXSAVE, FMA
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & 0x6u) == 0x6u;  // the OS saves the SSE and AVX state
}
#endif

// The widest panel kernel this CPU runs within the process's CPU path: 512, 256 or 0.
int panel_width() {
#if defined(__x86_64__)
  static const int native = cpu_has_avx512f() ? 512 : cpu_has_avx2_fma() ? 256 : 0;
  const int cap = ps_cpu_path_cap();
  if (native == 512 && cap >= kCap512) return 512;
  return native >= 256 && cap >= kCap256 ? 256 : 0;
#else
  return 0;
#endif
}

template <typename T>
int pack(const T* w, int64_t n, int64_t k, int64_t stride_n, int64_t stride_k, T* packed) {
  if (n <= 0 || k <= 0 || reinterpret_cast<uintptr_t>(packed) % 64) return 1;
  const int64_t panels = (n + kCols - 1) / kCols;
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t kk = 0; kk < k; ++kk)
      for (int64_t j = 0; j < kCols; ++j) {
        const int64_t col = p * kCols + j;
        packed[(p * k + kk) * kCols + j] = col < n ? w[col * stride_n + kk * stride_k] : T{0};
      }
  return 0;
}

template <typename T>
int run_linear(const T* x, int64_t m, int64_t k, const T* packed, int64_t n, const T* bias, T* out) {
  if (m < 0 || n <= 0 || k <= 0 || reinterpret_cast<uintptr_t>(packed) % 64) return 1;
  const int width = panel_width();
  if (width == 0) return 2;
  if (m == 0) return 0;
#if defined(__x86_64__)
  linear(width, x, m, k, packed, n, bias, out);
#endif
  return 0;
}

}  // namespace

extern "C" {

// The panel kernel this CPU runs within the process's CPU path: 512 (AVX-512), 256 (AVX2 + FMA) or 0 (none).
int ps_f32_panels_available() { return panel_width(); }

// The elements ps_f32_pack_panels / ps_bf16_pack_panels write for W [n, k]: n rounded up to whole panels, times k.
int64_t ps_f32_packed_size(int64_t n, int64_t k) { return (n + kCols - 1) / kCols * kCols * k; }

// W [n, k] (element [j][kk] at w[j * stride_n + kk * stride_k]: [n, k] or its transpose [k, n] stored) into the
// kernel's panel order at `packed` (ps_f32_packed_size elements, 64-byte aligned). 1: bad shapes or a misaligned
// `packed`.
int ps_f32_pack_panels(const float* w, int64_t n, int64_t k, int64_t stride_n, int64_t stride_k, float* packed) {
  return pack(w, n, k, stride_n, stride_k, packed);
}
int ps_bf16_pack_panels(const bf16* w, int64_t n, int64_t k, int64_t stride_n, int64_t stride_k, bf16* packed) {
  return pack(w, n, k, stride_n, stride_k, packed);
}

// out [m, n] = x [m, k] . W^T (+ bias [n]), x and out contiguous, W packed by the pack function of its dtype.
// 1: bad shapes or a misaligned `packed`; 2: no panel kernel runs here (ps_f32_panels_available() == 0).
int ps_f32_linear(const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias,
                  float* out) {
  return run_linear(x, m, k, packed, n, bias, out);
}
int ps_bf16_panel_linear(const bf16* x, int64_t m, int64_t k, const bf16* packed, int64_t n, const bf16* bias,
                         bf16* out) {
  return run_linear(x, m, k, packed, n, bias, out);
}

}  // extern "C"
