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

// ---- 8-bit cache codes ----------------------------------------------------------------------------------------
// An 8-bit KV cache stores codes; a (token, kv head) row of K or V reads as code * that row's float32 scale.
// NOTE: the fp8 conversions are written out here (integer bit manipulation, no cuda_fp8.h, no libm) so nvcc,
// NVRTC and the g++ host shim compile the same arithmetic: decoding is exact for every code, encoding rounds to
// nearest even and saturates at the format's max, bit-identical to torch's .to(float8_*) of the clamped value.
struct fp8_e4m3 { unsigned char bits; };  // float8_e4m3fn: bias 7, no inf, NaN = S.1111.111, max 448
struct fp8_e5m2 { unsigned char bits; };  // IEEE-like: bias 15, inf = S.11111.00, NaN = S.11111.xx, max 57344

__device__ __forceinline__ float bits_to_float(unsigned u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    return __builtin_bit_cast(float, u);
#endif
}
__device__ __forceinline__ unsigned float_to_bits(float x) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(x);
#else
    return __builtin_bit_cast(unsigned, x);
#endif
}

// Format traits: exponent/mantissa widths, bias, the float32 bit patterns of max and of the smallest normal.
template <class C> struct Fp8Format;
template <> struct Fp8Format<fp8_e4m3> {
    static constexpr int EXP = 4, MAN = 3, BIAS = 7;
    static constexpr unsigned MAX_BITS = 0x43E00000u;        // 448
    static constexpr unsigned MIN_NORMAL_BITS = 121u << 23;  // 2^-6
    static constexpr unsigned NAN_CODE = 0x7Fu;
};
template <> struct Fp8Format<fp8_e5m2> {
    static constexpr int EXP = 5, MAN = 2, BIAS = 15;
    static constexpr unsigned MAX_BITS = 0x47600000u;        // 57344
    static constexpr unsigned MIN_NORMAL_BITS = 113u << 23;  // 2^-14
    static constexpr unsigned NAN_CODE = 0x7Fu;
};

template <class C>
__device__ __forceinline__ float fp8_to_float(unsigned char code) {
    typedef Fp8Format<C> F;
    const unsigned sign = (unsigned)(code & 0x80u) << 24;
    const unsigned e = (code >> F::MAN) & ((1u << F::EXP) - 1u);
    const unsigned m = code & ((1u << F::MAN) - 1u);
    unsigned mag;
    if (F::EXP == 4 && e == 15u && m == 7u) {
        mag = 0x7FC00000u;  // e4m3fn's only NaN
    } else if (F::EXP == 5 && e == 31u) {
        mag = m ? 0x7FC00000u : 0x7F800000u;  // NaN / inf
    } else if (e == 0u) {
        // Subnormal: m * 2^(1 - BIAS - MAN), exact in float32 (m < 8).
        mag = m ? float_to_bits((float)m * bits_to_float((unsigned)(127 + 1 - F::BIAS - F::MAN) << 23)) : 0u;
    } else {
        mag = ((e + 127u - F::BIAS) << 23) | (m << (23 - F::MAN));
    }
    return bits_to_float(sign | mag);
}

template <class C>
__device__ __forceinline__ unsigned char float_to_fp8(float x) {
    typedef Fp8Format<C> F;
    const unsigned u = float_to_bits(x);
    const unsigned sign = (u >> 24) & 0x80u;
    unsigned a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (unsigned char)(sign | F::NAN_CODE);
    if (a > F::MAX_BITS) a = F::MAX_BITS;  // saturate (inf included)
    unsigned code;
    if (a >= F::MIN_NORMAL_BITS) {
        // Re-bias the exponent, then round the mantissa to MAN bits, half to even (a carry bumps the exponent;
        // it cannot pass max, which is representable).
        constexpr int SH = 23 - F::MAN;
        const unsigned r = a - ((unsigned)(127 - F::BIAS) << 23);
        code = (r + ((1u << (SH - 1)) - 1u) + ((r >> SH) & 1u)) >> SH;
    } else {
        // Subnormal target: |x| / 2^(1 - BIAS - MAN) rounded half to even, from the float's integer mantissa.
        const int E = (int)(a >> 23);
        if (E == 0) {
            code = 0u;  // float32 zero/subnormal: far below half the smallest fp8 subnormal
        } else {
            const unsigned m = (a & 0x7FFFFFu) | 0x800000u;
            const int shift = 150 + 1 - F::BIAS - F::MAN - E;  // > 0 here
            if (shift >= 32) {
                code = 0u;
            } else {
                const unsigned q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
                code = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
            }
        }
    }
    return (unsigned char)(sign | code);
}

__device__ __forceinline__ float to_float(signed char x) { return (float)x; }
__device__ __forceinline__ float to_float(fp8_e4m3 x) { return fp8_to_float<fp8_e4m3>(x.bits); }
__device__ __forceinline__ float to_float(fp8_e5m2 x) { return fp8_to_float<fp8_e5m2>(x.bits); }

// Cache traits: is T an 8-bit code type, its QUANT_MAX (pagedserve_common/kv_geometry.py), and the encoder.
template <class C> struct Quant { static constexpr bool ENABLED = false; };
template <> struct Quant<signed char> { static constexpr bool ENABLED = true; static constexpr float MAX = 127.f; };
template <> struct Quant<fp8_e4m3> { static constexpr bool ENABLED = true; static constexpr float MAX = 448.f; };
template <> struct Quant<fp8_e5m2> { static constexpr bool ENABLED = true; static constexpr float MAX = 57344.f; };

// y = x / scale, already computed: int8 rounds half to even and clamps to +-127; fp8 saturates at +-max.
template <class C> __device__ __forceinline__ C encode(float y);
template <> __device__ __forceinline__ signed char encode<signed char>(float y) {
    return (signed char)fminf(fmaxf(rintf(y), -127.f), 127.f);
}
template <> __device__ __forceinline__ fp8_e4m3 encode<fp8_e4m3>(float y) { return {float_to_fp8<fp8_e4m3>(y)}; }
template <> __device__ __forceinline__ fp8_e5m2 encode<fp8_e5m2>(float y) { return {float_to_fp8<fp8_e5m2>(y)}; }

// IEEE float32 division on every compiler (never x * (1 / y)), as torch computes x / scale.
__device__ __forceinline__ float div_rn(float x, float y) {
#if defined(__CUDA_ARCH__)
    return __fdiv_rn(x, y);
#else
    return x / y;
#endif
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
    } else if constexpr (BYTES % 4 == 0) {
        alignas(4) T tmp[N];
#pragma unroll
        for (int i = 0; i < BYTES / 4; ++i)
            reinterpret_cast<unsigned*>(tmp)[i] = __ldg(reinterpret_cast<const unsigned*>(p) + i);
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

// load_float for a row of an 8-bit cache: N codes at p, dequantised with the row's scale (code * scale).
template <class C, int N>
__device__ __forceinline__ void load_dequant(const C* __restrict__ p, const float scale, float (&out)[N]) {
    load_float<C, N>(p, out);
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] *= scale;
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
