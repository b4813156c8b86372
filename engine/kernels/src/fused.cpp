// RMSNorm and RoPE for the CPU backend (see fused.h for why). Both are memory-trivial at
// decode (a few hundred floats), so what they save is MLX's per-op dispatch and allocation;
// at prefill sizes rows are split over the kernel pool.
#include "fused.h"

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include <immintrin.h>

#include "mlx/backend/cpu/encoder.h"
#include "pool.h"
#include "qmm.h"
#include "vmath.h"

namespace mlxterm {

namespace {

// Rows per pool chunk: small calls (decode) run on the calling thread alone.

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace

void rms_row(const float* x, const float* w, float* o, int D, float eps) {
  __m256 acc = _mm256_setzero_ps();
  int j = 0;
  for (; j + 8 <= D; j += 8) {
    __m256 v = _mm256_loadu_ps(x + j);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = hsum8(acc);
  for (; j < D; ++j) ss += x[j] * x[j];
  const float r = 1.0f / std::sqrt(ss / float(D) + eps);
  const __m256 vr = _mm256_set1_ps(r);
  j = 0;
  for (; j + 8 <= D; j += 8)
    _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), vr), _mm256_loadu_ps(w + j)));
  for (; j < D; ++j) o[j] = x[j] * r * w[j];
}


void rope_table(const int32_t* offsets, int nb, int T, int half, float base, float scale,
                std::vector<float>& cs, std::vector<float>& sn) {
  // cos/sin per (b, t) and frequency, as MLX's fallback defines them: positions
  // (offset + t) * scale, frequencies exp(-i * log(base) / half); computed in double, so
  // they are at least as exact as MLX's float32 tables.
  cs.resize(size_t(nb) * T * half);
  sn.resize(cs.size());
  const double lb = std::log(double(base)) / half;
  for (int b = 0; b < nb; ++b)
    for (int t = 0; t < T; ++t) {
      const double pos = double(float(offsets[b] + t) * scale);
      for (int i = 0; i < half; ++i) {
        const double th = pos * std::exp(-i * lb);
        const size_t k = (size_t(b) * T + t) * half + i;
        cs[k] = float(std::cos(th));
        sn[k] = float(std::sin(th));
      }
    }
}

void rope_row(const float* xr, int64_t sd, float* yr, const float* c, const float* s, int dims,
              int D, bool trad) {
  const int half = dims / 2;
  if (trad) {
    for (int i = 0; i < half; ++i) {
      const float x1 = xr[2 * i * sd], x2 = xr[(2 * i + 1) * sd];
      yr[2 * i] = x1 * c[i] - x2 * s[i];
      yr[2 * i + 1] = x1 * s[i] + x2 * c[i];
    }
  } else {
    int i = 0;
    if (sd == 1) {
      for (; i + 8 <= half; i += 8) {
        const __m256 x1 = _mm256_loadu_ps(xr + i), x2 = _mm256_loadu_ps(xr + half + i);
        const __m256 vc = _mm256_loadu_ps(c + i), vs = _mm256_loadu_ps(s + i);
        _mm256_storeu_ps(yr + i, _mm256_sub_ps(_mm256_mul_ps(x1, vc), _mm256_mul_ps(x2, vs)));
        _mm256_storeu_ps(yr + half + i, _mm256_add_ps(_mm256_mul_ps(x1, vs), _mm256_mul_ps(x2, vc)));
      }
    }
    for (; i < half; ++i) {
      const float x1 = xr[i * sd], x2 = xr[(half + i) * sd];
      yr[i] = x1 * c[i] - x2 * s[i];
      yr[half + i] = x1 * s[i] + x2 * c[i];
    }
  }
  for (int j = dims; j < D; ++j) yr[j] = xr[j * sd];  // features past `dims` pass through
}

void RmsNorm::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& x = inputs[0];
  auto& w = inputs[1];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(x);
  enc.set_input_array(w);
  enc.set_output_array(out);
  const int D = x.shape(-1);
  const long rows = D ? long(x.size() / D) : 0;
  const float* xp = x.data<float>();
  const float* wp = w.data<float>();
  float* op = out.data<float>();
  const float eps = eps_;
  enc.dispatch([=]() {
    over_rows(rows, [&](long r) { rms_row(xp + size_t(r) * D, wp, op + size_t(r) * D, D, eps); });
  });
}

void RmsNorm::eval_gpu(const std::vector<mx::array>&, mx::array&) { gpu_unsupported(); }

void Rope::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& x = inputs[0];
  auto& off = inputs[1];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(x);
  enc.set_input_array(off);
  enc.set_output_array(out);
  const int B = x.shape(0), H = x.shape(1), T = x.shape(2), D = x.shape(3);
  const int64_t sb = x.strides()[0], sh = x.strides()[1], st = x.strides()[2], sd = x.strides()[3];
  const int n_off = int(off.size());
  const float* xp = x.data<float>();
  const int32_t* op_ = off.data<int32_t>();
  float* yp = out.data<float>();
  const int dims = dims_, half = dims_ / 2;
  const bool trad = traditional_;
  const float base = base_, scale = scale_;
  enc.dispatch([=]() {
    const int nb = n_off == 1 ? 1 : B;
    std::vector<float> cs, sn;
    rope_table(op_, nb, T, half, base, scale, cs, sn);
    const long rows = long(B) * H * T;
    over_rows(rows, [&](long r) {
      const int t = int(r % T);
      const int h = int((r / T) % H);
      const int b = int(r / (long(T) * H));
      const size_t k = (size_t(nb == 1 ? 0 : b) * T + t) * half;
      rope_row(xp + b * sb + h * sh + t * st, sd, yp + size_t(r) * D, cs.data() + k, sn.data() + k,
               dims, D, trad);
    });
  });
}

void Rope::eval_gpu(const std::vector<mx::array>&, mx::array&) { gpu_unsupported(); }

namespace {
// silu(x) * u on 8 lanes: e = exp(-|x|) (vmath.h's exp_neg), sigmoid(x) = 1 / (1 + e) for
// x >= 0, e / (1 + e) below.
inline __m256 silu_mul8(__m256 x, __m256 u) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  const __m256 e = exp_neg(_mm256_or_ps(x, sign));  // exp(-|x|)
  const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
  const __m256 sig = _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), x);  // x < 0: e / (1 + e)
  return _mm256_mul_ps(_mm256_mul_ps(x, sig), u);
}

// out[i] = silu(g[i]) * u[i] for i in [0, n). Every element goes through silu_mul8 (a tail
// through a padded copy), so its value does not depend on where it sits in a pass: a row's MLP
// output is the same in a 1-row decode step, a 15-row verify and a 512-row prefill chunk (the
// per-row path ran std::exp, the many-row path exp_neg, and the row's bits followed the pass).
inline void silu_mul(const float* g, const float* u, float* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
  if (i < n) {
    alignas(32) float tg[8] = {}, tu[8] = {}, to[8];
    for (size_t j = i; j < n; ++j) tg[j - i] = g[j], tu[j - i] = u[j];
    _mm256_store_ps(to, silu_mul8(_mm256_load_ps(tg), _mm256_load_ps(tu)));
    for (size_t j = i; j < n; ++j) out[j] = to[j - i];
  }
}
}  // namespace

void run_swiglu(QmmProblem pg, QmmProblem pu, float* out, bool exact) {
  const int M = pg.M, N = pg.N;
  // Decode-sized calls keep their gate/up scratch with the thread: no allocation and zero fill
  // per layer (every element is written before it is read). Prompt-sized ones allocate per call.
  thread_local std::vector<float> kept_g, kept_u;
  std::vector<float> own_g, own_u;
  const bool keep = M < qmm_dense_min_rows();
  // References: inside a pool job `kept_g` would name the worker's own vector.
  std::vector<float>& g = keep ? kept_g : own_g;
  std::vector<float>& u = keep ? kept_u : own_u;
  if (g.size() < size_t(M) * N) g.resize(size_t(M) * N);
  if (u.size() < size_t(M) * N) u.resize(size_t(M) * N);
  pg.out = g.data();
  pu.out = u.data();
  if (!keep) {  // prefill-sized: the many-row path (qmm_run), then the activation
    if (exact) {
      qmm_run(pg, true);
      qmm_run(pu, true);
    } else {
      const QmmProblem gu[2] = {pg, pu};
      qmm_run_shared_x(gu, 2);  // x quantized once for both
    }
    // silu(g) * u on the pool (a scalar loop ran one exp per element on one thread: ~5% of the
    // CPU of a 512-token prefill chunk of SmolLM2, all of it serial).
    const size_t total = size_t(M) * N, per = 1 << 14;
    const int n_chunks = int((total + per - 1) / per);
    Pool::get().run(n_chunks, [&](int c) {
      const size_t i0 = size_t(c) * per, i1 = std::min(total, i0 + per);
      silu_mul(g.data() + i0, u.data() + i0, out + i0, i1 - i0);
    });
    return;
  }
  // The exact kernel reads float32 scales only (the int8 one takes float16 as they are).
  thread_local std::vector<float> wide_g, wide_u;
  if (exact) {
    pg = f32_scales(pg, wide_g);
    pu = f32_scales(pu, wide_u);
  }
  // One x preparation for both matmuls (same K and group size).
  thread_local PreparedX px;
  prepare_x(pg, !exact, px);
  const XView xv = x_view(px);
  const QmmColumns k = qmm_columns(exact);
  // Column chunks as QuantizedMatmul cuts them; each chunk runs gate, up and the activation
  // for its columns, so results do not depend on the thread count.
  const int chunk = qmm_chunk_cols(N, M);
  const int n_chunks = (N + chunk - 1) / chunk;
  Pool::get().run(n_chunks, [&](int c) {
    const int n0 = c * chunk, n1 = std::min(N, n0 + chunk);
    k(pg, xv, n0, n1);
    k(pu, xv, n0, n1);
    for (int m = 0; m < M; ++m) {
      const size_t i = size_t(m) * N + n0;
      silu_mul(g.data() + i, u.data() + i, out + i, size_t(n1 - n0));
    }
  });
}

void QuantizedSwiglu::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  QmmProblem pg = qmm_problem(inputs[0], inputs[1], inputs[2], inputs[3], group_size_, bits_, nullptr);
  QmmProblem pu = qmm_problem(inputs[0], inputs[4], inputs[5], inputs[6], group_size_, bits_, nullptr);
  pg.symmetric = sym_gate_;
  pu.symmetric = sym_up_;
  float* o = out.data<float>();
  const bool exact = exact_;
  enc.dispatch([pg, pu, o, exact]() { run_swiglu(pg, pu, o, exact); });
}

void QuantizedSwiglu::eval_gpu(const std::vector<mx::array>&, mx::array&) { gpu_unsupported(); }

mx::array quantized_swiglu(
    const mx::array& x, const mx::array& wg, const mx::array& sg, const mx::array& bg,
    const mx::array& wu, const mx::array& su, const mx::array& bu, int group_size, int bits,
    bool exact, bool symmetric_gate, bool symmetric_up, mx::StreamOrDevice s) {
  // Each projection must be a valid quantized_matmul; building both checks every shape.
  quantized_matmul(x, wg, sg, bg, group_size, bits, exact, symmetric_gate, s);
  quantized_matmul(x, wu, su, bu, group_size, bits, exact, symmetric_up, s);
  if (wg.shape() != wu.shape())
    throw std::invalid_argument("[mlxterm.quantized_swiglu] gate and up weights must have one shape.");
  auto st = mx::to_stream(s);
  auto f32 = [&](const mx::array& a) {
    return contiguous_in(a.dtype() == mx::float32 ? a : mx::astype(a, mx::float32, st), st);
  };
  std::vector<mx::array> inputs = {
      f32(x), contiguous_in(wg, st), qmm_scales(sg, bg, st), qmm_scales(bg, sg, st),
      contiguous_in(wu, st), qmm_scales(su, bu, st), qmm_scales(bu, su, st)};
  auto shape = x.shape();
  shape.back() = wg.shape(0);
  return mx::array(
      shape, mx::float32,
      std::make_shared<QuantizedSwiglu>(st, group_size, bits, exact, symmetric_gate, symmetric_up), inputs);
}

namespace {

// One row: out = x - (max + log(sum(exp(x - max)))).
void log_softmax_row(const float* x, float* o, int V) {
  __m256 vm = _mm256_set1_ps(-INFINITY);
  int j = 0;
  for (; j + 8 <= V; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(x + j));
  float m = hmax(vm);
  for (; j < V; ++j) m = std::max(m, x[j]);
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  j = 0;
  for (; j + 32 <= V; j += 32)
    for (int t = 0; t < 4; ++t)
      acc[t] = _mm256_add_ps(acc[t], exp_neg(_mm256_sub_ps(_mm256_loadu_ps(x + j + 8 * t), mv)));
  for (; j + 8 <= V; j += 8) acc[0] = _mm256_add_ps(acc[0], exp_neg(_mm256_sub_ps(_mm256_loadu_ps(x + j), mv)));
  float sum = hadd(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  for (; j < V; ++j) sum += std::exp(x[j] - m);
  const float lse = m + std::log(sum);
  const __m256 lv = _mm256_set1_ps(lse);
  j = 0;
  for (; j + 8 <= V; j += 8) _mm256_storeu_ps(o + j, _mm256_sub_ps(_mm256_loadu_ps(x + j), lv));
  for (; j < V; ++j) o[j] = x[j] - lse;
}

void log_softmax_row_ref(const float* x, float* o, int V) {
  double m = -INFINITY, sum = 0.0;
  for (int j = 0; j < V; ++j) m = std::max(m, double(x[j]));
  for (int j = 0; j < V; ++j) sum += std::exp(double(x[j]) - m);
  const double lse = m + std::log(sum);
  for (int j = 0; j < V; ++j) o[j] = float(double(x[j]) - lse);
}

}  // namespace

// The CPU stream of a row primitive's call, after checking its input is float32 (..., V >= 1).
mx::Stream row_stream(const mx::array& x, const std::string& op, mx::StreamOrDevice s) {
  if (x.ndim() < 1 || x.dtype() != mx::float32 || x.shape(-1) < 1)
    throw std::invalid_argument("[mlxterm." + op + "] x must be float32 (..., V) with V >= 1.");
  return cpu_stream(s, op.c_str());
}

void RowPrimitive::eval_gpu(const std::vector<mx::array>&, mx::array&) { gpu_unsupported(); }

void LogSoftmax::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const bool ref = reference_;
  dispatch_rows<float>(stream(), inputs[0], out, [ref](const float* xp, float* op, int V, long rows) {
    // A row is one vocabulary (tens of thousands of values): one row per pool chunk.
    Pool::get().run(int(rows), [&](int r) {
      if (ref) log_softmax_row_ref(xp + size_t(r) * V, op + size_t(r) * V, V);
      else log_softmax_row(xp + size_t(r) * V, op + size_t(r) * V, V);
    });
  });
}

mx::array log_softmax(const mx::array& x, bool reference, mx::StreamOrDevice s) {
  auto st = row_stream(x, "log_softmax", s);
  return mx::array(x.shape(), mx::float32, std::make_shared<LogSoftmax>(st, reference),
                   {contiguous_in(x, st)});
}

namespace {

// Each lane of four independent chains (so a compare-and-blend does not wait on the previous
// one) keeps the first index of its largest value (strict >); the row's answer is the largest
// value's smallest index over the 32 lanes and the scalar tail, i.e. its first index.
int32_t argmax_row(const float* x, int V) {
  int j = 0;
  float best = -INFINITY;
  int32_t at = 0;
  if (V >= 32) {
    __m256 vb[4];
    __m256i vi[4], idx[4];
    for (int c = 0; c < 4; ++c) {
      vb[c] = _mm256_loadu_ps(x + 8 * c);
      vi[c] = idx[c] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * c));
    }
    const __m256i step = _mm256_set1_epi32(32);
    for (j = 32; j + 32 <= V; j += 32)
      for (int c = 0; c < 4; ++c) {
        idx[c] = _mm256_add_epi32(idx[c], step);
        const __m256 v = _mm256_loadu_ps(x + j + 8 * c);
        const __m256 gt = _mm256_cmp_ps(v, vb[c], _CMP_GT_OQ);
        vb[c] = _mm256_blendv_ps(vb[c], v, gt);
        vi[c] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vi[c]), _mm256_castsi256_ps(idx[c]), gt));
      }
    alignas(32) float bv[32];
    alignas(32) int32_t bi[32];
    for (int c = 0; c < 4; ++c) {
      _mm256_store_ps(bv + 8 * c, vb[c]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(bi + 8 * c), vi[c]);
    }
    best = bv[0];
    at = bi[0];
    for (int l = 1; l < 32; ++l)
      if (bv[l] > best || (bv[l] == best && bi[l] < at)) best = bv[l], at = bi[l];
  } else {
    best = x[0];
    j = 1;
  }
  for (; j < V; ++j)
    if (x[j] > best) best = x[j], at = j;
  return at;
}

int32_t argmax_row_ref(const float* x, int V) {
  int32_t at = 0;
  for (int j = 1; j < V; ++j)
    if (x[j] > x[at]) at = j;
  return at;
}

}  // namespace

void ArgmaxRows::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const bool ref = reference_;
  dispatch_rows<int32_t>(stream(), inputs[0], out, [ref](const float* xp, int32_t* op, int V, long rows) {
    // ~7 us per 49k-value row, bound by reading it: on this thread (measured: the pool's two
    // threads were no faster for 8 x 152k values, and slower for 8 x 49k).
    for (long r = 0; r < rows; ++r)
      op[r] = ref ? argmax_row_ref(xp + size_t(r) * V, V) : argmax_row(xp + size_t(r) * V, V);
  });
}

mx::array argmax_rows(const mx::array& x, bool reference, mx::StreamOrDevice s) {
  auto st = row_stream(x, "argmax_rows", s);
  auto shape = x.shape();
  shape.pop_back();
  return mx::array(shape, mx::int32, std::make_shared<ArgmaxRows>(st, reference), {contiguous_in(x, st)});
}

mx::array rms_norm(const mx::array& x, const mx::array& w, float eps, mx::StreamOrDevice s) {
  if (x.ndim() < 1 || x.dtype() != mx::float32 || w.ndim() != 1 || w.shape(0) != x.shape(-1))
    throw std::invalid_argument("[mlxterm.rms_norm] x must be float32 (..., D) and w (D,).");
  auto st = mx::to_stream(s);
  if (st.device != mx::Device::cpu)
    throw std::invalid_argument("[mlxterm.rms_norm] runs on the CPU stream only.");
  std::vector<mx::array> inputs = {
      contiguous_in(x, st), contiguous_in(mx::astype(w, mx::float32, st), st)};
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(st, eps), inputs);
}

mx::array rope(
    const mx::array& x, const mx::array& offset, int dims, bool traditional, float base,
    float scale, mx::StreamOrDevice s) {
  if (x.ndim() != 4 || x.dtype() != mx::float32)
    throw std::invalid_argument("[mlxterm.rope] x must be float32 (B, H, T, D).");
  if (dims <= 0 || dims % 2 || dims > x.shape(3))
    throw std::invalid_argument("[mlxterm.rope] dims must be even and at most D.");
  if (offset.size() != 1 && int(offset.size()) != x.shape(0))
    throw std::invalid_argument("[mlxterm.rope] offset must be a scalar or one per batch row.");
  auto st = mx::to_stream(s);
  if (st.device != mx::Device::cpu)
    throw std::invalid_argument("[mlxterm.rope] runs on the CPU stream only.");
  std::vector<mx::array> inputs = {
      x, contiguous_in(mx::flatten(mx::astype(offset, mx::int32, st), st), st)};
  return mx::array(
      x.shape(), mx::float32, std::make_shared<Rope>(st, dims, traditional, base, scale), inputs);
}

}  // namespace mlxterm
