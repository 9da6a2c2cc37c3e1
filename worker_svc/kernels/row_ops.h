// The fused elementwise ops' row loops, written once for both dtypes (cpu_ops.cpp: bfloat16, f32_ops.cpp:
// float32): rows split over threads where there is work enough, each row done by its unit's row function for the
// dtype (norm_row, add_row, silu_mul_row, rope_head: the arithmetic, and its rounding, stay the unit's own).
// NOTE: include after those row functions: the templates find them where they are defined (pointer arguments of
// built-in types bring no namespace for a later lookup to search). Internal linkage, as exp.h: f32_ops.cpp's copy
// is compiled under its `fp-contract=off`.
#pragma once

#include <cstdint>

namespace {

constexpr int64_t kParallelElems = 1 << 16;  // below this many elements one thread does it (a fork costs more)

// RMSNorm of `rows` rows of `dim` values.
template <typename E>
void rms_norm_rows(const E* x, const E* w, float eps, int64_t rows, int64_t dim, E* out) {
#pragma omp parallel for if (rows * dim >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r) norm_row(x + r * dim, w, eps, dim, out + r * dim);
}

// The residual add, then the next RMSNorm: x = x + delta in place (rounded to E), out = rms_norm(x).
template <typename E>
void add_rms_norm_rows(E* x, const E* delta, const E* w, float eps, int64_t rows, int64_t dim, E* out) {
#pragma omp parallel for if (rows * dim >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r) {
    add_row(x + r * dim, delta + r * dim, dim);
    norm_row(x + r * dim, w, eps, dim, out + r * dim);
  }
}

// The SiLU-gated MLP's middle: gu is [rows, 2 * inter] (gate | up); out[r, i] = silu(g) * u.
template <typename E>
void silu_mul_rows(const E* gu, int64_t rows, int64_t inter, E* out) {
#pragma omp parallel for if (rows * inter >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r) {
    const E* g = gu + r * 2 * inter;
    silu_mul_row(g, g + inter, out + r * inter, inter);
  }
}

// Rotate-half rotary embedding in place: x is [tokens, heads, hd] with rows `x_stride` elements apart (heads are
// contiguous within a row), cos/sin [tokens, hd].
template <typename E>
void rope_rows(E* x, int64_t x_stride, const E* cos, const E* sin, int64_t tokens, int64_t heads, int64_t hd) {
  const int64_t half = hd / 2;
#pragma omp parallel for if (tokens * heads * hd >= kParallelElems)
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h) rope_head(x + t * x_stride + h * hd, cos + t * hd, sin + t * hd, half);
}

}  // namespace
