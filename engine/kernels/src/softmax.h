// Masked softmax over the last axis of attention scores (B, H, L, S), float32.
// mode 0: no mask; 1: causal, query i sees keys j <= i + offset; 2: an additive float mask
// (Bm, 1, L, S) with Bm in {1, B} added before the softmax.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlxterm {

namespace mx = mlx::core;

mx::array masked_softmax(
    const mx::array& scores, int mode, int offset, const mx::array* mask, mx::StreamOrDevice s = {});

class MaskedSoftmax : public mx::UnaryPrimitive {
 public:
  MaskedSoftmax(mx::Stream stream, int mode, int offset)
      : mx::UnaryPrimitive(stream), mode_(mode), offset_(offset) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
  const char* name() const override { return "MlxtermMaskedSoftmax"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const MaskedSoftmax&>(other);
    return mode_ == o.mode_ && offset_ == o.offset_;
  }

 private:
  int mode_, offset_;
};

}  // namespace mlxterm
