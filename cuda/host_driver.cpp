// C ABI over the host-shim build of paged_attention.cu, quant_gemm.cu and dense_gemm.cu, for the CPU tests (loaded
// with ctypes).
//
//   int host_<kernel>(const unsigned cfg[4], void** args)
// cfg = (grid.x, grid.y, grid.z, block.x); args[i] points at the i-th kernel argument, exactly like
// cuLaunchKernel's kernelParams, so the Python side builds the same argument list for CuPy and for this.
// Returns 0, or 1 if the shim rejected the launch.
//
// Build: g++ -std=c++20 -O2 -U_FORTIFY_SOURCE -shared -fPIC -pthread -I<cuda>/include -Icuda cuda/host_driver.cpp \
//        -o libpaged_host.so   (-U_FORTIFY_SOURCE: the shim _longjmp()s between fiber stacks)
#include "host_shim.h"
#include "paged_attention.cu"
#include "quant_gemm.cu"

#include <type_traits>
#include <utility>

namespace {

template <class... P, std::size_t... I>
void call_impl(void (*kernel)(P...), const unsigned* cfg, void** args, std::index_sequence<I...>) {
    shim::launch(kernel, dim3(cfg[0], cfg[1], cfg[2]), dim3(cfg[3], 1, 1),
                 *static_cast<std::remove_cvref_t<P>*>(args[I])...);
}

template <class... P>
int call(void (*kernel)(P...), const unsigned* cfg, void** args) {
    try {
        call_impl(kernel, cfg, args, std::index_sequence_for<P...>{});
        return 0;
    } catch (...) {
        return 1;
    }
}

}  // namespace

#define EXPORT(name) \
    extern "C" int host_##name(const unsigned* cfg, void** args) { return call(name, cfg, args); }
#define EXPORT_ATTN(TN, HD) EXPORT(paged_decode_##TN##_d##HD) EXPORT(paged_decode_reduce_##TN##_d##HD) \
    EXPORT(paged_prefill_##TN##_d##HD)

EXPORT(write_kv_f32)
EXPORT(write_kv_f16)
EXPORT(write_kv_bf16)
EXPORT_ATTN(f32, 64)
EXPORT_ATTN(f32, 128)
EXPORT_ATTN(f32, 256)
EXPORT_ATTN(f16, 64)
EXPORT_ATTN(f16, 128)
EXPORT_ATTN(f16, 256)
EXPORT_ATTN(bf16, 64)
EXPORT_ATTN(bf16, 128)
EXPORT_ATTN(bf16, 256)
#define EXPORT_QUANT(TN, CN) EXPORT(write_kv_##TN##_##CN) EXPORT(paged_decode_##TN##_##CN##_d64) \
    EXPORT(paged_prefill_##TN##_##CN##_d64) EXPORT(paged_decode_##TN##_##CN##_d128) \
    EXPORT(paged_prefill_##TN##_##CN##_d128) EXPORT(paged_decode_##TN##_##CN##_d256) \
    EXPORT(paged_prefill_##TN##_##CN##_d256)
#define EXPORT_QUANT_CACHES(TN) EXPORT_QUANT(TN, i8) EXPORT_QUANT(TN, e4m3) EXPORT_QUANT(TN, e5m2)
EXPORT_QUANT_CACHES(f32)
EXPORT_QUANT_CACHES(f16)
EXPORT_QUANT_CACHES(bf16)
EXPORT(copy_blocks_u8)
EXPORT(copy_blocks_u16)
EXPORT(copy_blocks_u32)
EXPORT(copy_blocks_u128)
#define EXPORT_QUANT_GEMM(FN) EXPORT(quant_gemm_##FN##_f32) EXPORT(quant_gemm_##FN##_f16) EXPORT(quant_gemm_##FN##_bf16)
EXPORT_QUANT_GEMM(q4_0)
EXPORT_QUANT_GEMM(q4_1)
EXPORT_QUANT_GEMM(q5_0)
EXPORT_QUANT_GEMM(q8_0)
EXPORT_QUANT_GEMM(q4_k)
EXPORT_QUANT_GEMM(q6_k)

// The fp8 conversions of common.cuh, element-wise over arrays, for the tests' comparison with torch.
// fmt: 0 = e4m3, 1 = e5m2.
extern "C" void host_fp8_decode(int fmt, const unsigned char* codes, float* out, long long n) {
    for (long long i = 0; i < n; ++i)
        out[i] = fmt ? paged::fp8_to_float<paged::fp8_e5m2>(codes[i]) : paged::fp8_to_float<paged::fp8_e4m3>(codes[i]);
}

extern "C" void host_fp8_encode(int fmt, const float* x, unsigned char* out, long long n) {
    for (long long i = 0; i < n; ++i)
        out[i] = fmt ? paged::float_to_fp8<paged::fp8_e5m2>(x[i]) : paged::float_to_fp8<paged::fp8_e4m3>(x[i]);
}

// dense_gemm.cu: the batch-invariant float matmul and RMSNorm
#include "dense_gemm.cu"
#define EXPORT_DENSE(TN) EXPORT(dense_gemm_##TN) EXPORT(rms_norm_##TN)
EXPORT_DENSE(f32)
EXPORT_DENSE(f16)
EXPORT_DENSE(bf16)
