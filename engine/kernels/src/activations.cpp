// Elementwise activations (activations.h): 8 values per step, chunks of the flat array on the
// kernel pool (a small array on the calling thread: a decoder step's 1536 values).
#include "activations.h"

#include <immintrin.h>

#include <cmath>

#include "ops.h"
#include "vmath.h"

namespace mlxterm {

namespace {

// erfc(z) = t * exp(poly(t) - z^2), t = 1 / (1 + z / 2), z >= 0; coefficients highest first.
constexpr float kErfc[10] = {0.17087277f, -0.82215223f, 1.48851587f, -1.13520398f, 0.27886807f,
                             -0.18628806f, 0.09678418f, 0.37409196f, 1.00002368f, -1.26551223f};
constexpr float kInvSqrt2 = 0.70710678118654752f;
constexpr long kChunk = 1 << 14;

float gelu_ref(float v) {
  const float z = std::fabs(v) * kInvSqrt2;
  const float t = 1.0f / (1.0f + 0.5f * z);
  float poly = kErfc[0];
  for (int i = 1; i < 10; ++i) poly = std::fma(poly, t, kErfc[i]);
  const float half_erfc = 0.5f * t * std::exp(std::fmin(poly - z * z, 0.0f));  // Phi(-|v|)
  return v * (v >= 0.0f ? 1.0f - half_erfc : half_erfc);
}

void gelu_span(const float* x, float* o, long n) {
  const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f);
  const __m256 inv = _mm256_set1_ps(kInvSqrt2), zero = _mm256_setzero_ps();
  long i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 z = _mm256_mul_ps(_mm256_andnot_ps(sign, v), inv);
    const __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(half, z, one));
    __m256 poly = _mm256_set1_ps(kErfc[0]);
    for (int c = 1; c < 10; ++c) poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(kErfc[c]));
    const __m256 arg = _mm256_min_ps(_mm256_fnmadd_ps(z, z, poly), zero);
    const __m256 half_erfc = _mm256_mul_ps(_mm256_mul_ps(half, t), exp_neg(arg));
    const __m256 phi = _mm256_blendv_ps(_mm256_sub_ps(one, half_erfc), half_erfc, _mm256_cmp_ps(v, zero, _CMP_LT_OQ));
    _mm256_storeu_ps(o + i, _mm256_mul_ps(v, phi));
  }
  for (; i < n; ++i) o[i] = gelu_ref(x[i]);
}

}  // namespace

void GeluErf::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const bool ref = reference_;
  // Elementwise: the rows are one flat span.
  dispatch_rows<float>(stream(), inputs[0], out, [ref](const float* xp, float* op, int V, long rows) {
    const long n = rows * V;
    if (ref) {
      for (long i = 0; i < n; ++i) op[i] = gelu_ref(xp[i]);
      return;
    }
    if (n <= kChunk) {
      gelu_span(xp, op, n);
      return;
    }
    Pool::get().run(int((n + kChunk - 1) / kChunk), [&](int c) {
      const long i0 = c * kChunk;
      gelu_span(xp + i0, op + i0, std::min(n, i0 + kChunk) - i0);
    });
  });
}

mx::array gelu_erf(const mx::array& x, bool reference, mx::StreamOrDevice s) {
  if (x.dtype() != mx::float32)
    throw std::invalid_argument("[mlxterm.gelu_erf] x must be float32.");
  auto st = cpu_stream(s, "gelu_erf");
  const mx::array flat = x.ndim() == 0 ? mx::reshape(x, {1}, st) : x;  // dispatch_rows reads a last axis
  return mx::array(x.shape(), mx::float32, std::make_shared<GeluErf>(st, reference), {contiguous_in(flat, st)});
}

}  // namespace mlxterm
