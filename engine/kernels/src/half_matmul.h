// x @ w.T (+ bias) with float16 weights and float32 activations: for models whose weights are
// float16 (Whisper from a CTranslate2 float16 model) at few activation rows, where a step is
// bound by reading the weights. MLX's CPU matmul takes float32 weights (float16 ones are
// converted first, each call), so float32 copies streamed twice the bytes.
#pragma once

#include "fused.h"

namespace mlxterm {

// x (..., K) float32, w (N, K) float16, bias (N,) float32 or an empty array -> (..., N) float32.
// Each output is one fixed sequence of float32 operations (8 lanes of K, their sum in a fixed
// order, the K % 8 tail, + bias), so its bits do not depend on the row count, the tiling or the
// threads. `reference` runs the same sequence in scalar code (tests).
mx::array half_matmul(const mx::array& x, const mx::array& w, const mx::array& bias, bool reference,
                      mx::StreamOrDevice s = {});

class HalfMatmul : public mx::UnaryPrimitive {
 public:
  HalfMatmul(mx::Stream stream, bool has_bias, bool reference)
      : mx::UnaryPrimitive(stream), has_bias_(has_bias), reference_(reference) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "MlxtermHalfMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const HalfMatmul&>(other);
    return has_bias_ == o.has_bias_ && reference_ == o.reference_;
  }

 private:
  bool has_bias_;
  bool reference_;
};

}  // namespace mlxterm
