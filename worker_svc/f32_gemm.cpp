// The float32 lean forward's small-batch matmuls on AVX-512 FMA (worker_svc/linear.py's "panels"): out = x . W^T
// (+ bias) for x [M, K], W [N, K], float32. Built into the CPU kernel library with paged_attention_cpu.cpp.
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
// Compiled for AVX-512 by target attribute, so the native build and the portable ones hold the same code and
// compute the same bits; ps_f32_panels_available says at run time whether the CPU runs it.
#include <cstdint>
#include <cstring>

#include <omp.h>
#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kCols = 48;  // output columns a panel (3 vectors of 16)
constexpr int kRows = 8;       // rows a register block

#if defined(__x86_64__)
#define PS_F32_TARGET __attribute__((target("avx512f,avx512vl,fma")))

// Rows [0, R) of a (rows `lda` apart) x one panel b (K x 48) into out (rows `ldo` apart; `cols` <= 48 valid).
// pf, num_pf: lines of the next panel to prefetch into L2 during this call, spread over the k steps.
template <int R>
PS_F32_TARGET void panel_block(const float* a, int64_t lda, const float* b, int64_t k, const float* bias,
                               float* out, int64_t ldo, int64_t cols, const char* pf, int64_t num_pf) {
  __m512 acc[R][3];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = _mm512_setzero_ps();
  // Prefetches spread evenly over the k steps (lines a step, in 1/65536ths): issued in bursts, they held the line
  // fill buffers that this panel's own loads need (64 rows: 43.4 -> 39.1 ms for the default model's 120 matmuls).
  const int64_t pf_step = num_pf * 65536 / k;
  int64_t pf_acc = 0, next_pf = 0;
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* bk = b + kk * kCols;
    const __m512 b0 = _mm512_load_ps(bk), b1 = _mm512_load_ps(bk + 16), b2 = _mm512_load_ps(bk + 32);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(a[r * lda + kk]);
      acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(av, b2, acc[r][2]);
    }
    for (pf_acc += pf_step; pf_acc >= 65536; pf_acc -= 65536) _mm_prefetch(pf + 64 * next_pf++, _MM_HINT_T1);
  }
  for (; next_pf < num_pf; ++next_pf) _mm_prefetch(pf + 64 * next_pf, _MM_HINT_T1);
  __m512 bv[3];
  for (int c = 0; c < 3; ++c) bv[c] = bias ? _mm512_maskz_loadu_ps(c * 16 < cols ? 0xffff : 0, bias + c * 16)
                                           : _mm512_setzero_ps();
  if (cols == kCols) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 3; ++c) _mm512_storeu_ps(out + r * ldo + 16 * c, _mm512_add_ps(acc[r][c], bv[c]));
    return;
  }
  for (int c = 0; c < 3; ++c) {
    const int64_t left = cols - 16 * c;
    const __mmask16 mask = left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
    if (bias) bv[c] = _mm512_maskz_loadu_ps(mask, bias + c * 16);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * ldo + 16 * c, mask, _mm512_add_ps(acc[r][c], bv[c]));
  }
}

using BlockFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t,
                         const char*, int64_t);
constexpr BlockFn kBlocks[kRows + 1] = {nullptr, panel_block<1>, panel_block<2>, panel_block<3>, panel_block<4>,
                                        panel_block<5>, panel_block<6>, panel_block<7>, panel_block<8>};

PS_F32_TARGET void linear(const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias,
                          float* out) {
  const int64_t panels = (n + kCols - 1) / kCols, panel_floats = kCols * k, panel_lines = panel_floats * 4 / 64;
  const int64_t groups = (m + kRows - 1) / kRows;
#pragma omp parallel if (panels > 1)
  {
    const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    // Contiguous panel ranges a thread: each streams its own part of the weight front to back.
    const int64_t p0 = panels * me / threads, p1 = panels * (me + 1) / threads;
    for (int64_t p = p0; p < p1; ++p) {
      const float* b = packed + p * panel_floats;
      const char* next = p + 1 < p1 ? reinterpret_cast<const char*>(b + panel_floats) : nullptr;
      const int64_t cols = n - p * kCols < kCols ? n - p * kCols : kCols;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t r0 = g * kRows, rows = m - r0 < kRows ? m - r0 : kRows;
        // this group's share of the next panel's lines
        const int64_t l0 = next ? panel_lines * g / groups : 0, l1 = next ? panel_lines * (g + 1) / groups : 0;
        kBlocks[rows](x + r0 * k, k, b, k, bias ? bias + p * kCols : nullptr, out + r0 * n + p * kCols, n, cols,
                      next ? next + 64 * l0 : nullptr, l1 - l0);
      }
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
#endif

}  // namespace

extern "C" {

// 1 when this CPU runs the AVX-512 float32 kernel; else 0.
int ps_f32_panels_available() {
#if defined(__x86_64__)
  static const int ok = cpu_has_avx512f() ? 1 : 0;
  return ok;
#else
  return 0;
#endif
}

// The floats ps_f32_pack_panels writes for W [n, k]: n rounded up to whole panels, times k.
int64_t ps_f32_packed_size(int64_t n, int64_t k) { return (n + kCols - 1) / kCols * kCols * k; }

// W [n, k] float32 (element [j][kk] at w[j * stride_n + kk * stride_k]: [n, k] or its transpose [k, n] stored)
// into the kernel's panel order at `packed` (ps_f32_packed_size floats, 64-byte aligned).
// 1: bad shapes or a misaligned `packed`.
int ps_f32_pack_panels(const float* w, int64_t n, int64_t k, int64_t stride_n, int64_t stride_k, float* packed) {
  if (n <= 0 || k <= 0 || reinterpret_cast<uintptr_t>(packed) % 64) return 1;
  const int64_t panels = (n + kCols - 1) / kCols;
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t kk = 0; kk < k; ++kk)
      for (int64_t j = 0; j < kCols; ++j) {
        const int64_t col = p * kCols + j;
        packed[(p * k + kk) * kCols + j] = col < n ? w[col * stride_n + kk * stride_k] : 0.0f;
      }
  return 0;
}

// out [m, n] = x [m, k] . W^T (+ bias [n]), float32, x and out contiguous, W packed by ps_f32_pack_panels.
// 1: bad shapes or a misaligned `packed`; 2: the CPU lacks AVX-512.
int ps_f32_linear(const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias,
                  float* out) {
  if (m < 0 || n <= 0 || k <= 0 || reinterpret_cast<uintptr_t>(packed) % 64) return 1;
  if (!ps_f32_panels_available()) return 2;
  if (m == 0) return 0;
#if defined(__x86_64__)
  linear(x, m, k, packed, n, bias, out);
#endif
  return 0;
}

}  // extern "C"
