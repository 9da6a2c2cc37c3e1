// Paged attention on the CPU: one call per layer attends every sequence of a step (decodes and prefill
// chunks) straight out of the block pool, with an online softmax over blocks (flash-decoding on the CPU).
//
// Built at first use by worker_svc/cpu_build.py with g++ -O3 -march=native -fopenmp and called
// through ctypes with raw pointers of torch tensors. NOTE: it links the libgomp.so.1 that torch has already
// loaded (same soname), so its threads are torch's threads: torch.set_num_threads governs both.
//
// Layout (see worker_svc/attention/backend.py): kv_layer is [2, num_blocks, block_size, kv_heads, head_dim];
// query/out rows are the step's packed new tokens, [T, heads, head_dim]; sequence b owns rows
// qsl[b]..qsl[b+1]-1, which sit at positions seq_len - q_len .. seq_len - 1; row at position p sees keys 0..p
// (with a sliding window, p - window + 1..p).
//
// 8-bit caches (int8, fp8 e4m3 / e5m2): kv holds codes and `scales` the layer's float32 [2, num_blocks,
// block_size, kv_heads], one per (token, kv head) row of K and of V: value = code * scale. Each block's valid rows
// are dequantised into per-thread scratch as they are read (never a float copy of the cache). With int8_qk (an
// int8 cache, built with AVX-512 VNNI or AVX-VNNI) Q.K runs in int8: each query row is quantised to int8 with its
// own scale and score = q_scale * k_scale * int32 dot; softmax and P.V stay float.
//
// ISA paths, chosen at compile time by the -march macros: AVX-512 (f/bw/vl), AVX2 + FMA (+ F16C), scalar.
//
// The kernel's parts (worker_svc/kernels/attention/, headers of this one translation unit, so that the compiler
// inlines across them as it did when they were one file): common.h (limits, ISA macros), elements.h (element types,
// widening), scores.h (the general path's Q.K and P.V: scalar, AVX2, AVX-512), int8.h (the 8-bit caches' Q.K),
// block16.h / group.h / group_step.h (the 16-key block paths, AVX-512), amx.h and bf16_dot.h (AMX tiles and
// AVX512-BF16 dot products), item.h (one work item). Here: the schedule of the items over threads, and the C ABI.
#include "../kernels/attention/item.h"

namespace {

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
// GEMM-shaped work that the caller hands to a matmul-based attention instead. window > 0: a sliding-window layer's,
// the row at position p sees keys p - window < q <= p (each item's walk starts at the block holding its first
// visible key); 0: keys 0..p.
// Returns 0, or 1 (shapes the kernel has no instance for), 2 (unknown dtype), 3 (scales missing or given to a
// float pool), 4 (int8_qk for another dtype or in a build without it), 5 (a negative window).
int ps_paged_attention(const void* q, int64_t q_stride_t, int64_t q_stride_h, const void* kv, int dtype,
                       const float* scales, int int8_qk, void* out, const int64_t* qsl, const int64_t* seq_lens,
                       const int32_t* block_tables, int64_t bt_stride, int64_t num_seqs, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size, float scale,
                       int64_t q_tile, int64_t max_q_len, int io_bf16, int batch_invariant, int64_t window) {
  if (head_dim > kMaxHeadDim || block_size > kMaxBlock || num_heads % num_kv_heads ||
      num_heads / num_kv_heads > kMaxRows)
    return 1;
  if (dtype < kFloat32 || dtype > kE5M2) return 2;
  if ((dtype >= kInt8) != (scales != nullptr)) return 3;
  if (int8_qk && (dtype != kInt8 || PS_INT8_QK == 0)) return 4;
  if (window < 0) return 5;
  Args a{q, q_stride_t, q_stride_h, kv, scales, out, io_bf16 != 0, qsl, seq_lens, block_tables, bt_stride, num_heads,
         num_kv_heads, head_dim, num_blocks, block_size, q_tile, max_q_len, scale, int8_qk != 0,
         batch_invariant != 0, window};
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
