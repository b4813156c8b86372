// The decoder-layer primitives (see decoder.h for what and why).
#include "decoder.h"
#include "q6k.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "fused.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "ops.h"
#include "pool.h"
#include "qmm.h"

namespace mlxterm {

namespace {

// q6k: the weight may be GGUF Q6_K blocks (the matmuls that run through qmm_run alone).
void check_weight(const QWeight& q, int K, const char* op, const char* what, bool q6k = false) {
  const std::string where = std::string("[mlxterm.") + op + "] " + what + ": ";
  if (q6k && q.bits == kQ6KBits) {  // GGUF Q6_K blocks (q6k.h): w only
    if (q.w.ndim() != 2 || q.w.dtype() != mx::uint8 || K % kQ6KValues != 0 ||
        int64_t(q.w.shape(1)) != int64_t(K / kQ6KValues) * kQ6KBlockBytes)
      throw std::invalid_argument(where + "Q6_K w must be uint8 (N, K / 256 * 210) for this input.");
    return;
  }
  if (q.bits != 4 && q.bits != 5 && q.bits != 8)
    throw std::invalid_argument(where + "bits must be 4, 5 or 8.");
  if (q.group_size != 32 && q.group_size != 64 && q.group_size != 128)
    throw std::invalid_argument(where + "group_size must be 32, 64 or 128.");
  if (q.w.ndim() != 2 || q.w.dtype() != mx::uint32 || int64_t(q.w.shape(1)) * 32 != int64_t(K) * q.bits)
    throw std::invalid_argument(where + "w must be uint32 (N, K * bits / 32) for this input.");
  check_scales(q.scales, q.biases, q.w.shape(0), K, q.group_size, where);
}


mx::array f32c(const mx::array& a, mx::Stream st) {
  return contiguous_in(a.dtype() == mx::float32 ? a : mx::astype(a, mx::float32, st), st);
}

void push_weight(std::vector<mx::array>& in, const QWeight& q, mx::Stream st) {
  in.push_back(contiguous_in(q.w, st));
  if (q.bits == kQ6KBits) {  // no scales: the blocks hold them (the slots stay, unread)
    in.push_back(in.back());
    in.push_back(in.back());
    return;
  }
  in.push_back(qmm_scales(q.scales, q.biases, st));
  in.push_back(qmm_scales(q.biases, q.scales, st));
}

QmmProblem problem(const float* x, int M, int K, const mx::array* w3, int group_size, int bits,
                   float* out) {
  QmmProblem p;
  p.x = x;
  p.M = M;
  p.K = K;
  p.N = w3[0].shape(0);
  p.w = w3[0].data<uint8_t>();
  if (bits != kQ6KBits) set_scales(p, w3[1], w3[2]);
  p.group_size = group_size;
  p.bits = bits;
  p.out = out;
  return p;
}

}  // namespace

// Calls of up to this many rows keep their scratch with the stream thread between calls (one
// prefill chunk, engine/generation/generate.py: PREFILL_CHUNK; SmolLM2 ~10 MB, Qwen2.5-0.5B ~20 MB
// at most); larger ones (joint prefills of several prompts) allocate it per call.
constexpr int kKeptScratchRows = 512;

// A layer call's float scratch: the thread's own vector, kept between calls, up to
// kKeptScratchRows rows; above that a buffer from MLX's allocator, freed at the end of the call
// (a kept one would pin the largest joint prefill's size to the stream thread). Per-call
// buffers for every prompt forward measured slower (page faults; with std::vector also zero fill).
class Floats {
 public:
  Floats(std::vector<float>& keep, bool once) : keep_(keep), once_(once) {}
  Floats(const Floats&) = delete;
  Floats& operator=(const Floats&) = delete;
  ~Floats() {
    if (buf_.ptr()) mx::allocator::allocator().free(buf_);
  }
  void resize(size_t n) {
    if (!once_) {
      keep_.resize(n);
      p_ = keep_.data();
      return;
    }
    if (buf_.ptr()) mx::allocator::allocator().free(buf_);
    buf_ = mx::allocator::allocator().malloc(n * sizeof(float));
    p_ = static_cast<float*>(buf_.raw_ptr());
  }
  float* data() const { return p_; }
  float& operator[](size_t i) const { return p_[i]; }

 private:
  std::vector<float>& keep_;
  bool once_;
  mx::allocator::Buffer buf_{nullptr};
  float* p_ = nullptr;
};

// A layer call's row loops (norms, RoPE, residual adds, layout copies): a prompt forward's on the
// kernel pool, a decode step's few rows on this thread (a pool hand-off costs more than their
// work). Each row's arithmetic is the same either way.
template <class F>
void layer_rows(int rows, F&& f) {
  if (rows >= qmm_dense_min_rows())
    over_rows(rows, f);
  else
    for (int r = 0; r < rows; ++r) f(r);
}

std::vector<mx::Shape> NormQkvRope::output_shapes(const std::vector<mx::array>& inputs) {
  const auto& x = inputs[0];
  const int B = x.shape(0), L = x.shape(1);
  const int D = inputs[3].shape(0) / n_heads_;
  const int Dk = inputs[6].shape(0) / n_kv_heads_, Dv = inputs[9].shape(0) / n_kv_heads_;
  return {{B, n_heads_, L, D}, {B, n_kv_heads_, L, Dk}, {B, n_kv_heads_, L, Dv}};
}

void NormQkvRope::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
    enc.set_output_array(o);
  }
  const auto& x = inputs[0];
  const int B = x.shape(0), L = x.shape(1), Dm = x.shape(2), rows = B * L;
  const float* xp = x.data<float>();
  const float* nw = inputs[1].data<float>();
  const int32_t* off = inputs[2].data<int32_t>();
  const int n_off = int(inputs[2].size());
  QmmProblem p[3];
  for (int i = 0; i < 3; ++i) {
    p[i] = problem(nullptr, rows, Dm, &inputs[3 + 3 * i], group_size_, bits_[i], nullptr);
    p[i].symmetric = bits_[3 + i] != 0;
  }
  const float* lb[3] = {nullptr, nullptr, nullptr};
  if (has_bias_)
    for (int i = 0; i < 3; ++i) lb[i] = inputs[12 + i].data<float>();
  float* out[3] = {outputs[0].data<float>(), outputs[1].data<float>(), outputs[2].data<float>()};
  const int heads[3] = {n_heads_, n_kv_heads_, n_kv_heads_};
  const float eps = eps_, base = base_, scale = scale_;
  const int dims = rope_dims_;
  const bool trad = traditional_;
  enc.dispatch([=]() mutable {
    thread_local std::vector<float> cs, sn, keep[4];
    thread_local PreparedX px;
    const bool once = rows > kKeptScratchRows;
    Floats xn(keep[0], once);
    Floats part[3] = {Floats(keep[1], once), Floats(keep[2], once), Floats(keep[3], once)};
    xn.resize(size_t(rows) * Dm);
    layer_rows(rows, [&](long r) { rms_row(xp + size_t(r) * Dm, nw, xn.data() + size_t(r) * Dm, Dm, eps); });
    for (int i = 0; i < 3; ++i) {
      part[i].resize(size_t(rows) * p[i].N);
      p[i].x = xn.data();
      p[i].out = part[i].data();
    }
    if (rows >= qmm_dense_min_rows()) {
      // Prompt-sized: each matmul on its many-row path (AMX tiles, VNNI GEMM or float panels).
      qmm_run_shared_x(p, 3);
    } else {
      // One activation quantization and one pool job for the three matmuls.
      prepare_x(p[0], true, px);
      const XView xv = x_view(px);
      const QmmColumns kern = qmm_columns(false);
      const int cc = qmm_chunk_cols(p[0].N + p[1].N + p[2].N, rows);
      int first[4] = {0, 0, 0, 0};
      for (int i = 0; i < 3; ++i) first[i + 1] = first[i] + (p[i].N + cc - 1) / cc;
      Pool::get().run(first[3], [&](int c) {
        const int i = c < first[1] ? 0 : c < first[2] ? 1 : 2;
        const int n0 = (c - first[i]) * cc, n1 = std::min(p[i].N, n0 + cc);
        kern(p[i], xv, n0, n1);
      });
    }
    // Linear biases (qwen2), as the separate add would: y + b.
    if (lb[0])
      layer_rows(rows, [&](long r) {
        for (int i = 0; i < 3; ++i) {
          float* yr = part[i].data() + size_t(r) * p[i].N;
          for (int n = 0; n < p[i].N; ++n) yr[n] = yr[n] + lb[i][n];
        }
      });
    // RoPE on q and k, and every head to (B, heads, L, D).
    const int nb = n_off == 1 ? 1 : B;
    const int half = dims / 2;
    // Every layer of a forward asks for the same table (same offsets, L and RoPE settings):
    // libm's sincos for it was ~1.9% of a prompt forward's CPU, once per layer.
    thread_local RopeTableKey have;
    const RopeTableKey want(off, nb, L, half, base, scale);
    if (!(want == have)) {
      rope_table(off, nb, L, half, base, scale, cs, sn);
      have = want;
    }
    // The tables by pointer: inside the loop on a pool thread, `cs` would name that thread's own.
    const float* cos_t = cs.data();
    const float* sin_t = sn.data();
    layer_rows(rows, [&](long bt) {
      const int b = int(bt / L), t = int(bt % L);
      for (int i = 0; i < 3; ++i) {
        const int Hh = heads[i], D = p[i].N / Hh;
        for (int h = 0; h < Hh; ++h) {
          const float* src = part[i].data() + size_t(bt) * p[i].N + size_t(h) * D;
          float* dst = out[i] + ((size_t(b) * Hh + h) * L + t) * D;
          if (i == 2) {
            std::copy_n(src, D, dst);
          } else {
            const size_t kk = (size_t(nb == 1 ? 0 : b) * L + t) * half;
            rope_row(src, 1, dst, cos_t + kk, sin_t + kk, dims, D, trad);
          }
        }
      }
    });
  });
}

void NormQkvRope::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) { gpu_unsupported(); }

void AttnOutMlp::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  const auto& a = inputs[0];
  const auto& h = inputs[1];
  const int B = a.shape(0), H = a.shape(1), L = a.shape(2), Dv = a.shape(3);
  const int Dm = h.shape(2), rows = B * L, Ka = H * Dv;
  const float* ap = a.data<float>();
  const float* hp = h.data<float>();
  const float* nw = inputs[5].data<float>();
  QmmProblem po = problem(nullptr, rows, Ka, &inputs[2], formats_[0], formats_[1], nullptr);
  QmmProblem pg = problem(nullptr, rows, Dm, &inputs[6], formats_[2], formats_[3], nullptr);
  QmmProblem pu = problem(nullptr, rows, Dm, &inputs[9], formats_[2], formats_[3], nullptr);
  QmmProblem pd = problem(nullptr, rows, pg.N, &inputs[12], formats_[4], formats_[5], nullptr);
  po.symmetric = formats_[6] != 0;
  pg.symmetric = formats_[7] != 0;
  pu.symmetric = formats_[8] != 0;
  pd.symmetric = formats_[9] != 0;
  float* op = out.data<float>();
  const float eps = eps_;
  enc.dispatch([=]() mutable {
    thread_local std::vector<float> keep[4];
    const bool once = rows > kKeptScratchRows;
    Floats ao(keep[0], once), r(keep[1], once), hn(keep[2], once), act(keep[3], once);
    // The attention output (B, H, L, Dv) as the (B, L, H * Dv) rows o_proj multiplies.
    ao.resize(size_t(rows) * Ka);
    layer_rows(rows, [&](long bt) {
      const int b = int(bt / L), t = int(bt % L);
      for (int hh = 0; hh < H; ++hh)
        std::copy_n(ap + ((size_t(b) * H + hh) * L + t) * Dv, Dv, ao.data() + size_t(bt) * Ka + size_t(hh) * Dv);
    });
    r.resize(size_t(rows) * Dm);
    QmmProblem q = po;
    q.x = ao.data();
    q.out = r.data();
    qmm_run(q, false);
    const size_t n = size_t(rows) * Dm;
    hn.resize(n);
    layer_rows(rows, [&](long t) {  // h1 = h + o_proj(a), then its norm
      float* o1 = op + size_t(t) * Dm;
      const float* h0 = hp + size_t(t) * Dm;
      const float* r1 = r.data() + size_t(t) * Dm;
      for (int j = 0; j < Dm; ++j) o1[j] = h0[j] + r1[j];
      rms_row(o1, nw, hn.data() + size_t(t) * Dm, Dm, eps);
    });
    act.resize(size_t(rows) * pg.N);
    QmmProblem g = pg, u = pu;
    g.x = u.x = hn.data();
    run_swiglu(g, u, act.data(), false);
    q = pd;
    q.x = act.data();
    q.out = r.data();
    qmm_run(q, false);
    layer_rows(rows, [&](long t) {  // h1 + down(...)
      float* o1 = op + size_t(t) * Dm;
      const float* r1 = r.data() + size_t(t) * Dm;
      for (int j = 0; j < Dm; ++j) o1[j] = o1[j] + r1[j];
    });
  });
}

void AttnOutMlp::eval_gpu(const std::vector<mx::array>&, mx::array&) { gpu_unsupported(); }

std::vector<mx::array> norm_qkv_rope(
    const mx::array& x, const mx::array& norm_w, float eps, const QWeight& q, const QWeight& k,
    const QWeight& v, const std::vector<mx::array>& biases, const mx::array& offset, int n_heads,
    int n_kv_heads, int rope_dims, bool traditional, float base, float scale,
    mx::StreamOrDevice s) {
  const char* op = "norm_qkv_rope";
  if (x.ndim() != 3 || x.dtype() != mx::float32)
    throw std::invalid_argument("[mlxterm.norm_qkv_rope] x must be float32 (B, L, D).");
  const int Dm = x.shape(2);
  if (norm_w.ndim() != 1 || norm_w.shape(0) != Dm)
    throw std::invalid_argument("[mlxterm.norm_qkv_rope] norm weight must be (D,).");
  check_weight(q, Dm, op, "q");
  check_weight(k, Dm, op, "k");
  check_weight(v, Dm, op, "v");
  if (q.group_size != k.group_size || q.group_size != v.group_size)
    throw std::invalid_argument("[mlxterm.norm_qkv_rope] q, k and v must share one group size.");
  if (n_heads <= 0 || n_kv_heads <= 0 || q.w.shape(0) % n_heads || k.w.shape(0) % n_kv_heads ||
      v.w.shape(0) % n_kv_heads || q.w.shape(0) / n_heads != k.w.shape(0) / n_kv_heads)
    throw std::invalid_argument("[mlxterm.norm_qkv_rope] q/k/v out features must split into heads of one size.");
  const int D = q.w.shape(0) / n_heads;
  if (rope_dims <= 0 || rope_dims % 2 || rope_dims > D)
    throw std::invalid_argument("[mlxterm.norm_qkv_rope] rope dims must be even and at most the head size.");
  if (offset.size() != 1 && int(offset.size()) != x.shape(0))
    throw std::invalid_argument("[mlxterm.norm_qkv_rope] offset must be a scalar or one per batch row.");
  if (!biases.empty()) {
    if (biases.size() != 3)
      throw std::invalid_argument("[mlxterm.norm_qkv_rope] biases: none or one per q, k, v.");
    const QWeight* ws[3] = {&q, &k, &v};
    for (int i = 0; i < 3; ++i)
      if (biases[i].ndim() != 1 || biases[i].shape(0) != ws[i]->w.shape(0))
        throw std::invalid_argument("[mlxterm.norm_qkv_rope] a bias does not match its weight.");
  }
  auto st = cpu_stream(s, op);
  std::vector<mx::array> in = {
      contiguous_in(x, st), f32c(norm_w, st),
      contiguous_in(mx::flatten(mx::astype(offset, mx::int32, st), st), st)};
  push_weight(in, q, st);
  push_weight(in, k, st);
  push_weight(in, v, st);
  for (auto& b : biases) in.push_back(f32c(b, st));
  auto prim = std::make_shared<NormQkvRope>(
      st, eps, n_heads, n_kv_heads, rope_dims, traditional, base, scale, q.group_size,
      std::vector<int>{q.bits, k.bits, v.bits, q.symmetric, k.symmetric, v.symmetric}, !biases.empty());
  auto shapes = prim->output_shapes(in);
  return mx::array::make_arrays(std::move(shapes), {mx::float32, mx::float32, mx::float32}, prim, in);
}

mx::array attn_out_mlp(
    const mx::array& a, const mx::array& h, const QWeight& o, const mx::array& norm_w, float eps,
    const QWeight& gate, const QWeight& up, const QWeight& down, mx::StreamOrDevice s) {
  const char* op = "attn_out_mlp";
  if (a.ndim() != 4 || a.dtype() != mx::float32 || h.ndim() != 3 || h.dtype() != mx::float32)
    throw std::invalid_argument("[mlxterm.attn_out_mlp] a must be float32 (B, H, L, Dv), h float32 (B, L, D).");
  if (a.shape(0) != h.shape(0) || a.shape(2) != h.shape(1))
    throw std::invalid_argument("[mlxterm.attn_out_mlp] a and h must have the same batch and length.");
  const int Dm = h.shape(2);
  check_weight(o, a.shape(1) * a.shape(3), op, "o", true);
  if (o.w.shape(0) != Dm)
    throw std::invalid_argument("[mlxterm.attn_out_mlp] o's out features must equal h's width.");
  if (norm_w.ndim() != 1 || norm_w.shape(0) != Dm)
    throw std::invalid_argument("[mlxterm.attn_out_mlp] norm weight must be (D,).");
  check_weight(gate, Dm, op, "gate");
  check_weight(up, Dm, op, "up");
  if (gate.bits != up.bits || gate.group_size != up.group_size || gate.w.shape() != up.w.shape())
    throw std::invalid_argument("[mlxterm.attn_out_mlp] gate and up must share shape and format.");
  check_weight(down, gate.w.shape(0), op, "down", true);
  if (down.w.shape(0) != Dm)
    throw std::invalid_argument("[mlxterm.attn_out_mlp] down's out features must equal h's width.");
  auto st = cpu_stream(s, op);
  std::vector<mx::array> in = {contiguous_in(a, st), contiguous_in(h, st)};
  push_weight(in, o, st);
  in.push_back(f32c(norm_w, st));
  push_weight(in, gate, st);
  push_weight(in, up, st);
  push_weight(in, down, st);
  std::vector<int> formats = {o.group_size, o.bits, gate.group_size, gate.bits, down.group_size, down.bits,
                              o.symmetric, gate.symmetric, up.symmetric, down.symmetric};
  return mx::array(h.shape(), mx::float32, std::make_shared<AttnOutMlp>(st, eps, formats), in);
}

}  // namespace mlxterm
