// Top-p (nucleus) filter of sampling logits in O(vocab): MLX's way is a full argsort of the
// vocabulary (and one more to undo it), 40-50 ms per 152k-token row on one AVX2 core.
#pragma once

#include "fused.h"

namespace mlxterm {

// x (..., V) float32 -> x where a token is in its row's nucleus, -inf elsewhere. The nucleus is
// the smallest set of most probable tokens (probabilities softmax(x)) whose mass reaches top_p,
// in the order of a stable descending sort of x (equal values: lower index first); the first
// token is always kept. top_p >= 1 (or a row whose max is not finite) passes x through.
// `reference` runs a scalar loop: a full stable sort and double-precision sums (tests).
mx::array top_p_filter(const mx::array& x, float top_p, bool reference, mx::StreamOrDevice s = {});

class TopPFilter : public RowPrimitive {
 public:
  TopPFilter(mx::Stream stream, float top_p, bool reference) : RowPrimitive(stream, reference), top_p_(top_p) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
  const char* name() const override { return "MlxtermTopPFilter"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return RowPrimitive::is_equivalent(other) && top_p_ == static_cast<const TopPFilter&>(other).top_p_;
  }

 private:
  float top_p_;
};

}  // namespace mlxterm
