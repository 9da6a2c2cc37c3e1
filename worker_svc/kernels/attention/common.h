// The attention kernel's limits, the ISA it was built for, and the bits every path shares (part of
// worker_svc/attention/paged_attention_cpu.cpp's one translation unit: see there for the layout and the paths).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "../exp.h"
#include "../simd.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PS_AVX512 1
#endif

namespace {

constexpr int kMaxRows = 64;     // query rows (tokens x group heads) one work item holds
constexpr int kMaxHeadDim = 256;
constexpr int kMaxBlock = 256;

// What a walk's last group prefetches for the walk this thread does next: the first group of rows of the item's
// next kv head, or of the next item in this thread's chunk of the schedule. Without it each walk's first group came
// from memory unprefetched (bf16 decode, 64 x 192, 2 threads, bench/attention_cpu.py: 18.2-19.8 -> 16.0-16.7 ms).
struct NextWalk {
  const int32_t* table = nullptr;  // null: nothing known to follow
  int64_t head_off = 0, num_kv_blocks = 0, last = 0;
};

// exp(x) for x <= 0 in float: exp_poly (rel. error < 2e-7), vectorizes (no libm call).
inline float fast_exp(float x) { return exp_poly(x < -87.0f ? -87.0f : x); }

}  // namespace
