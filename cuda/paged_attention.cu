// Paged attention kernels over the worker's KV pool (issue #5).
//
// Pool, per layer: kv[2][num_blocks][block_size][num_kv_heads][head_dim] (0 = K, 1 = V), addressed through
// explicit element strides (stride_kv, stride_block, stride_slot, stride_head; head_dim contiguous), so the
// kernels work on the per-layer view of the whole [layers, 2, nb, bs, kvh, hd] pool tensor without a copy.
// Queries/outputs are packed [T, num_heads, head_dim] with strides (stride_t, stride_h; head_dim contiguous).
//
// Entry points (extern "C", fetched by name from CuPy's RawModule; TN in f32/f16/bf16, HD in 64/128/256):
//   write_kv_TN                     grid (num_tokens)                               any block size
//   paged_decode_TN_dHD             grid (num_heads/heads_per_cta, num_seqs, num_splits)   block: NT threads
//   paged_decode_reduce_TN_dHD      grid (num_heads, num_seqs)                      any block size
//   paged_prefill_TN_dHD            grid (num_heads/heads_per_cta, num_seqs, num_q_tiles)  block: NT threads
//   copy_blocks_u8/u16/u32/u128     grid (num_pairs, num_layers * 2)                any block size
// 8-bit caches (issue 25; CN in i8/e4m3/e5m2: int8, float8_e4m3fn, float8_e5m2 codes, plus float32 scales
// [2][num_blocks][block_size][num_kv_heads] with their own strides, one per (token, kv head) row of K or V):
//   write_kv_TN_CN                  grid (num_tokens)                               block: a multiple of 32
//   paged_decode_TN_CN_dHD, paged_prefill_TN_CN_dHD: as above, the scales' pointer and 4 strides after the
//   pool's; the split decode reuses paged_decode_reduce_TN_dHD. Rows are dequantised as they are loaded.
// NT: a multiple of 32 and of HD/4, at most 256 (the backend uses 128, the host tests 64).
//
// Attention design (one device function, attend_rows, shared by decode and prefill):
//   A CTA owns R "rows" = (query token, query head) pairs that all read the SAME kv head: for decode one token x
//   heads_per_cta heads of a GQA group (so each K/V block is read once for the whole group), for prefill
//   q_tile tokens x heads_per_cta heads. Row r may see keys [lo[r], lim[r]) (causal limit; lo[r] > 0 only in a
//   sliding-window layer, window > 0: the row at position p sees p - window < key <= p); the CTA walks its key
//   range [k_begin, k_end) in tiles of TILE keys, flash-decoding style:
//     0. token offsets of the tile through the block table -> shared (one lookup per key, reused for K and V);
//     1. scores: LPT lanes per key, each lane a 16-byte vector of the key row, dot with every row's query
//        (held in shared, pre-scaled by scale*log2(e)), butterfly sum over the LPT lanes -> s[r][t];
//     2. online softmax: one warp per row: tile max, rescale factor alpha, p = exp2(s - m) in place, row sum;
//     3. P @ V: each thread owns 4 consecutive dims of a slice of the tile's keys ("part"), accumulates all R
//        rows in registers (acc *= alpha first), one V load serving every row;
//   then the parts are summed in shared. Decode splits the context over gridDim.z CTAs (partition_size keys
//   each) and writes per-split (m, l, normalized out) to a float workspace; paged_decode_reduce merges them.
//   Slots past seq_len (NaN garbage allowed) are never read: keys are only loaded for positions < k_end; with a
//   window, k_begin is the CTA's first visible key, so keys (and blocks) wholly before the window are never read.
#include "common.cuh"

namespace paged {

constexpr int TILE = 64;  // keys per tile
constexpr int PV_VEC = 4;  // dims per thread in P @ V

// Per-key scales of an 8-bit cache's tile (K and V), looked up with the block table; nothing for a float cache.
template <bool QUANT>
struct TileScales {
    float k_scale[TILE], v_scale[TILE];
};
template <>
struct TileScales<false> {};

// Where an 8-bit cache's scales of one kv head live: [2][num_blocks][block_size] floats through element strides.
struct ScaleView {
    const float* __restrict__ p;  // the kv head's scale of (K, block 0, slot 0); nullptr for a float cache
    i64 stride_kv, stride_block, stride_slot;
};

// NOTE: the scales are a base class so that a float cache's (empty) one takes no shared memory.
template <int HD, int MAXR, bool QUANT = false>
struct AttnSmem : TileScales<QUANT> {
    float q[MAXR][HD];     // queries, pre-scaled by scale * log2(e)
    float s[MAXR][TILE];   // scores, then probabilities
    float red[MAXR][HD];   // sum of the P @ V parts
    float m[MAXR];         // running max (log2 domain)
    float l[MAXR];         // running sum
    float alpha[MAXR];     // this tile's rescale factor
    int lim[MAXR];         // row r sees keys [lo[r], lim[r])
    int lo[MAXR];
    i64 off[TILE];         // element offset of each key row of the tile (within the kv head)
};

// Runs the online softmax over keys [k_begin, k_end) for rows 0..R-1 of sm.q/sm.lim; leaves the unnormalized
// output in sm.red and (m, l) in sm.m/sm.l. All threads of the CTA must call it.
// T is the CACHE element type: float/__half/__nv_bfloat16, or an 8-bit code type (signed char, fp8_e4m3,
// fp8_e5m2) whose rows are dequantised with their scale (sv) as they are loaded.
template <class T, int HD, int MAXR>
__device__ __forceinline__ void attend_rows(AttnSmem<HD, MAXR, Quant<T>::ENABLED>& sm, const int R,
                                            const T* __restrict__ k_base, const i64 stride_kv,
                                            const i64 stride_block, const i64 stride_slot,
                                            const int* __restrict__ bt, const int block_size, const int k_begin,
                                            const int k_end, const ScaleView sv) {
    constexpr bool QUANT = Quant<T>::ENABLED;
    constexpr int EK = 16 / (int)sizeof(T);                  // elements per 16-byte vector
    constexpr int LPT = (HD / EK) < 32 ? (HD / EK) : 32;     // lanes per key in the score phase
    constexpr int EPL = HD / LPT;                            // elements per lane
    constexpr int TPR = HD / PV_VEC;                         // threads per V row in the P @ V phase
    static_assert(HD % EK == 0 && HD % LPT == 0 && (LPT & (LPT - 1)) == 0, "unsupported head_dim");
    static_assert(32 % LPT == 0 && TPR <= 256, "unsupported head_dim");

    const int tid = threadIdx.x;
    const int nt = blockDim.x;
    const int warp = tid / 32, lane = tid % 32, nwarps = nt / 32;
    const int group = tid / LPT, sub = tid % LPT, ngroups = nt / LPT;
    const int part = tid / TPR, d0 = (tid % TPR) * PV_VEC, nparts = nt / TPR;
    const T* __restrict__ v_base = k_base + stride_kv;

    float acc[MAXR][PV_VEC];
#pragma unroll
    for (int r = 0; r < MAXR; ++r)
#pragma unroll
        for (int i = 0; i < PV_VEC; ++i) acc[r][i] = 0.f;

    // NOTE: tiles sit on the absolute grid (multiples of TILE), whatever k_begin is: a row's sums then run over the
    // same tiles in the same order in every CTA that sees it (decode or prefill, any split of the CTA's rows), which
    // is what makes its output batch invariant. Keys of a tile before k_begin (t < t_lo) are never loaded: their
    // score is -inf, so they add exact zeros, as the row's own masked keys do.
    for (int k0 = k_begin - k_begin % TILE; k0 < k_end; k0 += TILE) {
        const int tile_len = min(TILE, k_end - k0);
        const int t_lo = max(0, k_begin - k0);
        // 0. block-table lookups for the tile.
        for (int t = t_lo + tid; t < tile_len; t += nt) {
            const int pos = k0 + t;
            const i64 blk = bt[pos / block_size], slot = pos % block_size;
            sm.off[t] = blk * stride_block + slot * stride_slot;
            if constexpr (QUANT) {
                const i64 so = blk * sv.stride_block + slot * sv.stride_slot;
                sm.k_scale[t] = sv.p[so];
                sm.v_scale[t] = sv.p[sv.stride_kv + so];
            }
        }
        __syncthreads();

        // 1. scores. The loop bound is uniform over the warp so every lane reaches the shuffles.
        for (int base = 0; base < tile_len; base += ngroups) {
            const int t = base + group;
            const bool valid = t >= t_lo && t < tile_len;
            float kf[EPL];
            if (valid) {
                if constexpr (QUANT)
                    load_dequant<T, EPL>(k_base + sm.off[t] + sub * EPL, sm.k_scale[t], kf);
                else
                    load_float<T, EPL>(k_base + sm.off[t] + sub * EPL, kf);
            } else {
#pragma unroll
                for (int e = 0; e < EPL; ++e) kf[e] = 0.f;
            }
            for (int r = 0; r < R; ++r) {
                const float* qr = &sm.q[r][sub * EPL];
                float dot = 0.f;
#pragma unroll
                for (int e = 0; e < EPL; ++e) dot += kf[e] * qr[e];
                dot = group_sum<LPT>(dot);
                // lo[r] <= key < lim[r], as one unsigned compare (a key before lo wraps to a huge offset)
                if (valid && sub == 0)
                    sm.s[r][t] = (unsigned)(k0 + t - sm.lo[r]) < (unsigned)(sm.lim[r] - sm.lo[r]) ? dot : PAGED_NEG_INF;
                else if (t < t_lo && sub == 0)
                    sm.s[r][t] = PAGED_NEG_INF;
            }
        }
        __syncthreads();

        // 2. online softmax, one warp per row.
        for (int r = warp; r < R; r += nwarps) {
            float mx = PAGED_NEG_INF;
            for (int t = lane; t < tile_len; t += 32) mx = fmaxf(mx, sm.s[r][t]);
            mx = warp_max(mx);
            const float m_old = sm.m[r];
            const float m_new = fmaxf(m_old, mx);
            float sum = 0.f;
            if (m_new != PAGED_NEG_INF) {  // else no visible key yet: p = 0, alpha = 1 (acc is still 0)
                for (int t = lane; t < tile_len; t += 32) {
                    const float p = exp2f(sm.s[r][t] - m_new);  // exp2(-inf) = 0 for masked keys
                    sm.s[r][t] = p;
                    sum += p;
                }
            } else {
                for (int t = lane; t < tile_len; t += 32) sm.s[r][t] = 0.f;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                const float alpha = (m_new == PAGED_NEG_INF) ? 1.f : exp2f(m_old - m_new);
                sm.alpha[r] = alpha;
                sm.l[r] = sm.l[r] * alpha + sum;
                sm.m[r] = m_new;
            }
        }
        __syncthreads();

        // 3. P @ V.
        if (part < nparts) {
#pragma unroll
            for (int r = 0; r < MAXR; ++r)
                if (r < R) {
                    const float a = sm.alpha[r];
#pragma unroll
                    for (int i = 0; i < PV_VEC; ++i) acc[r][i] *= a;
                }
            // NOTE: key t always goes to part t % nparts (the grouping of the sums is fixed); before t_lo, p = 0 and
            // V is not read (skipping adds the same exact zero)
            for (int t = part; t < tile_len; t += nparts) {
                if (t < t_lo) continue;
                float vf[PV_VEC];
                if constexpr (QUANT)
                    load_dequant<T, PV_VEC>(v_base + sm.off[t] + d0, sm.v_scale[t], vf);
                else
                    load_float<T, PV_VEC>(v_base + sm.off[t] + d0, vf);
#pragma unroll
                for (int r = 0; r < MAXR; ++r)
                    if (r < R) {
                        const float p = sm.s[r][t];
#pragma unroll
                        for (int i = 0; i < PV_VEC; ++i) acc[r][i] += p * vf[i];
                    }
            }
        }
        __syncthreads();
    }

    // Sum the parts into sm.red, one part at a time.
    for (int pp = 0; pp < nparts; ++pp) {
        if (part == pp) {
#pragma unroll
            for (int r = 0; r < MAXR; ++r)
                if (r < R)
#pragma unroll
                    for (int i = 0; i < PV_VEC; ++i)
                        sm.red[r][d0 + i] = (pp == 0 ? 0.f : sm.red[r][d0 + i]) + acc[r][i];
        }
        __syncthreads();
    }
}

template <int MAXR>
__device__ __forceinline__ void init_rows(float* m, float* l, int* lim, int* lo, int R, int row_lim_base,
                                          int heads_per_row, int window) {
    // decode/prefill helper: row r = (token r / heads_per_row, head r % heads_per_row); token j sees keys up to lim
    // base + j (exclusive), and with a window only the last `window` of them.
    for (int r = threadIdx.x; r < MAXR; r += blockDim.x) {
        m[r] = PAGED_NEG_INF;
        l[r] = 0.f;
        lim[r] = r < R ? row_lim_base + r / heads_per_row : 0;
        lo[r] = window > 0 ? max(0, lim[r] - window) : 0;
    }
}

// Load rows' queries: row r = (token tok0 + r / hpc, head h0 + r % hpc), scaled into the log2 domain.
template <class T, int HD, int MAXR, bool QUANT>
__device__ __forceinline__ void load_queries(AttnSmem<HD, MAXR, QUANT>& sm, const T* __restrict__ q, i64 q_stride_t,
                                             i64 q_stride_h, int tok0, int h0, int hpc, int R, float scale) {
    const float qs = scale * PAGED_LOG2E;
    for (int i = threadIdx.x; i < R * HD; i += blockDim.x) {
        const int r = i / HD, d = i % HD;
        const int tok = tok0 + r / hpc, h = h0 + r % hpc;
        sm.q[r][d] = to_float(q[(i64)tok * q_stride_t + (i64)h * q_stride_h + d]) * qs;
    }
}

// What both attention passes read and write: the packed queries and outputs (T), the pool (cache type C; an
// 8-bit cache's scales [2][num_blocks][block_size][kv_heads] beside it, nullptr for a float cache), the block
// tables.
// NOTE: built by value in each entry point from its flat arguments (the launch ABI CuPy binds stays flat).
template <class T, class C>
struct PagedArgs {
    T* __restrict__ out;
    i64 out_stride_t, out_stride_h;
    const T* __restrict__ q;
    i64 q_stride_t, q_stride_h;
    const C* __restrict__ kv;
    i64 stride_kv, stride_block, stride_slot, stride_head;
    const float* __restrict__ scales;
    i64 sc_stride_kv, sc_stride_block, sc_stride_slot, sc_stride_head;
    const int* __restrict__ block_tables;
    i64 bt_stride;
    const int* __restrict__ seq_lens;
    const int* __restrict__ query_start_loc;
    int num_heads, num_kv_heads, heads_per_cta, block_size;
    float scale;
    int window;  // > 0: a sliding-window layer's; 0: none

    __device__ __forceinline__ ScaleView scale_view(const int kvh) const {
        if constexpr (Quant<C>::ENABLED)
            return {scales + (i64)kvh * sc_stride_head, sc_stride_kv, sc_stride_block, sc_stride_slot};
        else
            return {nullptr, 0, 0, 0};
    }
};

template <class T, class C, int HD>
__device__ __forceinline__ void paged_decode_impl(const PagedArgs<T, C>& a, const i64* __restrict__ seq_index,
                                                  float* __restrict__ part_out, float* __restrict__ part_ml,
                                                  const int partition_size) {
    T* __restrict__ out = a.out;
    const i64 out_stride_t = a.out_stride_t, out_stride_h = a.out_stride_h;
    const int* __restrict__ seq_lens = a.seq_lens;
    const int* __restrict__ query_start_loc = a.query_start_loc;
    const int num_heads = a.num_heads, num_kv_heads = a.num_kv_heads, heads_per_cta = a.heads_per_cta;
    constexpr int MAXR = 8;
    __shared__ AttnSmem<HD, MAXR, Quant<C>::ENABLED> sm;
    const int h0 = blockIdx.x * heads_per_cta;
    const int row = blockIdx.y;  // index among the decode sequences
    const int seq = seq_index ? (int)seq_index[row] : row;
    const int split = blockIdx.z, num_splits = gridDim.z;
    const int ctx = seq_lens[seq];
    // The splits cover the visible keys [first visible, ctx): with a window, the last `window` positions.
    // NOTE: written as a conditional add: the select form costs paged_decode_f32_d256 a 4-byte spill on sm_90.
    int k_begin = split * partition_size;
    if (a.window > 0 && ctx > a.window) k_begin += ctx - a.window;
    if (k_begin >= ctx) return;  // empty split: the reduce pass ignores it (uniform over the CTA)
    const int k_end = min(ctx, k_begin + partition_size);
    const int group = num_heads / num_kv_heads;
    const int kvh = h0 / group;
    const int R = heads_per_cta;
    const int tok = query_start_loc[seq];

    // NOTE: rows' lo stays 0: the splits start at the first visible key already (one token: one window)
    init_rows<MAXR>(sm.m, sm.l, sm.lim, sm.lo, R, ctx, 1 << 30, 0);
    load_queries<T, HD, MAXR>(sm, a.q, a.q_stride_t, a.q_stride_h, tok, h0, R, R, a.scale);
    __syncthreads();
    attend_rows<C, HD, MAXR>(sm, R, a.kv + (i64)kvh * a.stride_head, a.stride_kv, a.stride_block, a.stride_slot,
                             a.block_tables + (i64)seq * a.bt_stride, a.block_size, k_begin, k_end,
                             a.scale_view(kvh));
    // attend_rows ends with a barrier: sm.red/m/l are complete.
    for (int i = threadIdx.x; i < R * HD; i += blockDim.x) {
        const int r = i / HD, d = i % HD;
        const float o = sm.red[r][d] / sm.l[r];
        if (num_splits == 1) {
            out[(i64)tok * out_stride_t + (i64)(h0 + r) * out_stride_h + d] = from_float<T>(o);
        } else {
            const i64 slot = ((i64)row * num_heads + h0 + r) * num_splits + split;
            part_out[slot * HD + d] = o;
            if (d == 0) {
                part_ml[slot * 2] = sm.m[r];
                part_ml[slot * 2 + 1] = sm.l[r];
            }
        }
    }
}

template <class T, int HD>
__device__ __forceinline__ void paged_decode_reduce_impl(
    T* __restrict__ out, const i64 out_stride_t, const i64 out_stride_h, const float* __restrict__ part_out,
    const float* __restrict__ part_ml, const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc,
    const i64* __restrict__ seq_index, const int num_heads, const int num_splits, const int partition_size,
    const int window) {
    const int h = blockIdx.x, row = blockIdx.y;
    const int seq = seq_index ? (int)seq_index[row] : row;
    const int ctx = seq_lens[seq];
    const int visible = window > 0 ? min(ctx, window) : ctx;  // the keys the decode's splits cover
    const int used = min(num_splits, (visible + partition_size - 1) / partition_size);
    const i64 first = ((i64)row * num_heads + h) * num_splits;
    float mx = PAGED_NEG_INF;
    for (int s = 0; s < used; ++s) mx = fmaxf(mx, part_ml[(first + s) * 2]);
    const i64 tok = query_start_loc[seq];
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float num = 0.f, den = 0.f;
        for (int s = 0; s < used; ++s) {
            const float w = part_ml[(first + s) * 2 + 1] * exp2f(part_ml[(first + s) * 2] - mx);
            num += w * part_out[(first + s) * HD + d];
            den += w;
        }
        out[tok * out_stride_t + (i64)h * out_stride_h + d] = from_float<T>(num / den);
    }
}

template <class T, class C, int HD>
__device__ __forceinline__ void paged_prefill_impl(const PagedArgs<T, C>& a, const int q_tile,
                                                   const int min_q_len) {
    const int* __restrict__ query_start_loc = a.query_start_loc;
    const int heads_per_cta = a.heads_per_cta;
    constexpr int MAXR = 16;
    __shared__ AttnSmem<HD, MAXR, Quant<C>::ENABLED> sm;
    const int h0 = blockIdx.x * heads_per_cta;
    const int seq = blockIdx.y;
    const int start = query_start_loc[seq];
    const int q_len = query_start_loc[seq + 1] - start;
    const int j0 = blockIdx.z * q_tile;
    if (q_len < min_q_len || j0 >= q_len) return;  // uniform over the CTA
    const int nq = min(q_tile, q_len - j0);
    const int ctx = a.seq_lens[seq];
    const int R = nq * heads_per_cta;
    const int first_pos = ctx - q_len + j0;  // position of this tile's first query token
    const int kvh = h0 / (a.num_heads / a.num_kv_heads);

    init_rows<MAXR>(sm.m, sm.l, sm.lim, sm.lo, R, first_pos + 1, heads_per_cta, a.window);
    load_queries<T, HD, MAXR>(sm, a.q, a.q_stride_t, a.q_stride_h, start + j0, h0, heads_per_cta, R, a.scale);
    __syncthreads();
    // The walk starts at the tile's first row's first visible key (rows go by position).
    const int k_begin = a.window > 0 ? max(0, first_pos + 1 - a.window) : 0;
    attend_rows<C, HD, MAXR>(sm, R, a.kv + (i64)kvh * a.stride_head, a.stride_kv, a.stride_block, a.stride_slot,
                             a.block_tables + (i64)seq * a.bt_stride, a.block_size, k_begin, first_pos + nq,
                             a.scale_view(kvh));
    for (int i = threadIdx.x; i < R * HD; i += blockDim.x) {
        const int r = i / HD, d = i % HD;
        const i64 tok = start + j0 + r / heads_per_cta;
        const int h = h0 + r % heads_per_cta;
        a.out[tok * a.out_stride_t + (i64)h * a.out_stride_h + d] = from_float<T>(sm.red[r][d] / sm.l[r]);
    }
}

template <class T>
__device__ __forceinline__ void write_kv_impl(T* __restrict__ kv, const i64 stride_kv, const i64 stride_block,
                                              const i64 stride_slot, const i64 stride_head,
                                              const T* __restrict__ key, const i64 k_stride_t, const i64 k_stride_h,
                                              const T* __restrict__ value, const i64 v_stride_t,
                                              const i64 v_stride_h, const i64* __restrict__ slot_mapping,
                                              const int num_kv_heads, const int head_dim, const int block_size) {
    const i64 t = blockIdx.x;
    const i64 slot = slot_mapping[t];
    if (slot < 0) return;  // padding token
    const i64 dst = (slot / block_size) * stride_block + (slot % block_size) * stride_slot;
    for (int i = threadIdx.x; i < num_kv_heads * head_dim; i += blockDim.x) {
        const int h = i / head_dim, d = i % head_dim;
        kv[dst + h * stride_head + d] = key[t * k_stride_t + h * k_stride_h + d];
        kv[stride_kv + dst + h * stride_head + d] = value[t * v_stride_t + h * v_stride_h + d];
    }
}

// The quantising write into an 8-bit cache (codes C, scales float), from keys/values of type T. One warp per
// (K or V, kv head) row of token blockIdx.x: absmax over head_dim (warp reduction), scale = max(absmax /
// QUANT_MAX, 1e-30), code = encode(x / scale): bit-identical to worker_svc/attention/quant.py::quantize.
// blockDim.x must be a multiple of 32.
template <class T, class C>
__device__ __forceinline__ void write_kv_quant_impl(
    C* __restrict__ kv, const i64 stride_kv, const i64 stride_block, const i64 stride_slot, const i64 stride_head,
    float* __restrict__ scales, const i64 sc_stride_kv, const i64 sc_stride_block, const i64 sc_stride_slot,
    const i64 sc_stride_head, const T* __restrict__ key, const i64 k_stride_t, const i64 k_stride_h,
    const T* __restrict__ value, const i64 v_stride_t, const i64 v_stride_h, const i64* __restrict__ slot_mapping,
    const int num_kv_heads, const int head_dim, const int block_size) {
    const i64 t = blockIdx.x;
    const i64 slot = slot_mapping[t];
    if (slot < 0) return;  // padding token (uniform over the CTA)
    const i64 blk = slot / block_size, off = slot % block_size;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
    for (int row = warp; row < 2 * num_kv_heads; row += nwarps) {  // uniform over the warp: all lanes reduce
        const int which = row / num_kv_heads, h = row % num_kv_heads;
        const T* src = which ? value + t * v_stride_t + h * v_stride_h : key + t * k_stride_t + h * k_stride_h;
        float amax = 0.f;
        for (int d = lane; d < head_dim; d += 32) amax = fmaxf(amax, fabsf(to_float(src[d])));
        amax = warp_max(amax);
        const float s = fmaxf(div_rn(amax, Quant<C>::MAX), 1e-30f);
        C* dst = kv + which * stride_kv + blk * stride_block + off * stride_slot + h * stride_head;
        for (int d = lane; d < head_dim; d += 32) dst[d] = encode<C>(div_rn(to_float(src[d]), s));
        if (lane == 0)
            scales[which * sc_stride_kv + blk * sc_stride_block + off * sc_stride_slot + h * sc_stride_head] = s;
    }
}

// Whole-block copies in every layer, K and V: pool viewed as words W; strides in words.
template <class W>
__device__ __forceinline__ void copy_blocks_impl(W* __restrict__ pool, const i64 layer_stride, const i64 kv_stride,
                                                 const i64 block_stride, const i64 words_per_block,
                                                 const i64* __restrict__ src, const i64* __restrict__ dst) {
    const i64 pair = blockIdx.x;
    const int layer = blockIdx.y / 2, which = blockIdx.y % 2;
    W* base = pool + layer * layer_stride + which * kv_stride;
    const W* from = base + src[pair] * block_stride;
    W* to = base + dst[pair] * block_stride;
    for (i64 i = threadIdx.x; i < words_per_block; i += blockDim.x) to[i] = from[i];
}

}  // namespace paged

// ---- extern "C" entry points --------------------------------------------------------------------------------
// Parameter lists shared by the float and the 8-bit entries; an 8-bit entry has the scales' pointer and strides
// right after the pool's (PAGED_SCALE_PARAMS), a float one passes PagedArgs no scales.
#define PAGED_HEAD_PARAMS(T, C)                                                                                    \
    T *out, long long out_stride_t, long long out_stride_h, const T *q, long long q_stride_t,                      \
        long long q_stride_h, const C *kv, long long stride_kv, long long stride_block, long long stride_slot,     \
        long long stride_head,
#define PAGED_SCALE_PARAMS                                                                                         \
    const float *kv_scales, long long sc_stride_kv, long long sc_stride_block, long long sc_stride_slot,           \
        long long sc_stride_head,
#define PAGED_SCALES kv_scales, sc_stride_kv, sc_stride_block, sc_stride_slot, sc_stride_head
#define PAGED_NO_SCALES nullptr, 0, 0, 0, 0
// NOTE: variadic, since the scales arrive already expanded into their five comma-separated arguments.
#define PAGED_ARGS(...)                                                                                            \
    {out, out_stride_t, out_stride_h, q, q_stride_t, q_stride_h, kv, stride_kv, stride_block, stride_slot,          \
     stride_head, __VA_ARGS__, block_tables, bt_stride, seq_lens, query_start_loc, num_heads, num_kv_heads,        \
     heads_per_cta, block_size, scale, window}

// paged_decode_<TAG>_d<HD> and paged_prefill_<TAG>_d<HD> (TAG: the query type, then the cache type if 8-bit).
#define PAGED_ATTN_KERNELS(TAG, T, C, SCALE_PARAMS, SCALES, HD)                                                    \
    extern "C" __global__ void __launch_bounds__(256) paged_decode_##TAG##_d##HD(                                  \
        PAGED_HEAD_PARAMS(T, C) SCALE_PARAMS const int* block_tables, long long bt_stride, const int* seq_lens,    \
        const int* query_start_loc, const long long* seq_index, float* part_out, float* part_ml, int num_heads,    \
        int num_kv_heads, int heads_per_cta, int block_size, int partition_size, float scale, int window) {       \
        const paged::PagedArgs<T, C> a PAGED_ARGS(SCALES);                                                         \
        paged::paged_decode_impl<T, C, HD>(a, seq_index, part_out, part_ml, partition_size);                       \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(256) paged_prefill_##TAG##_d##HD(                                 \
        PAGED_HEAD_PARAMS(T, C) SCALE_PARAMS const int* block_tables, long long bt_stride, const int* seq_lens,    \
        const int* query_start_loc, int num_heads, int num_kv_heads, int heads_per_cta, int q_tile,                \
        int block_size, int min_q_len, float scale, int window) {                                                  \
        const paged::PagedArgs<T, C> a PAGED_ARGS(SCALES);                                                         \
        paged::paged_prefill_impl<T, C, HD>(a, q_tile, min_q_len);                                                 \
    }

// Float caches: the cache type is the query type; the split-decode reduce (only the output type matters, so
// 8-bit caches use it too).
#define PAGED_ATTN_ENTRIES(TN, T, HD)                                                                              \
    PAGED_ATTN_KERNELS(TN, T, T, , PAGED_NO_SCALES, HD)                                                            \
    extern "C" __global__ void paged_decode_reduce_##TN##_d##HD(                                                   \
        T* out, long long out_stride_t, long long out_stride_h, const float* part_out, const float* part_ml,       \
        const int* seq_lens, const int* query_start_loc, const long long* seq_index, int num_heads,                \
        int num_splits, int partition_size, int window) {                                                          \
        paged::paged_decode_reduce_impl<T, HD>(out, out_stride_t, out_stride_h, part_out, part_ml, seq_lens,       \
                                               query_start_loc, seq_index, num_heads, num_splits, partition_size,  \
                                               window);                                                            \
    }

// 8-bit caches: paged_decode_<TN>_<CN>_d<HD>, paged_prefill_<TN>_<CN>_d<HD> for head dims 64/128/256, and the
// quantising write write_kv_<TN>_<CN>.
#define PAGED_QUANT_ATTN(TAG, T, C, HD) PAGED_ATTN_KERNELS(TAG, T, C, PAGED_SCALE_PARAMS, PAGED_SCALES, HD)
#define PAGED_QUANT_ENTRIES(TN, T, CN, C)                                                                          \
    PAGED_QUANT_ATTN(TN##_##CN, T, C, 64)                                                                          \
    PAGED_QUANT_ATTN(TN##_##CN, T, C, 128)                                                                         \
    PAGED_QUANT_ATTN(TN##_##CN, T, C, 256)                                                                         \
    extern "C" __global__ void write_kv_##TN##_##CN(                                                               \
        C* kv, long long stride_kv, long long stride_block, long long stride_slot, long long stride_head,          \
        float* kv_scales, long long sc_stride_kv, long long sc_stride_block, long long sc_stride_slot,             \
        long long sc_stride_head, const T* key, long long k_stride_t, long long k_stride_h, const T* value,        \
        long long v_stride_t, long long v_stride_h, const long long* slot_mapping, int num_kv_heads,               \
        int head_dim, int block_size) {                                                                            \
        paged::write_kv_quant_impl<T, C>(kv, stride_kv, stride_block, stride_slot, stride_head, kv_scales,         \
                                         sc_stride_kv, sc_stride_block, sc_stride_slot, sc_stride_head, key,       \
                                         k_stride_t, k_stride_h, value, v_stride_t, v_stride_h, slot_mapping,      \
                                         num_kv_heads, head_dim, block_size);                                      \
    }

#define PAGED_WRITE_ENTRY(TN, T)                                                                                   \
    extern "C" __global__ void write_kv_##TN(T* kv, long long stride_kv, long long stride_block,                   \
                                             long long stride_slot, long long stride_head, const T* key,           \
                                             long long k_stride_t, long long k_stride_h, const T* value,           \
                                             long long v_stride_t, long long v_stride_h,                           \
                                             const long long* slot_mapping, int num_kv_heads, int head_dim,        \
                                             int block_size) {                                                     \
        paged::write_kv_impl<T>(kv, stride_kv, stride_block, stride_slot, stride_head, key, k_stride_t,            \
                                k_stride_h, value, v_stride_t, v_stride_h, slot_mapping, num_kv_heads, head_dim,   \
                                block_size);                                                                       \
    }

#define PAGED_COPY_ENTRY(WN, W)                                                                                    \
    extern "C" __global__ void copy_blocks_##WN(W* pool, long long layer_stride, long long kv_stride,              \
                                                long long block_stride, long long words_per_block,                 \
                                                const long long* src, const long long* dst) {                      \
        paged::copy_blocks_impl<W>(pool, layer_stride, kv_stride, block_stride, words_per_block, src, dst);        \
    }

PAGED_WRITE_ENTRY(f32, float)
PAGED_WRITE_ENTRY(f16, __half)
PAGED_WRITE_ENTRY(bf16, __nv_bfloat16)

PAGED_ATTN_ENTRIES(f32, float, 64)
PAGED_ATTN_ENTRIES(f32, float, 128)
PAGED_ATTN_ENTRIES(f32, float, 256)
PAGED_ATTN_ENTRIES(f16, __half, 64)
PAGED_ATTN_ENTRIES(f16, __half, 128)
PAGED_ATTN_ENTRIES(f16, __half, 256)
PAGED_ATTN_ENTRIES(bf16, __nv_bfloat16, 64)
PAGED_ATTN_ENTRIES(bf16, __nv_bfloat16, 128)
PAGED_ATTN_ENTRIES(bf16, __nv_bfloat16, 256)

PAGED_QUANT_ENTRIES(f32, float, i8, signed char)
PAGED_QUANT_ENTRIES(f32, float, e4m3, paged::fp8_e4m3)
PAGED_QUANT_ENTRIES(f32, float, e5m2, paged::fp8_e5m2)
PAGED_QUANT_ENTRIES(f16, __half, i8, signed char)
PAGED_QUANT_ENTRIES(f16, __half, e4m3, paged::fp8_e4m3)
PAGED_QUANT_ENTRIES(f16, __half, e5m2, paged::fp8_e5m2)
PAGED_QUANT_ENTRIES(bf16, __nv_bfloat16, i8, signed char)
PAGED_QUANT_ENTRIES(bf16, __nv_bfloat16, e4m3, paged::fp8_e4m3)
PAGED_QUANT_ENTRIES(bf16, __nv_bfloat16, e5m2, paged::fp8_e5m2)

PAGED_COPY_ENTRY(u8, unsigned char)
PAGED_COPY_ENTRY(u16, unsigned short)
PAGED_COPY_ENTRY(u32, unsigned int)
PAGED_COPY_ENTRY(u128, uint4)
