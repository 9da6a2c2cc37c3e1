// Batch-invariant float matmul and RMSNorm on the GPU, for the lean forward with --batch-invariant on
// (worker_svc/dense_gpu.py's CupyDenseKernel runs them): cuBLAS picks its kernel and split-K by M, and torch's
// row reductions pick their configuration by the number of rows, so a row's bits there depend on its batch.
// x, W, bias, weight and y are float32, float16 or bfloat16 (one type a kernel); x and y rows have their own element
// strides (columns contiguous). No alignment requirement: every load is one element.
//
// Entry points (extern "C", fetched by name from CuPy's RawModule; TN in f32/f16/bf16):
//   dense_gemm_TN(w, x, x_stride, bias or null, y, y_stride, M, N, K)      y[M, N] = x[M, K] @ W^T (+ bias)
//     W [N, K] row-major, contiguous. grid (ceil(N / DG_BN), ceil(M / DG_BM)), block DG_THREADS (256) threads.
//   rms_norm_TN(x, x_stride, weight, y, y_stride, M, H, eps)               y[M, H] = LlamaRMSNorm(x) * weight
//     grid (M), block: any multiple of 32 in 32..1024 threads (the caller's fixed choice: the sum's order is
//     the thread count's, see 2.).
//
// ARITHMETIC CONTRACT (BATCH INVARIANT: y[m, n] depends on x[m], W[n], bias[n] only, y[m, :] of rms_norm on x[m]
// and weight only; never on M, on the other rows or on the grid):
//   1. dense_gemm: x and W are widened exactly to float32; ONE float32 accumulator per output, starting at +0.0,
//      updated acc = fmaf(x[m, k], w[n, k], acc) for k = 0, 1, ..., K - 1 in increasing order (no split of K);
//      y[m, n] = round_to_T(acc + bias[n]) (one float32 addition where there is a bias, then round to nearest even
//      into float16 / bfloat16; float32 as is). How the output is tiled changes which thread runs a chain, never
//      the chain: a tile past M or N simply has fewer live outputs.
//   2. rms_norm, with T the block's thread count (fixed by the caller, validated) and xf = float32(x[m, k]):
//      thread t keeps s_t = fmaf(xf, xf, s_t) from +0.0 over k = t, t + T, t + 2T, ... < H in increasing order;
//      each warp adds its 32 s_t by common.cuh's XOR butterfly (warp_sum); sum = ((w_0 + w_1) + w_2) + ... over
//      the warps in order; var = sum / H and inv = 1 / sqrt(var + eps) (each an IEEE float32 operation, rounded
//      to nearest: __fdiv_rn / __fsqrt_rn on the device, the host's IEEE / and sqrtf in the shim, so both agree);
//      y[m, k] = round_to_T(float(weight[k]) * float(round_to_T(xf * inv))). That is transformers' LlamaRMSNorm,
//      weight * (xf * rsqrt(var + eps)).to(T), with torch's rounding of the product in T (for float16 / bfloat16
//      the product of two T values is exact in float32, so it is rounded once); only the order of the mean's sum
//      and rsqrt's rounding (torch's rsqrt is not correctly rounded) are this kernel's own.
//   Nothing but float32 FMAs, additions, one division and one square root: nvcc's FMA contraction (--fmad) finds
//   no separate multiply-add to fuse, so nvcc, NVRTC and the host shim compute the same bits.
//
// Design (simple first; no GPU measured yet): a SIMT tiled GEMM. A CTA owns a DG_BM x DG_BN output tile; for each
// K chunk of DG_BK it stages x[rows, chunk] and W[cols, chunk] in shared memory as float32 (transposed: k-major, so
// the inner loop's reads are broadcasts or consecutive), and each of its 16 x 16 threads carries a 4 x 4 register
// tile of outputs (rows ty + 16 i, columns tx + 16 j: the stores of a warp are consecutive). Register rows past M
// skip their FMAs, so a decode step's short tile costs the warps that hold its rows only. Not done: vectorised
// loads, double buffering, tensor cores (an MMA's internal summation order is the hardware's, not written here).
#include "common.cuh"

#define DG_BM 64  // rows of a CTA's output tile
#define DG_BN 64  // columns of a CTA's output tile
#define DG_BK 16  // K staged in shared memory at a time
#define DG_THREADS 256  // 16 x 16 threads, 4 x 4 outputs each
#define DG_TM 4  // register tile: rows a thread
#define DG_TN 4  // register tile: columns a thread

namespace paged {

// IEEE float32 square root, rounded to nearest on every compiler (never an approximation).
__device__ __forceinline__ float sqrt_rn(float x) {
#if defined(__CUDA_ARCH__)
    return __fsqrt_rn(x);
#else
    return sqrtf(x);
#endif
}

template <class T>
__device__ __forceinline__ void dense_gemm_impl(const T* __restrict__ w, const T* __restrict__ x, i64 x_stride,
                                                const T* __restrict__ bias, T* __restrict__ y, i64 y_stride, int M,
                                                int N, int K) {
    __shared__ float xs[DG_BK][DG_BM + 1];  // x[row0 + r, k0 + kk] at xs[kk][r] (+1: the staging stores spread)
    __shared__ float ws[DG_BK][DG_BN + 1];  // W[col0 + c, k0 + kk] at ws[kk][c]
    const int tid = (int)threadIdx.x, tx = tid % 16, ty = tid / 16;
    const int row0 = (int)blockIdx.y * DG_BM, col0 = (int)blockIdx.x * DG_BN;
    // register rows that exist (rows ty + 16 i < M - row0): the others skip their chains
    const int live = min(DG_TM, max(0, (M - row0 - ty + 15) / 16));

    float acc[DG_TM][DG_TN];
#pragma unroll
    for (int i = 0; i < DG_TM; ++i)
#pragma unroll
        for (int j = 0; j < DG_TN; ++j) acc[i][j] = 0.f;

    for (int k0 = 0; k0 < K; k0 += DG_BK) {
        const int kc = min(DG_BK, K - k0);
        // stage the chunk: element e = tid + 256 s of each 64 x 16 tile, kk = e % 16 (consecutive threads read
        // consecutive k of a row); outside M, N or K: 0 (never read into a live chain)
#pragma unroll
        for (int s = 0; s < (DG_BM * DG_BK) / DG_THREADS; ++s) {
            const int e = tid + DG_THREADS * s, kk = e % DG_BK, r = e / DG_BK;
            const int k = k0 + kk;
            xs[kk][r] = (row0 + r < M && kk < kc) ? to_float(x[(i64)(row0 + r) * x_stride + k]) : 0.f;
            ws[kk][r] = (col0 + r < N && kk < kc) ? to_float(w[(i64)(col0 + r) * K + k]) : 0.f;
        }
        __syncthreads();
        if (kc == DG_BK) {
#pragma unroll
            for (int kk = 0; kk < DG_BK; ++kk) {
                float wv[DG_TN];
#pragma unroll
                for (int j = 0; j < DG_TN; ++j) wv[j] = ws[kk][tx + 16 * j];
#pragma unroll
                for (int i = 0; i < DG_TM; ++i) {
                    if (i < live) {
                        const float xv = xs[kk][ty + 16 * i];
#pragma unroll
                        for (int j = 0; j < DG_TN; ++j) acc[i][j] = fmaf(xv, wv[j], acc[i][j]);
                    }
                }
            }
        } else {  // the last, short chunk: k < kc only (a chain takes no extra fmaf(0, 0, acc) past K)
            for (int kk = 0; kk < kc; ++kk) {
#pragma unroll
                for (int i = 0; i < DG_TM; ++i) {
                    if (i < live) {
                        const float xv = xs[kk][ty + 16 * i];
#pragma unroll
                        for (int j = 0; j < DG_TN; ++j) acc[i][j] = fmaf(xv, ws[kk][tx + 16 * j], acc[i][j]);
                    }
                }
            }
        }
        __syncthreads();  // the next chunk overwrites the tiles
    }
#pragma unroll
    for (int i = 0; i < DG_TM; ++i) {
        if (i < live) {
            const int m = row0 + ty + 16 * i;
#pragma unroll
            for (int j = 0; j < DG_TN; ++j) {
                const int n = col0 + tx + 16 * j;
                if (n < N) {
                    float v = acc[i][j];
                    if (bias != nullptr) v += to_float(bias[n]);
                    y[(i64)m * y_stride + n] = from_float<T>(v);
                }
            }
        }
    }
}

template <class T>
__device__ __forceinline__ void rms_norm_impl(const T* __restrict__ x, i64 x_stride, const T* __restrict__ weight,
                                              T* __restrict__ y, i64 y_stride, int H, float eps) {
    __shared__ float warp_sums[32];
    const int tid = (int)threadIdx.x, threads = (int)blockDim.x;
    const T* xr = x + (i64)blockIdx.x * x_stride;
    T* yr = y + (i64)blockIdx.x * y_stride;
    float s = 0.f;
    for (int k = tid; k < H; k += threads) {
        const float v = to_float(xr[k]);
        s = fmaf(v, v, s);
    }
    s = warp_sum(s);  // every lane of the warp: the same value
    if (tid % 32 == 0) warp_sums[tid / 32] = s;
    __syncthreads();
    float sum = warp_sums[0];
    for (int i = 1; i < threads / 32; ++i) sum += warp_sums[i];  // the warps in order, the same in every thread
    float var;
#if defined(__CUDA_ARCH__)
    var = __fdiv_rn(sum, (float)H);
    const float inv = __fdiv_rn(1.f, sqrt_rn(__fadd_rn(var, eps)));
#else
    var = sum / (float)H;
    const float inv = 1.f / sqrt_rn(var + eps);
#endif
    for (int k = tid; k < H; k += threads) {
        const float normed = to_float(from_float<T>(to_float(xr[k]) * inv));
        yr[k] = from_float<T>(to_float(weight[k]) * normed);
    }
}

}  // namespace paged

// ---- extern "C" entry points --------------------------------------------------------------------------------
#define DENSE_ENTRIES(TN, T)                                                                                       \
    extern "C" __global__ void __launch_bounds__(DG_THREADS) dense_gemm_##TN(                                      \
        const T* w, const T* x, long long x_stride, const T* bias, T* y, long long y_stride, int M, int N, int K) {  \
        paged::dense_gemm_impl<T>(w, x, x_stride, bias, y, y_stride, M, N, K);                                     \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(1024) rms_norm_##TN(                                              \
        const T* x, long long x_stride, const T* weight, T* y, long long y_stride, int M, int H, float eps) {      \
        if ((int)blockIdx.x < M) paged::rms_norm_impl<T>(x, x_stride, weight, y, y_stride, H, eps);               \
    }

DENSE_ENTRIES(f32, float)
DENSE_ENTRIES(f16, __half)
DENSE_ENTRIES(bf16, __nv_bfloat16)
