// One work item of the kernel (a sequence's query tile, one kv head, all its query heads): the queries scaled (and
// quantised, or kept as bfloat16, for the paths that take them), then the walk over the item's blocks on the path
// its dtype, shape and ISA take, and the output normalised.
#pragma once

#include "group_step.h"
#include "int8.h"
#include "scores.h"

namespace {

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
  int64_t window;  // > 0: sliding window, the row at position p sees keys p - window < q <= p; 0: keys 0..p
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
  // NOTE: the 16-key block paths (block16, attend_grouped) take a prefix of keys per row; a sliding-window layer's
  // rows take the general path, whether or not the window cuts this item's rows (so a decode row and the same row
  // in a prefill tile keep the same bits: batch invariance).
  const bool fast16 = !k_scored && BS == 16 && (D == 64 || D == 128) && a.window <= 0;
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
  int64_t pos[kMaxRows], nr[kMaxRows], lo[kMaxRows];
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
    lo[r] = a.window > 0 ? std::max<int64_t>(0, pos[r] - a.window + 1) : 0;  // the row's first visible key
  }
  const int64_t last = first_pos + t1 - 1;  // the item's furthest-seeing row
  const int64_t num_kv_blocks = last / BS + 1;
  // The walk starts at the block holding the first key any row sees (row 0's: rows go by position): blocks wholly
  // before the window are never read.
  const int64_t first_block = lo[0] / BS;
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
  for (int64_t j = first_block; j < num_kv_blocks && !grouped; ++j) {
    const int64_t base = j * BS;
    const int64_t n_in_block = std::min(BS, last + 1 - base);
    const int64_t k0 = std::max<int64_t>(0, lo[0] - base);  // the block's first row any row of the item sees
    const int64_t row0 = static_cast<int64_t>(table[j]) * BS;  // the block's first token row in the pool
    const int64_t off = row0 * tok_stride + h * D;
    const int64_t soff = row0 * a.num_kv_heads + h;  // its first (token, kv head) scale
    for (int64_t r = 0; r < rows; ++r) nr[r] = std::min(n_in_block, pos[r] + 1 - base);  // causal: keys 0..pos[r]
    // With a window, row r sees the block's keys [st, nr[r]), st = lo[r] - base where that is past the block start.
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
      for (int64_t k = k0; k < n_in_block; ++k) {
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
      const int64_t st = std::max<int64_t>(0, lo[r] - base);
      const int64_t n = nr[r] - st;
      if (n <= 0) continue;
      // k_scored: sc holds the scores of keys 0..nr[r]-1 of the block; the row's run starts at st
      float* const p = sc + r * BS + st;
      if (!k_scored) scores(qbuf + r * D, kb + st * stride, stride, n, D, p);
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
      accumulate(abuf + r * D, corr, p, vb + st * stride, stride, n, D);
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

}  // namespace
