// Fused elementwise ops for the float32 lean forward on the CPU (worker_svc/cpu_ops.py): each is one pass over its
// rows instead of torch's 3-6 kernels of the same math (a 512-token prefill step spent ~60 ms of ~410 in them).
// Built into the CPU kernel library with paged_attention_cpu.cpp (worker_svc/attention/cpu_backend.py).
//
// Rounding: every product and sum is rounded to float32 where torch's op rounds it (contraction into FMAs is off
// below), so the residual adds, the rotary and the SiLU product's multiply give torch's bits; the RMSNorm's sum of
// squares runs in a fixed order of its own (16 lane sums, then a fixed tree), and SiLU's exp is Cephes' (torch's is
// Sleef's): those differ from torch by an ulp or so. Plain loops the compiler vectorises: with
// contraction off and a fixed reduction order, every build of the library (native or portable) gives the same bits.
#include <cmath>
#include <cstdint>
#include <cstring>

#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace {

constexpr int64_t kParallelElems = 1 << 16;  // below this many elements one thread does it (a fork costs more)
constexpr int kLanes = 16;

// exp(x) in float32 (Cephes' expf: rel. error ~1.2e-7): n = round(x log2 e), r = x - n ln 2 in two parts (so r
// keeps x's precision: a single x * log2 e loses ~5e-6 at x ~ 12), exp(r) by a degree-7 polynomial, times 2^n.
// Past 88.72: inf (as torch's); below -87.3: 0 (torch's gives denormals there: silu's g / (1 + exp(-g)) is g either
// way).
inline float exp_f32(float x) {
  const float xc = x < -87.3f ? -87.3f : (x > 88.5f ? 88.5f : x);
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * (r * r) + r + 1.0f;
  // 2^n as two normal powers of two (n in [-126, 128]: 2^128 is not a float)
  const int32_t half = static_cast<int32_t>(n) >> 1;
  const int32_t b1 = (half + 127) << 23, b2 = (static_cast<int32_t>(n) - half + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &b1, 4);
  std::memcpy(&s2, &b2, 4);
  const float e = y * s1 * s2;
  return x > 88.72283f ? INFINITY : (x < -87.3f ? 0.0f : e);
}

#if defined(__AVX512F__)
// exp_f32 on 16 lanes, the same operations in the same order (so the same bits); the compiler does not vectorise
// exp_f32's integer steps (a scalar SiLU product ran 5x slower than torch's).
inline __m512 exp16(__m512 x) {
  const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.5f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_add_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(xc, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
  const __m512i ni = _mm512_cvtps_epi32(n), half = _mm512_srai_epi32(ni, 1), bias = _mm512_set1_epi32(127);
  const __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(half, bias), 23));
  const __m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_sub_epi32(ni, half), bias), 23));
  __m512 e = _mm512_mul_ps(_mm512_mul_ps(y, s1), s2);
  e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ), _mm512_setzero_ps());
  return _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.72283f), _CMP_GT_OQ),
                            _mm512_set1_ps(INFINITY));
}
#elif defined(__AVX2__)
// exp_f32 on 8 lanes, the same operations in the same order (so the same bits).
inline __m256 exp8(__m256 x) {
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.5f));
  const __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                                 _mm256_set1_ps(0.5f)));
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(xc, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1), bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias), 23));
  __m256 e = _mm256_mul_ps(_mm256_mul_ps(y, s1), s2);
  e = _mm256_blendv_ps(e, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ));
  return _mm256_blendv_ps(e, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, _mm256_set1_ps(88.72283f), _CMP_GT_OQ));
}
#endif

// out = w * (x * (1 / sqrt(mean(x^2) + eps))) for one row of `dim` (transformers' LlamaRMSNorm in float32).
inline void norm_row(const float* x, const float* w, float eps, int64_t dim, float* out) {
  float lane[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes)
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) lane[j] += x[d + j] * x[d + j];
  for (int j = 0; d < dim; ++d, ++j) lane[j] += x[d] * x[d];
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) lane[j] += lane[j + width];
  const float inv = 1.0f / std::sqrt(lane[0] / static_cast<float>(dim) + eps);
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) out[i] = w[i] * (x[i] * inv);
}

}  // namespace

extern "C" {

// RMSNorm of `rows` rows of `dim` float32 values.
void ps_rms_norm_f32(const float* x, const float* w, float eps, int64_t rows, int64_t dim, float* out) {
#pragma omp parallel for if (rows * dim >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r) norm_row(x + r * dim, w, eps, dim, out + r * dim);
}

// The residual add, then the next RMSNorm: x = x + delta in place, out = rms_norm(x).
void ps_add_rms_norm_f32(float* x, const float* delta, const float* w, float eps, int64_t rows, int64_t dim,
                         float* out) {
#pragma omp parallel for if (rows * dim >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * dim;
    const float* dr = delta + r * dim;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) xr[d] = xr[d] + dr[d];
    norm_row(xr, w, eps, dim, out + r * dim);
  }
}

// The SiLU-gated MLP's middle: gu is [rows, 2 * inter] (gate | up); out[r, i] = (g / (1 + exp(-g))) * u.
void ps_silu_mul_f32(const float* gu, int64_t rows, int64_t inter, float* out) {
#pragma omp parallel for if (rows * inter >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * inter;
    const float* u = g + inter;
    float* o = out + r * inter;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= inter; i += 16) {
      const __m512 gv = _mm512_loadu_ps(g + i);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
      _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)),
                                            _mm512_loadu_ps(u + i)));
    }
#elif defined(__AVX2__)
    for (; i + 8 <= inter; i += 8) {
      const __m256 gv = _mm256_loadu_ps(g + i);
      const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)),
                                            _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < inter; ++i) o[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
  }
}

// Rotate-half rotary embedding in place: x is [tokens, heads, hd] with rows `x_stride` elements apart (heads are
// contiguous within a row), cos/sin [tokens, hd]; x = x * cos + rotate_half(x) * sin, each product rounded.
void ps_rope_f32(float* x, int64_t x_stride, const float* cos, const float* sin, int64_t tokens, int64_t heads,
                 int64_t hd) {
  const int64_t half = hd / 2;
#pragma omp parallel for if (tokens * heads * hd >= kParallelElems)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* c = cos + t * hd;
    const float* s = sin + t * hd;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + t * x_stride + h * hd;
#pragma omp simd
      for (int64_t d = 0; d < half; ++d) {
        const float lo = v[d], hi = v[d + half];
        v[d] = lo * c[d] + (-hi) * s[d];
        v[d + half] = hi * c[d + half] + lo * s[d + half];
      }
    }
  }
}

}  // extern "C"

#pragma GCC pop_options
