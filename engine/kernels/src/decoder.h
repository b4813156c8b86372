// A decoder layer of a llama/qwen2-style model as two primitives around its attention, for
// decode-sized inputs (a few rows). At decode every MLX op is a dispatch, an allocation and
// a graph node for a few hundred floats, and every quantized matmul a hand-off to the kernel
// pool: the layer's ~20 ops (norm, q/k/v matmuls, bias adds, transposes, two RoPEs, o_proj,
// residual add, norm, SwiGLU, down, residual add) become two, and its 7 pool jobs 4.
//
//   norm_qkv_rope: x -> q, k, v   rmsnorm(x) @ Wq/Wk/Wv (+ biases), one int8 activation
//                                 quantization and one pool job for all three, RoPE on q and k,
//                                 outputs in the attention's (B, heads, L, head_dim) layout.
//   attn_out_mlp: (a, h) -> h'    h1 = h + a @ Wo; h' = h1 + down(swiglu(rmsnorm(h1))), with a
//                                 the attention output (B, H, L, Dv) read as (B, L, H * Dv).
//
// Both run exactly the arithmetic of the ops they replace (the same row kernels: rms_row,
// rope_row, the quantized matmul's column kernels, run_swiglu), so a routed layer gives the
// same bits as the layer op by op, for every row count and thread count.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlxterm {

namespace mx = mlx::core;

// One quantized weight: the three arrays and their format.
struct QWeight {
  mx::array w, scales, biases;
  int group_size, bits;
  bool symmetric = false;  // biases == -2^(bits-1) * scales (see QmmProblem::symmetric)
};

// x (B, L, Dm) float32; offset int32 of size 1 or B (RoPE positions offset[b] + l);
// biases: none or three float (N,) arrays. Returns {q (B, H, L, D), k (B, Hk, L, D),
// v (B, Hk, L, D)} with D = q's out features / H.
std::vector<mx::array> norm_qkv_rope(
    const mx::array& x, const mx::array& norm_w, float eps, const QWeight& q, const QWeight& k,
    const QWeight& v, const std::vector<mx::array>& biases, const mx::array& offset, int n_heads,
    int n_kv_heads, int rope_dims, bool traditional, float base, float scale,
    mx::StreamOrDevice s = {});

// a (B, H, L, Dv) float32, h (B, L, Dm) float32 with Dm = Wo's out features.
mx::array attn_out_mlp(
    const mx::array& a, const mx::array& h, const QWeight& o, const mx::array& norm_w, float eps,
    const QWeight& gate, const QWeight& up, const QWeight& down, mx::StreamOrDevice s = {});

class NormQkvRope : public mx::Primitive {
 public:
  NormQkvRope(mx::Stream stream, float eps, int n_heads, int n_kv_heads, int rope_dims,
              bool traditional, float base, float scale, int group_size, std::vector<int> bits,
              bool has_bias)
      : mx::Primitive(stream), eps_(eps), n_heads_(n_heads), n_kv_heads_(n_kv_heads),
        rope_dims_(rope_dims), traditional_(traditional), base_(base), scale_(scale),
        group_size_(group_size), bits_(std::move(bits)), has_bias_(has_bias) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "MlxtermNormQkvRope"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const NormQkvRope&>(other);
    return eps_ == o.eps_ && n_heads_ == o.n_heads_ && n_kv_heads_ == o.n_kv_heads_ &&
           rope_dims_ == o.rope_dims_ && traditional_ == o.traditional_ && base_ == o.base_ &&
           scale_ == o.scale_ && group_size_ == o.group_size_ && bits_ == o.bits_ &&
           has_bias_ == o.has_bias_;
  }

 private:
  float eps_;
  int n_heads_, n_kv_heads_, rope_dims_;
  bool traditional_;
  float base_, scale_;
  int group_size_;
  std::vector<int> bits_;  // bits of q, k, v, then their symmetric flags
  bool has_bias_;
};

class AttnOutMlp : public mx::UnaryPrimitive {
 public:
  AttnOutMlp(mx::Stream stream, float eps, std::vector<int> formats)
      : mx::UnaryPrimitive(stream), eps_(eps), formats_(std::move(formats)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[1].shape()};
  }
  const char* name() const override { return "MlxtermAttnOutMlp"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const AttnOutMlp&>(other);
    return eps_ == o.eps_ && formats_ == o.formats_;
  }

 private:
  float eps_;
  std::vector<int> formats_;  // (group_size, bits) of o, gate/up, down; symmetric of o, gate, up, down
};

}  // namespace mlxterm
