// Weight-only quantised matmul on the GPU: y[M, N] = x[M, K] @ W^T (+ bias) for W [N, K] kept in a GGML block format
// (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) as the GGUF file stores it: uint8 [N, row_bytes], row n the file's blocks of
// output n, no repacking (worker_svc/quant/formats.py documents the blocks). x, bias and y are float32, float16 or
// bfloat16 (one type a kernel); x and y rows have their own element strides (columns contiguous).
//
// Entry points (extern "C", fetched by name from CuPy's RawModule; FMT in q4_0/q4_1/q5_0/q8_0/q4_k/q6_k, TN in
// f32/f16/bf16):
//   quant_gemm_FMT_TN(w, x, x_stride, bias or null, y, y_stride, M, N, K)
//     grid (ceil(N / warps), ceil(M / QG_ROWS)), block: warps * 32 threads (any 1 <= warps <= 8).
//   K must be whole blocks of the format (32; 256 for Q4_K, Q6_K). The device's x loads are 16-byte vectors: x's base
//   and row stride must keep every row 16-byte aligned (the backend checks).
//
// ARITHMETIC CONTRACT (what tests/support/quant_gemm_reference.py emulates bit for bit; BATCH INVARIANT: y[m, n]
// depends on x[m], W[n] and bias[n] only, never on M, on the other rows, on the grid or on the warps a block):
//   1. Each weight is dequantised in float32 exactly as formats.py computes it (its one rounding at the step named
//      there): Q4_0 d * (q - 8), Q4_1 d * q + m, Q5_0 d * (q - 16), Q8_0 d * q, Q4_K (d * sc) * q - dmin * mn,
//      Q6_K (d * sc) * q; fp16 fields widened exactly. x (and bias) are widened exactly to float32.
//   2. K is cut into groups of 32 consecutive inputs (g = k / 32: a block of the 32-weight formats, a sub-block of
//      the K-quants). Lane l (0..31) owns the groups g = l, l + 32, l + 64, ... and keeps ONE float32 accumulator
//      per row, starting at +0.0, updated acc = fmaf(w[n, k], x[m, k], acc) for its groups in increasing g and, in
//      a group, k in increasing order. A lane with no group keeps +0.0.
//   3. The 32 partial sums are reduced by the XOR butterfly of common.cuh's warp_sum: for s = 16, 8, 4, 2, 1 every
//      lane adds v[l ^ s] to its v[l] (v[l] + v[l ^ s]: float32 addition is commutative, so all lanes agree).
//   4. y[m, n] = round_to_T(sum + bias[n]) (one float32 addition where there is a bias, then round to nearest even
//      into float16 / bfloat16; float32 as is).
//   Nothing in 2-4 depends on how rows are tiled: a warp computes one output column for QG_ROWS rows at a time, the
//   rows' chains side by side (each weight dequantised once, used by every row of the tile), and a tile past M
//   simply has fewer rows.
//
// Design (simple first; no GPU measured yet): one warp per (output column, tile of QG_ROWS rows); each lane walks its
// groups, dequantises a group's 32 weights in registers from the raw block bytes (lanes read 32 different blocks at
// a time: the warp's reads of a row are contiguous), reads x through L1/L2 (__ldg, 16-byte vectors), and the
// butterfly ends the chain. No shared memory, no __syncthreads: a warp past N returns as a whole.
#include "common.cuh"

#define QG_ROWS 8  // rows a warp carries at once (registers: QG_ROWS accumulators + 32 weights)

namespace paged {

enum QuantFmt { QG_Q4_0 = 2, QG_Q4_1 = 3, QG_Q5_0 = 6, QG_Q8_0 = 8, QG_Q4_K = 12, QG_Q6_K = 14 };  // GGML type ids

template <int F> struct QFormat;
template <> struct QFormat<QG_Q4_0> { static constexpr int BLOCK = 32, BYTES = 18; };
template <> struct QFormat<QG_Q4_1> { static constexpr int BLOCK = 32, BYTES = 20; };
template <> struct QFormat<QG_Q5_0> { static constexpr int BLOCK = 32, BYTES = 22; };
template <> struct QFormat<QG_Q8_0> { static constexpr int BLOCK = 32, BYTES = 34; };
template <> struct QFormat<QG_Q4_K> { static constexpr int BLOCK = 256, BYTES = 144; };
template <> struct QFormat<QG_Q6_K> { static constexpr int BLOCK = 256, BYTES = 210; };

// IEEE fp16 bits -> float32, exact, with integer operations only (the same on nvcc, NVRTC and the host shim).
__device__ __forceinline__ float half_bits_to_float(unsigned h) {
    const unsigned sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0u) {  // zero or subnormal: m * 2^-24, exact in float32
        const float mag = (float)m * bits_to_float(103u << 23);
        return bits_to_float(sign | float_to_bits(mag));
    }
    if (e == 31u) return bits_to_float(sign | 0x7F800000u | (m << 13));  // inf / NaN
    return bits_to_float(sign | ((e + 112u) << 23) | (m << 13));
}

__device__ __forceinline__ float fp16_at(const unsigned char* p) {
    return half_bits_to_float((unsigned)__ldg(p) | ((unsigned)__ldg(p + 1) << 8));
}

// The 32 weights of group g of a row (its bytes at `row`), dequantised as formats.py does (see the contract).
template <int F>
__device__ __forceinline__ void dequant_group(const unsigned char* __restrict__ row, int g, float (&w)[32]) {
    if constexpr (F == QG_Q4_0 || F == QG_Q4_1 || F == QG_Q5_0 || F == QG_Q8_0) {
        const unsigned char* b = row + (i64)g * QFormat<F>::BYTES;
        const float d = fp16_at(b);
        if constexpr (F == QG_Q8_0) {
#pragma unroll
            for (int j = 0; j < 32; ++j) w[j] = d * (float)(signed char)__ldg(b + 2 + j);
        } else if constexpr (F == QG_Q5_0) {
            // weight i's fifth bit: bit i of qh (little-endian uint32); nibbles as Q4_0's
            const unsigned qh = (unsigned)__ldg(b + 2) | ((unsigned)__ldg(b + 3) << 8) |
                                ((unsigned)__ldg(b + 4) << 16) | ((unsigned)__ldg(b + 5) << 24);
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const unsigned byte = __ldg(b + 6 + j);
                w[j] = d * (float)((int)((byte & 0xFu) | (((qh >> j) & 1u) << 4)) - 16);
                w[j + 16] = d * (float)((int)((byte >> 4) | (((qh >> (j + 16)) & 1u) << 4)) - 16);
            }
        } else {
            const int off = F == QG_Q4_0 ? 2 : 4;
            const float m = F == QG_Q4_1 ? fp16_at(b + 2) : 0.f;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const unsigned byte = __ldg(b + off + j);
                if constexpr (F == QG_Q4_0) {
                    w[j] = d * (float)((int)(byte & 0xFu) - 8);
                    w[j + 16] = d * (float)((int)(byte >> 4) - 8);
                } else {  // d * q exact: one rounding at the add (an FMA contraction gives the same)
                    w[j] = d * (float)(byte & 0xFu) + m;
                    w[j + 16] = d * (float)(byte >> 4) + m;
                }
            }
        }
    } else if constexpr (F == QG_Q4_K) {
        // sub-block j of super-block g / 8; scales and mins 6-bit, packed in s[0..11]; qs chunk j / 2, low nibbles
        // for even j, high for odd j.
        const unsigned char* b = row + (i64)(g >> 3) * QFormat<F>::BYTES;
        const int j = g & 7;
        const unsigned char* s = b + 4;
        unsigned sc, mn;
        if (j < 4) {
            sc = __ldg(s + j) & 63u;
            mn = __ldg(s + j + 4) & 63u;
        } else {
            sc = (__ldg(s + j + 4) & 0xFu) | ((unsigned)(__ldg(s + j - 4) >> 6) << 4);
            mn = (unsigned)(__ldg(s + j + 4) >> 4) | ((unsigned)(__ldg(s + j) >> 6) << 4);
        }
        const float d1 = fp16_at(b) * (float)sc, m1 = fp16_at(b + 2) * (float)mn;  // both exact
        const unsigned char* qs = b + 16 + 32 * (j >> 1);
        const int shift = (j & 1) * 4;
#pragma unroll
        for (int l = 0; l < 32; ++l) w[l] = d1 * (float)((__ldg(qs + l) >> shift) & 0xFu) - m1;
    } else {  // QG_Q6_K
        // sub-block j = quarter c of half h; weight l: ql[64h + 32(c & 1) + l] nibble c >> 1, qh[32h + l] bits
        // 2c..2c+1, less 32; scale sc[2j + l / 16]; w = (d * sc) * q, one rounding at the multiply by q.
        const unsigned char* b = row + (i64)(g >> 3) * QFormat<F>::BYTES;
        const int j = g & 7, h = j >> 2, c = j & 3;
        const unsigned char* ql = b + 64 * h + 32 * (c & 1);
        const unsigned char* qh = b + 128 + 32 * h;
        const float d = fp16_at(b + 208);
        const float a0 = d * (float)(signed char)__ldg(b + 192 + 2 * j);
        const float a1 = d * (float)(signed char)__ldg(b + 192 + 2 * j + 1);
        const int lshift = (c >> 1) * 4, hshift = 2 * c;
#pragma unroll
        for (int l = 0; l < 32; ++l) {
            const int q = (int)(((__ldg(ql + l) >> lshift) & 0xFu) | (((__ldg(qh + l) >> hshift) & 3u) << 4)) - 32;
            w[l] = (l < 16 ? a0 : a1) * (float)q;
        }
    }
}

template <int F, class T>
__device__ __forceinline__ void quant_gemm_impl(const unsigned char* __restrict__ w, const T* __restrict__ x,
                                                i64 x_stride, const T* __restrict__ bias, T* __restrict__ y,
                                                i64 y_stride, int M, int N, int K) {
    const int warps = (int)(blockDim.x / 32), lane = (int)(threadIdx.x % 32);
    const int n = (int)blockIdx.x * warps + (int)(threadIdx.x / 32);
    if (n >= N) return;  // the whole warp: no shuffle is left waiting
    const int row0 = (int)blockIdx.y * QG_ROWS;
    const int rows = min(QG_ROWS, M - row0);
    const i64 row_bytes = (i64)(K / QFormat<F>::BLOCK) * QFormat<F>::BYTES;
    const unsigned char* wrow = w + (i64)n * row_bytes;
    const int groups = K / 32;

    float acc[QG_ROWS];
#pragma unroll
    for (int r = 0; r < QG_ROWS; ++r) acc[r] = 0.f;
    for (int g = lane; g < groups; g += 32) {
        float wg[32];
        dequant_group<F>(wrow, g, wg);
#pragma unroll
        for (int r = 0; r < QG_ROWS; ++r) {
            if (r < rows) {
                const T* xr = x + (i64)(row0 + r) * x_stride + (i64)g * 32;
#pragma unroll
                for (int part = 0; part < 4; ++part) {
                    float xv[8];
                    load_float<T, 8>(xr + 8 * part, xv);
#pragma unroll
                    for (int k = 0; k < 8; ++k) acc[r] = fmaf(wg[8 * part + k], xv[k], acc[r]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < QG_ROWS; ++r) {
        if (r < rows) {  // uniform across the warp: every lane shuffles
            float v = warp_sum(acc[r]);
            if (lane == r) {
                if (bias != nullptr) v += to_float(bias[n]);
                y[(i64)(row0 + r) * y_stride + n] = from_float<T>(v);
            }
        }
    }
}

}  // namespace paged

// ---- extern "C" entry points --------------------------------------------------------------------------------
#define QUANT_GEMM_ENTRY(FN, F, TN, T)                                                                             \
    extern "C" __global__ void __launch_bounds__(256) quant_gemm_##FN##_##TN(                                     \
        const unsigned char* w, const T* x, long long x_stride, const T* bias, T* y, long long y_stride, int M,    \
        int N, int K) {                                                                                            \
        paged::quant_gemm_impl<F, T>(w, x, x_stride, bias, y, y_stride, M, N, K);                                  \
    }
#define QUANT_GEMM_TYPES(FN, F)                                                                                    \
    QUANT_GEMM_ENTRY(FN, F, f32, float)                                                                            \
    QUANT_GEMM_ENTRY(FN, F, f16, __half)                                                                           \
    QUANT_GEMM_ENTRY(FN, F, bf16, __nv_bfloat16)

QUANT_GEMM_TYPES(q4_0, paged::QG_Q4_0)
QUANT_GEMM_TYPES(q4_1, paged::QG_Q4_1)
QUANT_GEMM_TYPES(q5_0, paged::QG_Q5_0)
QUANT_GEMM_TYPES(q8_0, paged::QG_Q8_0)
QUANT_GEMM_TYPES(q4_k, paged::QG_Q4_K)
QUANT_GEMM_TYPES(q6_k, paged::QG_Q6_K)
