// Shared helpers for the paged-attention kernels: element types, conversions, vector loads, warp reductions.
//
// This header compiles three ways from the same text:
//   * nvcc / NVRTC for the device (__CUDACC__ defined; __CUDA_ARCH__ in the device pass);
//   * g++ -std=c++20 for the host, after cuda/host_shim.h has defined the CUDA built-ins (PAGED_HOST_SHIM).
// NOTE: NVRTC has no C++ standard library, so nothing here includes <cstdint>/<cmath>: only built-in types.
#pragma once

#ifndef PAGED_HOST_SHIM
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#endif

namespace paged {

typedef long long i64;

// -inf without <cmath>: a bit pattern on the device (nvcc, NVRTC), the GCC built-in on the host.
#if defined(__CUDA_ARCH__)
#define PAGED_NEG_INF __int_as_float((int)0xff800000u)
#else
#define PAGED_NEG_INF (-__builtin_huge_valf())
#endif
#define PAGED_LOG2E 1.4426950408889634f

// ---- element conversions ------------------------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// ---- vector loads -------------------------------------------------------------------------------------------
// Load N consecutive elements at p and convert them to float. On the device the load is done in 16/8/4-byte
// words (p must be aligned to N*sizeof(T) bytes, capped at 16: the backend checks pool/query alignment); on the
// host it is a plain element loop (no alignment requirement).
template <class T, int N>
__device__ __forceinline__ void load_float(const T* __restrict__ p, float (&out)[N]) {
#if defined(__CUDA_ARCH__)
    constexpr int BYTES = N * (int)sizeof(T);
    if constexpr (BYTES % 16 == 0) {
        alignas(16) T tmp[N];
#pragma unroll
        for (int i = 0; i < BYTES / 16; ++i)
            reinterpret_cast<uint4*>(tmp)[i] = __ldg(reinterpret_cast<const uint4*>(p) + i);
#pragma unroll
        for (int i = 0; i < N; ++i) out[i] = to_float(tmp[i]);
    } else if constexpr (BYTES % 8 == 0) {
        alignas(8) T tmp[N];
#pragma unroll
        for (int i = 0; i < BYTES / 8; ++i)
            reinterpret_cast<uint2*>(tmp)[i] = __ldg(reinterpret_cast<const uint2*>(p) + i);
#pragma unroll
        for (int i = 0; i < N; ++i) out[i] = to_float(tmp[i]);
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) out[i] = to_float(p[i]);
    }
#else
    for (int i = 0; i < N; ++i) out[i] = to_float(p[i]);
#endif
}

// ---- warp reductions ----------------------------------------------------------------------------------------
// Butterfly over groups of WIDTH consecutive lanes (WIDTH a power of two <= 32). Every lane of the warp must call
// it (the host shim's shuffle is a warp-wide rendezvous, just like a converged warp on the device).
template <int WIDTH>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int m = WIDTH / 2; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m, 32);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m, 32));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) { return group_sum<32>(v); }

}  // namespace paged
