// Float16-weight matmul for few activation rows (half_matmul.h). AVX2 + F16C (the baseline
// every dispatched CPU has): the op streams its weights once, so wider vectors would not make
// it faster; a block of 4 weight rows is converted 8 values at a time and stays in registers
// while every activation row (2 at a time) passes over it.
#include "half_matmul.h"

#include <immintrin.h>

#include <cmath>

#include "ops.h"
#include "vmath.h"

namespace mlxterm {

namespace {

float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// One output the reference way: lane j of 8 accumulates x[k] * w[k] for k = j mod 8 by fma,
// the lanes are summed as vmath.h's hadd does ((l + l+4), then + 2, then + 1), then the tail k >= K8 by fma, then + bias.
float dot_ref(const float* x, const uint16_t* w, int K, float bias) {
  const int K8 = K & ~7;
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int k = 0; k < K8; k += 8)
    for (int j = 0; j < 8; ++j) lane[j] = std::fma(x[k + j], half_to_float(w[k + j]), lane[j]);
  float a[4], b[2];
  for (int j = 0; j < 4; ++j) a[j] = lane[j] + lane[j + 4];
  b[0] = a[0] + a[2], b[1] = a[1] + a[3];
  float s = b[0] + b[1];
  for (int k = K8; k < K; ++k) s = std::fma(x[k], half_to_float(w[k]), s);
  return s + bias;
}

// Weight rows [n, n + NR) against activation rows [m, m + MR): out[m + i][n + j].
template <int NR, int MR>
inline void tile(const float* x, const uint16_t* w, const float* bias, float* out, int K, int N, int m, int n) {
  const int K8 = K & ~7;
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int k = 0; k < K8; k += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j)
      wv[j] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + size_t(n + j) * K + k)));
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + size_t(m + i) * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      const float* xr = x + size_t(m + i) * K;
      const uint16_t* wr = w + size_t(n + j) * K;
      float s = hadd(acc[i][j]);
      for (int k = K8; k < K; ++k) s = std::fma(xr[k], half_to_float(wr[k]), s);
      out[size_t(m + i) * N + n + j] = s + (bias ? bias[n + j] : 0.0f);
    }
}

// Columns [n0, n1) of every row: 4 weight rows at a time (converted once, then every activation
// row pair), the last 1-3 one by one. Each block first prefetches the block two ahead, all of
// it at once: many misses in flight. Without it one row streamed 8.5 GB/s on one Zen 4 core
// (the hardware prefetcher alone), with it 12-39 GB/s as the VM's memory allowed (a plain read
// 34 GB/s); prefetching inside the k loop, or 8-row blocks, gained less.
void columns(const float* x, const uint16_t* w, const float* bias, float* out, int M, int K, int N, int n0, int n1) {
  int n = n0;
  for (; n + 4 <= n1; n += 4) {
    if (n + 12 <= n1) {
      const char* ahead = reinterpret_cast<const char*>(w + size_t(n + 8) * K);
      for (size_t b = 0; b < size_t(8) * K; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    }
    int m = 0;
    for (; m + 2 <= M; m += 2) tile<4, 2>(x, w, bias, out, K, N, m, n);
    if (m < M) tile<4, 1>(x, w, bias, out, K, N, m, n);
  }
  for (; n < n1; ++n)
    for (int m = 0; m < M; ++m) tile<1, 1>(x, w, bias, out, K, N, m, n);
}

}  // namespace

std::vector<mx::Shape> HalfMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  return {weight_matmul_shape(inputs)};
}

void HalfMatmul::eval_gpu(const std::vector<mx::array>&, mx::array&) { gpu_unsupported(); }

void HalfMatmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const mx::array& x = inputs[0];
  const mx::array& w = inputs[1];
  auto& enc = begin_eval(stream(), inputs, out);
  const int K = x.shape(-1), N = w.shape(0);
  const int M = K ? int(x.size() / K) : 0;
  const float* bp = has_bias_ ? inputs[2].data<float>() : nullptr;
  enc.dispatch([xp = x.data<float>(), wp = w.data<uint16_t>(), bp, op = out.data<float>(), M, K, N,
                ref = reference_]() {
    if (ref) {
      for (int m = 0; m < M; ++m)
        for (int n = 0; n < N; ++n)
          op[size_t(m) * N + n] = dot_ref(xp + size_t(m) * K, wp + size_t(n) * K, K, bp ? bp[n] : 0.0f);
      return;
    }
    // Small products on this thread: waking the pool costs more than a 384 x 384 step.
    if (double(M) * N * K < double(1 << 18)) {
      columns(xp, wp, bp, op, M, K, N, 0, N);
      return;
    }
    const int T = Pool::get().threads();
    const int chunk = std::max(16, ((N + 8 * T - 1) / (8 * T) + 3) & ~3);
    Pool::get().run((N + chunk - 1) / chunk, [&](int c) {
      const int n0 = c * chunk;
      columns(xp, wp, bp, op, M, K, N, n0, std::min(N, n0 + chunk));
    });
  });
}

mx::array half_matmul(const mx::array& x, const mx::array& w, const mx::array& bias, bool reference,
                      mx::StreamOrDevice s) {
  if (x.ndim() < 1 || x.dtype() != mx::float32 || w.ndim() != 2 || w.dtype() != mx::float16 ||
      w.shape(1) != x.shape(-1))
    throw std::invalid_argument("[mlxterm.half_matmul] x must be float32 (..., K) and w float16 (N, K).");
  const bool has_bias = bias.size() > 0;
  if (has_bias && (bias.ndim() != 1 || bias.shape(0) != w.shape(0)))
    throw std::invalid_argument("[mlxterm.half_matmul] bias must be (N,).");
  auto st = cpu_stream(s, "half_matmul");
  std::vector<mx::array> inputs = {contiguous_in(x, st), contiguous_in(w, st)};
  if (has_bias) inputs.push_back(contiguous_in(mx::astype(bias, mx::float32, st), st));
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(shape, mx::float32, std::make_shared<HalfMatmul>(st, has_bias, reference), inputs);
}

}  // namespace mlxterm
