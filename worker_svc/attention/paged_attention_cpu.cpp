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
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

namespace {

constexpr int kMaxRows = 64;     // query rows (tokens x group heads) one work item holds
constexpr int kMaxHeadDim = 256;
constexpr int kMaxBlock = 256;

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) {  // bfloat16: the high half of a float32
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

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
#include <immintrin.h>
inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
#endif

// out[k] = q . keys[k] for n keys of D floats, `stride` floats apart.
inline void scores(const float* q, const float* keys, int64_t stride, int64_t n, int64_t D, float* out) {
  int64_t k = 0;
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
  }
#endif
  for (; k < n; ++k) {
    const float* kk = keys + k * stride;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += q[d] * kk[d];
    out[k] = dot;
  }
}

// acc = acc * corr + sum_k p[k] * values[k]
inline void accumulate(float* acc, float corr, const float* p, const float* values, int64_t stride, int64_t n,
                       int64_t D) {
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

struct Args {
  const float* q;
  int64_t q_stride_t, q_stride_h;
  const void* kv;
  float* out;  // contiguous [T, H, D]
  const int64_t* qsl;
  const int64_t* seq_lens;
  const int32_t* block_tables;
  int64_t bt_stride;
  int64_t num_heads, num_kv_heads, head_dim, num_blocks, block_size, q_tile, max_q_len;
  float scale;
};

// One work item: sequence b, kv head h, query tokens [t0, t1) of the sequence's chunk, all `group` query
// heads of h. K/V of each block is read once for all of the item's rows.
template <typename T>
void attend_item(const Args& a, int64_t b, int64_t h, int64_t t0, int64_t t1) {
  const int64_t D = a.head_dim, BS = a.block_size, G = a.num_heads / a.num_kv_heads;
  const int64_t q_begin = a.qsl[b], q_len = a.qsl[b + 1] - q_begin, s = a.seq_lens[b];
  const int64_t first_pos = s - q_len;
  const int64_t rows = (t1 - t0) * G;
  const T* K = static_cast<const T*>(a.kv);
  const T* V = K + a.num_blocks * BS * a.num_kv_heads * D;
  const int64_t tok_stride = a.num_kv_heads * D;

  // NOTE: per-thread scratch on the heap (kept across calls): a few hundred KB is too much for a stack.
  thread_local std::vector<float> scratch;
  scratch.resize(2 * kMaxRows * D + 2 * BS * D + BS);
  float* const qbuf = scratch.data();
  float* const abuf = qbuf + kMaxRows * D;
  float* const kf = abuf + kMaxRows * D;
  float* const vf = kf + BS * D;
  float* const sc = vf + BS * D;
  float m[kMaxRows], l[kMaxRows];
  int64_t pos[kMaxRows];

  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / G, head = h * G + r % G;
    const float* src = a.q + (q_begin + t) * a.q_stride_t + head * a.q_stride_h;
    for (int64_t d = 0; d < D; ++d) qbuf[r * D + d] = src[d] * a.scale;  // scale the query, not every score
    std::memset(abuf + r * D, 0, sizeof(float) * D);
    m[r] = -INFINITY;
    l[r] = 0.0f;
    pos[r] = first_pos + t;
  }
  const int64_t last = first_pos + t1 - 1;  // the item's furthest-seeing row
  const int64_t num_kv_blocks = last / BS + 1;
  const int32_t* table = a.block_tables + b * a.bt_stride;
  for (int64_t j = 0; j < num_kv_blocks; ++j) {
    const int64_t base = j * BS;
    const int64_t n_in_block = std::min(BS, last + 1 - base);
    const int64_t off = (static_cast<int64_t>(table[j]) * BS) * tok_stride + h * D;
    // float32 pools are read in place; other dtypes are widened once per block into kf/vf.
    const float *kb, *vb;
    int64_t stride;
    if constexpr (std::is_same_v<T, float>) {
      kb = K + off;
      vb = V + off;
      stride = tok_stride;
    } else {
      for (int64_t k = 0; k < n_in_block; ++k) {  // NOTE: slots past `last` are garbage: never read
        const T* kr = K + off + k * tok_stride;
        const T* vr = V + off + k * tok_stride;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
          kf[k * D + d] = to_f32(kr[d]);
          vf[k * D + d] = to_f32(vr[d]);
        }
      }
      kb = kf;
      vb = vf;
      stride = D;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = std::min(n_in_block, pos[r] + 1 - base);  // causal: keys 0..pos[r]; never past it
      if (n <= 0) continue;
      scores(qbuf + r * D, kb, stride, n, D, sc);
      float bmax = -INFINITY;
      for (int64_t k = 0; k < n; ++k) bmax = sc[k] > bmax ? sc[k] : bmax;
      // Online softmax: rescale what was accumulated under the old running max.
      const float m_new = bmax > m[r] ? bmax : m[r];
      const float corr = fast_exp(m[r] - m_new);  // m[r] = -inf on the first block: corr = 0
      float psum = 0.0f;
#pragma omp simd reduction(+ : psum)
      for (int64_t k = 0; k < n; ++k) {
        sc[k] = fast_exp(sc[k] - m_new);
        psum += sc[k];
      }
      l[r] = l[r] * corr + psum;
      m[r] = m_new;
      accumulate(abuf + r * D, corr, sc, vb, stride, n, D);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / G, head = h * G + r % G;
    float* dst = a.out + ((q_begin + t) * a.num_heads + head) * D;
    const float inv = 1.0f / l[r];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) dst[d] = abuf[r * D + d] * inv;
  }
}

template <typename T>
void run(const Args& a, int64_t num_seqs) {
  const int64_t G = a.num_heads / a.num_kv_heads;
  const int64_t tile = std::max<int64_t>(1, std::min<int64_t>(a.q_tile, kMaxRows / G));
  // Work items: (sequence, query tile, kv head), longest-context tiles first is not needed: dynamic schedule.
  std::vector<int64_t> item_start(num_seqs + 1, 0);
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = a.qsl[b + 1] - a.qsl[b];
    const int64_t tiles = q_len <= a.max_q_len ? (q_len + tile - 1) / tile : 0;  // longer: the caller's
    item_start[b + 1] = item_start[b] + tiles * a.num_kv_heads;
  }
  const int64_t num_items = item_start[num_seqs];
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < num_items; ++i) {
    int64_t lo = 0, hi = num_seqs;  // the sequence whose items contain i
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (item_start[mid] <= i) lo = mid; else hi = mid;
    }
    const int64_t b = lo, local = i - item_start[b];
    const int64_t h = local % a.num_kv_heads, t0 = (local / a.num_kv_heads) * tile;
    const int64_t q_len = a.qsl[b + 1] - a.qsl[b];
    attend_item<T>(a, b, h, t0, std::min(q_len, t0 + tile));
  }
}

}  // namespace

extern "C" {

int ps_max_head_dim() { return kMaxHeadDim; }
int ps_max_block_size() { return kMaxBlock; }
int ps_max_group() { return kMaxRows; }

// dtype: 0 = float32 pool, 1 = bfloat16 pool. The query and output are float32. Sequences whose q_len exceeds
// max_q_len are skipped (their rows of `out` are left as they are): long prefill chunks are GEMM-shaped work
// that the caller hands to a matmul-based attention instead.
int ps_paged_attention(const float* q, int64_t q_stride_t, int64_t q_stride_h, const void* kv, int dtype,
                       float* out, const int64_t* qsl, const int64_t* seq_lens, const int32_t* block_tables,
                       int64_t bt_stride, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, int64_t num_blocks, int64_t block_size, float scale, int64_t q_tile,
                       int64_t max_q_len) {
  if (head_dim > kMaxHeadDim || block_size > kMaxBlock || num_heads % num_kv_heads ||
      num_heads / num_kv_heads > kMaxRows)
    return 1;
  Args a{q, q_stride_t, q_stride_h, kv, out, qsl, seq_lens, block_tables, bt_stride, num_heads, num_kv_heads,
         head_dim, num_blocks, block_size, q_tile, max_q_len, scale};
  if (dtype == 0) run<float>(a, num_seqs);
  else if (dtype == 1) run<uint16_t>(a, num_seqs);
  else return 2;
  return 0;
}

}  // extern "C"
