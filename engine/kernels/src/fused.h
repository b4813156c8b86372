// Fused small ops of the decode step: RMSNorm and RoPE as single primitives.
// MLX's CPU backend has no kernels for mx.fast.rms_norm / mx.fast.rope and runs each as a
// graph of generic ops (a reduction, casts, arange/exp/cos/sin tables, slices, concatenates);
// at decode every one of those is a separate dispatch and allocation for a few hundred floats.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "pool.h"
#include "qmm.h"

namespace mlxterm {

namespace mx = mlx::core;

constexpr long kRowsPerChunk = 64;

// f(r) for rows r in [0, rows) on the kernel pool, kRowsPerChunk rows per chunk.
template <class F>
void over_rows(long rows, F&& f) {
  const int chunks = int((rows + kRowsPerChunk - 1) / kRowsPerChunk);
  Pool::get().run(chunks, [&](int c) {
    const long end = std::min(rows, (c + 1) * kRowsPerChunk);
    for (long r = c * kRowsPerChunk; r < end; ++r) f(r);
  });
}

// x (..., D) float32 -> x * rsqrt(mean(x^2) + eps) * w, w (D,).
mx::array rms_norm(const mx::array& x, const mx::array& w, float eps, mx::StreamOrDevice s = {});

// x (B, H, T, D) float32 (any strides) -> rotary embedding of the first `dims` features at
// positions (offset[b] + t) * scale, frequencies base^(-i / (dims / 2)); offset int32 of size
// 1 or B. Output is row-contiguous (B, H, T, D).
mx::array rope(
    const mx::array& x, const mx::array& offset, int dims, bool traditional, float base,
    float scale, mx::StreamOrDevice s = {});

// silu(x @ dequantize(wg).T) * (x @ dequantize(wu).T): a SwiGLU MLP's gate and up projections
// and its activation in one primitive (activations quantized once, one pool job for both
// matmuls, no intermediate arrays). Both weights share bits and group size; symmetric_gate /
// symmetric_up as QmmProblem::symmetric (their biases are then never read).
mx::array quantized_swiglu(
    const mx::array& x, const mx::array& wg, const mx::array& sg, const mx::array& bg,
    const mx::array& wu, const mx::array& su, const mx::array& bu, int group_size, int bits,
    bool exact, bool symmetric_gate = false, bool symmetric_up = false, mx::StreamOrDevice s = {});

// x (..., V) float32 -> x - logsumexp(x) over the last axis (log-probabilities), with the
// vectorised exp of vmath.h; `reference` runs a double-precision scalar loop (tests).
mx::array log_softmax(const mx::array& x, bool reference, mx::StreamOrDevice s = {});

// A primitive over the last axis's rows (one vocabulary each) with a `reference` switch
// (a scalar loop, for tests); CPU only.
class RowPrimitive : public mx::UnaryPrimitive {
 public:
  RowPrimitive(mx::Stream stream, bool reference) : mx::UnaryPrimitive(stream), reference_(reference) {}
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  bool is_equivalent(const mx::Primitive& other) const override {
    return reference_ == static_cast<const RowPrimitive&>(other).reference_;
  }

 protected:
  bool reference_;
};

// A primitive's eval_cpu prologue: out allocated, every input and the output registered with the
// stream's encoder, which is returned for the dispatch.
inline mx::cpu::CommandEncoder& begin_eval(mx::Stream st, const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(st);
  for (const auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  return enc;
}

// The output shape of x (..., K) times a weight w (N, ...) as x @ W.T: x's, last dim N.
inline mx::Shape weight_matmul_shape(const std::vector<mx::array>& inputs) {
  auto shape = inputs[0].shape();
  shape.back() = inputs[1].shape(0);
  return shape;
}

// Allocate a row primitive's output and run body(x, out, V, rows) on the stream's worker.
template <typename T, typename Body>
void dispatch_rows(mx::Stream st, const mx::array& x, mx::array& out, Body body) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(st);
  enc.set_input_array(x);
  enc.set_output_array(out);
  const int V = x.shape(-1);
  const long rows = V ? long(x.size() / V) : 0;
  enc.dispatch([body, xp = x.data<float>(), op = out.data<T>(), V, rows]() { body(xp, op, V, rows); });
}

// The CPU stream of a row primitive's call, after checking its input is float32 (..., V >= 1).
mx::Stream row_stream(const mx::array& x, const std::string& op, mx::StreamOrDevice s);

class LogSoftmax : public RowPrimitive {
 public:
  using RowPrimitive::RowPrimitive;
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
  const char* name() const override { return "MlxtermLogSoftmax"; }
};

// x (..., V) float32 -> (...) int32: index of each row's largest value, the first of equal
// ones (mx.argmax's choice), 8 lanes at a time. MLX's CPU argmax is a scalar loop (~0.4 ms
// for the 8 rows of a batched SmolLM2 step); `reference` runs a plain scalar loop (tests).
mx::array argmax_rows(const mx::array& x, bool reference, mx::StreamOrDevice s = {});

class ArgmaxRows : public RowPrimitive {
 public:
  using RowPrimitive::RowPrimitive;
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.pop_back();
    return {shape};
  }
  const char* name() const override { return "MlxtermArgmaxRows"; }
};

// Building blocks shared with the decoder-layer primitives (decoder.cpp), so the fused layer
// runs the very same arithmetic as these ops one by one (bit-identical results).
// One RMSNorm row of D values.
void rms_row(const float* x, const float* w, float* o, int D, float eps);
// cos/sin tables for positions offsets[b] + t (b < nb, t < T), `half` frequencies each.
void rope_table(const int32_t* offsets, int nb, int T, int half, float base, float scale,
                std::vector<float>& cs, std::vector<float>& sn);
// What a rope_table is computed from: a table made for an equal key can be reused.
struct RopeTableKey {
  std::vector<int32_t> offsets;
  int T = -1, half = 0;
  float base = 0.0f, scale = 0.0f;
  RopeTableKey() = default;
  RopeTableKey(const int32_t* offs, int nb, int t, int h, float b, float s)
      : offsets(offs, offs + nb), T(t), half(h), base(b), scale(s) {}
  bool operator==(const RopeTableKey& o) const {
    return offsets == o.offsets && T == o.T && half == o.half && base == o.base && scale == o.scale;
  }
};
// One rotated row: x at stride sd, y contiguous (D values; the first `dims` rotated).
void rope_row(const float* xr, int64_t sd, float* yr, const float* c, const float* s, int dims,
              int D, bool trad);
// silu(x @ Wg.T) * (x @ Wu.T) for pg.x (pg and pu share x, M and K) into out (M, N).
void run_swiglu(QmmProblem pg, QmmProblem pu, float* out, bool exact);

class QuantizedSwiglu : public mx::UnaryPrimitive {
 public:
  QuantizedSwiglu(mx::Stream stream, int group_size, int bits, bool exact, bool sym_gate, bool sym_up)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits), exact_(exact), sym_gate_(sym_gate),
        sym_up_(sym_up) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }
  const char* name() const override { return "MlxtermQuantizedSwiglu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QuantizedSwiglu&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_ && exact_ == o.exact_ && sym_gate_ == o.sym_gate_ &&
           sym_up_ == o.sym_up_;
  }

 private:
  int group_size_, bits_;
  bool exact_, sym_gate_, sym_up_;
};

class RmsNorm : public mx::UnaryPrimitive {
 public:
  RmsNorm(mx::Stream stream, float eps) : mx::UnaryPrimitive(stream), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
  const char* name() const override { return "MlxtermRmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNorm&>(other).eps_;
  }

 private:
  float eps_;
};

class Rope : public mx::UnaryPrimitive {
 public:
  Rope(mx::Stream stream, int dims, bool traditional, float base, float scale)
      : mx::UnaryPrimitive(stream), dims_(dims), traditional_(traditional), base_(base), scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
  const char* name() const override { return "MlxtermRope"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const Rope&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ && scale_ == o.scale_;
  }

 private:
  int dims_;
  bool traditional_;
  float base_, scale_;
};

}  // namespace mlxterm
