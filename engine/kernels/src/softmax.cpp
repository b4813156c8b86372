// MLX's CPU softmax runs a scalar exp (~85 M/s on one thread): at long context it is most of
// attention's time. This one fuses mask + max + exp + sum + scale, with a vectorised exp,
// over rows split across the kernel pool.
#include "softmax.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include <immintrin.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/utils.h"
#include "pool.h"

namespace mlxterm {

namespace {

// exp(x) for x <= 0 (after the max is subtracted): 2^n * p(r), r in [-ln2/2, ln2/2],
// degree-6 polynomial (relative error ~2e-7); inputs below -87 give 0.
inline __m256 exp_neg(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 valid = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), valid);
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float hadd(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One row: out[0:n] = softmax(in[0:n] + mask[0:n]) and zeros for out[n:S].
void row_softmax(const float* in, const float* mask, float* out, int n, int S) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  int j = 0;
  __m256 vmax = _mm256_set1_ps(neg_inf);
  for (; j + 8 <= n; j += 8) {
    __m256 v = _mm256_loadu_ps(in + j);
    if (mask) v = _mm256_add_ps(v, _mm256_loadu_ps(mask + j));
    _mm256_storeu_ps(out + j, v);
    vmax = _mm256_max_ps(vmax, v);
  }
  float m = hmax(vmax);
  for (; j < n; ++j) {
    out[j] = in[j] + (mask ? mask[j] : 0.0f);
    m = std::max(m, out[j]);
  }
  if (m == neg_inf) {  // every key masked: MLX gives NaN; a zero row is kinder and rare
    std::fill(out, out + S, 0.0f);
    return;
  }
  const __m256 vm = _mm256_set1_ps(m);
  __m256 vs = _mm256_setzero_ps();
  j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(out + j), vm));
    _mm256_storeu_ps(out + j, e);
    vs = _mm256_add_ps(vs, e);
  }
  float sum = hadd(vs);
  for (; j < n; ++j) {
    out[j] = std::exp(out[j] - m);
    sum += out[j];
  }
  const __m256 inv = _mm256_set1_ps(1.0f / sum);
  j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_loadu_ps(out + j), inv));
  for (; j < n; ++j) out[j] *= 1.0f / sum;
  std::fill(out + n, out + S, 0.0f);
}

}  // namespace

void MaskedSoftmax::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& x = inputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  const int S = x.shape(-1), L = x.shape(-2);
  const int B = x.shape(0), H = x.shape(1);
  const float* in = x.data<float>();
  float* o = out.data<float>();
  const float* mask = inputs.size() > 1 ? inputs[1].data<float>() : nullptr;
  const int Bm = inputs.size() > 1 ? inputs[1].shape(0) : 0;
  const int mode = mode_, offset = offset_;
  enc.dispatch([=]() {
    const long rows = long(B) * H * L;
    const long per = std::max<long>(1, std::min<long>(64, (rows + 15) / 16));
    const int chunks = int((rows + per - 1) / per);
    Pool::get().run(chunks, [&](int c) {
      for (long r = c * per; r < std::min(rows, (c + 1) * per); ++r) {
        const int i = int(r % L);
        const int b = int(r / (long(L) * H));
        int n = S;
        const float* mrow = nullptr;
        if (mode == 1) n = std::max(0, std::min(S, i + offset + 1));
        if (mode == 2) mrow = mask + (size_t(Bm == 1 ? 0 : b) * L + i) * S;
        row_softmax(in + size_t(r) * S, mrow, o + size_t(r) * S, n, S);
      }
    });
  });
}

void MaskedSoftmax::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[mlxterm] the CPU kernels have no GPU implementation.");
}

mx::array masked_softmax(
    const mx::array& scores, int mode, int offset, const mx::array* mask, mx::StreamOrDevice s) {
  if (scores.ndim() != 4 || scores.dtype() != mx::float32)
    throw std::invalid_argument("[mlxterm.masked_softmax] scores must be float32 (B, H, L, S).");
  auto st = mx::to_stream(s);
  std::vector<mx::array> inputs = {mx::contiguous(scores, false, st)};
  if (mode == 2) {
    if (!mask || mask->ndim() != 4 || mask->shape(1) != 1 || mask->shape(2) != scores.shape(2) ||
        mask->shape(3) != scores.shape(3) || (mask->shape(0) != 1 && mask->shape(0) != scores.shape(0)))
      throw std::invalid_argument("[mlxterm.masked_softmax] mask must be (1 or B, 1, L, S).");
    inputs.push_back(mx::contiguous(mx::astype(*mask, mx::float32, st), false, st));
  }
  return mx::array(
      scores.shape(), mx::float32, std::make_shared<MaskedSoftmax>(st, mode, offset), inputs);
}

}  // namespace mlxterm
