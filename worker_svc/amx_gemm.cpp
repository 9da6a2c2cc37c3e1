// The bfloat16 lean forward's small-batch matmuls on AMX tiles (worker_svc/linear.py's "amx" kind): out = x . W^T
// for x [M, K], W [N, K], bfloat16 in and out, float32 accumulation. Built into the CPU kernel library with
// paged_attention_cpu.cpp and cpu_ops.cpp (worker_svc/cpu_build.py).
//
// Why: a decode step multiplies a few rows by every weight of the model, so it is bound by reading the weights.
// oneDNN's prepacked kernel read them at ~55% of the plain read rate on a 2-core Sapphire Rapids (the default
// model's 121 matmuls at 16 rows: 14.0 ms against 10.4 for a plain read of the same bytes); this kernel streams each
// weight once, in the order its tiles are used, and reads at the plain rate up to 16 rows (10.4 ms), 17-18 ms at 64.
//
// Layout: W is packed once at load into AMX's B-tile (VNNI) order: for each block of 16 output columns, for each
// block of 32 inputs, one 1 KB tile whose row i holds, per column j, W[j][2i] and W[j][2i + 1]. A weight's column
// block is then one contiguous run of memory, read front to back. The kernel takes two column blocks and two row
// tiles at a time (4 accumulator tiles, 2 A + 2 B tiles: all 8 of AMX's).
//
// Every function that touches tiles (or AVX512-BF16's rounding) is compiled for AMX by target attribute, so the native build and the portable
// ones (container images) hold the same code and compute the same bits; ps_amx_init says at run time whether the CPU
// and the kernel let this process use it.
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>
#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

extern "C" int ps_cpu_path_cap();  // cpu_path.cpp

namespace {

#if defined(__x86_64__)
#define PS_AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

struct alignas(64) TileConfig {  // LDTILECFG's 64-byte operand, palette 1
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes, on the calling thread.
PS_AMX_TARGET void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // NOTE: not _tile_loadconfig: GCC 12 declares its operand as 8 bytes, so the stores of rows and colsb above were
  // dropped as dead (seen: ldtilecfg of a zeroed config, #GP). The whole 64-byte object is the operand here.
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

constexpr int64_t kPrefetchTiles = 2;  // B/A tiles prefetched this many K steps ahead (1-4 measured alike; 0 worse)

// 16 float32 -> bfloat16, nearest even, by AVX512-BF16's instruction (every CPU with AMX-BF16 has it: ps_amx_init
// checks). It flushes denormals, as AMX's own float32 accumulation already does; every build runs this same code.
PS_AMX_TARGET inline __m256i round16(__m512 v) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)); }

PS_AMX_TARGET inline __m512 widen16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// Accumulator tile t (row tile t / 2, column block t % 2) into out rows [r0, r0 + rows), columns [c0, c0 + 16).
PS_AMX_TARGET inline void store_block(const float* acc, int64_t rows, const uint16_t* bias, uint16_t* out,
                                      int64_t ld) {
  const __m512 b = bias ? widen16(bias) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ld), round16(_mm512_add_ps(_mm512_load_ps(acc + 16 * r), b)));
}

// Rows [m0, m0 + 16 * RT) x column blocks nb, nb + 1 (CB of them) over all K. a: x's row m0 (rows `ka` elements
// apart, at least 16 * RT of them readable), b0: column block nb's packed tiles.
template <int RT, int CB>
PS_AMX_TARGET void tile_block(const uint16_t* a, int64_t ka, const uint16_t* b0, int64_t nkb, float (*acc)[256]) {
  const uint16_t* b1 = b0 + nkb * 512;
  const uint16_t* a1 = a + 16 * ka;
  _tile_zero(0);
  if (CB == 2) _tile_zero(1);
  if (RT == 2) _tile_zero(2);
  if (RT == 2 && CB == 2) _tile_zero(3);
  for (int64_t kb = 0; kb < nkb; ++kb) {
    if (kb + kPrefetchTiles < nkb) {
      const char* pb0 = reinterpret_cast<const char*>(b0 + (kb + kPrefetchTiles) * 512);
      const char* pb1 = reinterpret_cast<const char*>(b1 + (kb + kPrefetchTiles) * 512);
      for (int l = 0; l < 16; ++l) {
        _mm_prefetch(pb0 + 64 * l, _MM_HINT_T0);
        if (CB == 2) _mm_prefetch(pb1 + 64 * l, _MM_HINT_T0);
      }
      if ((kb & 1) == 0) {  // a 64-byte line of a row holds two K steps
        for (int l = 0; l < 16; ++l) {
          _mm_prefetch(reinterpret_cast<const char*>(a + l * ka + (kb + kPrefetchTiles) * 32), _MM_HINT_T0);
          if (RT == 2) _mm_prefetch(reinterpret_cast<const char*>(a1 + l * ka + (kb + kPrefetchTiles) * 32), _MM_HINT_T0);
        }
      }
    }
    // All loads first, then the products: a tile has no renaming, and a product right after its own load waits for it.
    _tile_loadd(4, a + kb * 32, ka * 2);
    _tile_loadd(6, b0 + kb * 512, 64);
    if (CB == 2) _tile_loadd(7, b1 + kb * 512, 64);
    if (RT == 2) _tile_loadd(5, a1 + kb * 32, ka * 2);
    _tile_dpbf16ps(0, 4, 6);
    if (CB == 2) _tile_dpbf16ps(1, 4, 7);
    if (RT == 2) _tile_dpbf16ps(2, 5, 6);
    if (RT == 2 && CB == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, acc[0], 64);
  if (CB == 2) _tile_stored(1, acc[1], 64);
  if (RT == 2) _tile_stored(2, acc[2], 64);
  if (RT == 2 && CB == 2) _tile_stored(3, acc[3], 64);
}

PS_AMX_TARGET void linear(const uint16_t* x, int64_t m, int64_t k, const uint16_t* packed, int64_t n,
                          const uint16_t* bias, uint16_t* out) {
  const int64_t nkb = k / 32, nnb = n / 16, npairs = (nnb + 1) / 2;
  // A row tile always loads 16 rows: a last partial one reads from a zero-padded copy, never past x's end.
  const int64_t m_full = m / 16 * 16;
  std::vector<uint16_t> tail;
  if (m_full < m) {
    tail.assign(16 * k, 0);
    std::memcpy(tail.data(), x + m_full * k, (m - m_full) * k * sizeof(uint16_t));
  }
#pragma omp parallel if (npairs > 1)
  {
    configure_tiles();  // per thread, per call: oneDNN loads its own configurations on these threads
    alignas(64) float acc[4][256];
    const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    // Contiguous column ranges a thread: each streams its own part of the weight front to back.
    const int64_t p0 = npairs * me / threads, p1 = npairs * (me + 1) / threads;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t nb = 2 * p;
      const bool two = nb + 1 < nnb;
      const uint16_t* b0 = packed + nb * nkb * 512;
      for (int64_t m0 = 0; m0 < m; m0 += 32) {
        const int64_t rows = m - m0 < 32 ? m - m0 : 32;
        const bool two_rows = rows > 16;
        const uint16_t* a = m0 < m_full ? x + m0 * k : tail.data();
        if (two_rows && m0 + 16 >= m_full && m0 + 16 < m) {
          // the second row tile is the padded tail: run the two row tiles apart
          if (two) tile_block<1, 2>(a, k, b0, nkb, acc); else tile_block<1, 1>(a, k, b0, nkb, acc);
          for (int c = 0; c < (two ? 2 : 1); ++c)
            store_block(acc[c], 16, bias ? bias + (nb + c) * 16 : nullptr, out + m0 * n + (nb + c) * 16, n);
          if (two) tile_block<1, 2>(tail.data(), k, b0, nkb, acc); else tile_block<1, 1>(tail.data(), k, b0, nkb, acc);
          for (int c = 0; c < (two ? 2 : 1); ++c)
            store_block(acc[c], rows - 16, bias ? bias + (nb + c) * 16 : nullptr, out + (m0 + 16) * n + (nb + c) * 16, n);
          continue;
        }
        if (two_rows) {
          if (two) tile_block<2, 2>(a, k, b0, nkb, acc); else tile_block<2, 1>(a, k, b0, nkb, acc);
        } else {
          if (two) tile_block<1, 2>(a, k, b0, nkb, acc); else tile_block<1, 1>(a, k, b0, nkb, acc);
        }
        for (int rt = 0; rt < (two_rows ? 2 : 1); ++rt) {
          const int64_t r = rt == 0 ? (rows < 16 ? rows : 16) : rows - 16;
          for (int c = 0; c < (two ? 2 : 1); ++c)
            store_block(acc[2 * rt + c], r, bias ? bias + (nb + c) * 16 : nullptr,
                        out + (m0 + 16 * rt) * n + (nb + c) * 16, n);
        }
      }
    }
    _tile_release();
  }
}

bool cpu_has_amx_bf16() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!(d & (1u << 22)) || !(d & (1u << 24))) return false;  // AMX-BF16, AMX-TILE
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) return false;  // AVX512-BF16 (round16)
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & (3u << 17)) == (3u << 17);  // XTILECFG and XTILEDATA enabled by the OS
}
#endif

}  // namespace

extern "C" {

// 1 when this process may run the AMX kernel: the CPU has AMX-BF16, the OS enables tile state and grants this
// process its use (Linux: ARCH_REQ_XCOMP_PERM, once a process, for all its threads); else 0.
int ps_amx_init() {
#if defined(__x86_64__)
  if (ps_cpu_path_cap() < 4) return 0;  // a process capped below the amx path (cpu_path.cpp)
  static const int ok = [] {
    if (!cpu_has_amx_bf16()) return 0;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtileData = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtileData) == 0 ? 1 : 0;
  }();
  return ok;
#else
  return 0;
#endif
}

// Loads the kernel's tile configuration (8 tiles of 16 rows x 64 bytes) on the calling thread: what the attention
// kernel's AMX scores (paged_attention_cpu.cpp) use. Only after ps_amx_init() returned 1.
void ps_amx_configure() {
#if defined(__x86_64__)
  configure_tiles();
#endif
}

// W [n, k] bfloat16 into the kernel's tile order (n * k elements at `packed`). 1: n % 16 or k % 32 is not 0.
int ps_amx_pack_bf16(const uint16_t* w, int64_t n, int64_t k, uint16_t* packed) {
  if (n <= 0 || k <= 0 || n % 16 || k % 32) return 1;
  const int64_t nkb = k / 32;
  for (int64_t nb = 0; nb < n / 16; ++nb)
    for (int64_t kb = 0; kb < nkb; ++kb) {
      uint16_t* tile = packed + (nb * nkb + kb) * 512;
      for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 16; ++j) {
          const uint16_t* src = w + (nb * 16 + j) * k + kb * 32 + 2 * i;
          tile[i * 32 + 2 * j] = src[0];
          tile[i * 32 + 2 * j + 1] = src[1];
        }
    }
  return 0;
}

// out [m, n] = x [m, k] . W^T (+ bias [n]), bfloat16, x and out contiguous, W packed by ps_amx_pack_bf16.
// 1: bad shapes; 2: AMX unusable here (ps_amx_init).
int ps_amx_linear_bf16(const uint16_t* x, int64_t m, int64_t k, const uint16_t* packed, int64_t n,
                       const uint16_t* bias, uint16_t* out) {
  if (m < 0 || n <= 0 || k <= 0 || n % 16 || k % 32) return 1;
  if (!ps_amx_init()) return 2;
  if (m == 0) return 0;
#if defined(__x86_64__)
  linear(x, m, k, packed, n, bias, out);
#endif
  return 0;
}

}  // extern "C"
