// The CPU path this process's kernels may take (worker_svc/cpu_path.py: --cpu-path / PAGEDSERVE_CPU_PATH): a cap
// that every run-time feature check of the library (AMX, AVX512-BF16 dot products, the AVX-512 and AVX2 panel
// matmuls) honours, so that one machine can run the paths of lesser CPUs (an AMD part without AMX, an AVX2-only
// one) and test them. The compile-time paths (AVX-512, AVX2, VNNI) come from the build's -march instead
// (cpu_build.build_library builds a library per path). One value per loaded library: a library file is loaded
// once per process, so each path has a file of its own.
extern "C" {

namespace {
int g_cap = 99;  // 0 scalar, 1 avx2, 2 avx512, 3 avx512-bf16, 4 amx; 99: whatever the CPU has
}

int ps_cpu_path_cap() { return g_cap; }
void ps_set_cpu_path_cap(int cap) { g_cap = cap; }

}  // extern "C"
