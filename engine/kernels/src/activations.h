// Elementwise activations that MLX's CPU backend runs with scalar transcendental functions:
// exact (erf) GELU, Whisper's activation (4 x 9.2 M values per 30-s encoder window).
#pragma once

#include "fused.h"

namespace mlxterm {

// x * Phi(x) = x * (1 + erf(x / sqrt(2))) / 2 of float32 x (any shape), erfc by Numerical
// Recipes' Chebyshev fit (fractional error < 1.2e-7) and the vectorised exp of vmath.h.
// `reference` runs the same formula in scalar code with std::exp (tests).
mx::array gelu_erf(const mx::array& x, bool reference, mx::StreamOrDevice s = {});

class GeluErf : public RowPrimitive {
 public:
  using RowPrimitive::RowPrimitive;
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
  const char* name() const override { return "MlxtermGeluErf"; }
};

}  // namespace mlxterm
