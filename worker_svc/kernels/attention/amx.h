// The AMX tile kernels of the bfloat16 pools' prefill tiles (AVX-512 builds on x86-64, compiled by target
// attribute; amx_gemm.cpp grants and configures the tiles at run time): a block's scores (amx_scores16,
// amx_block_scores) and a group's P.V (amx_pv).
#pragma once

#include "group.h"
#include "int8.h"

namespace {

#if defined(PS_AVX512) && defined(__x86_64__)
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

#endif

}  // namespace
