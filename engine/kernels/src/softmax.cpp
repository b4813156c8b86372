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
#include "vmath.h"

namespace mlxterm {

namespace {

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
