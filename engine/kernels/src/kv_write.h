// The batched decode step's KV write: each row's one new key (or value) stored at that row's
// own position of a (rows, heads, capacity, dim) buffer, as one primitive.
// Why: mlx's put_along_axis route is ~8 graph nodes per layer (storage casts, index reshape
// and broadcasts, two scatters with their per-element index arithmetic) -- about 2.5 ms of a
// ~20 ms 8-row SmolLM2 step, nearly all of it serial on MLX's stream thread while the kernel
// pool waits. Here the buffer is donated (written in place) whenever MLX allows it, as its
// scatter's is, and a row is one conversion loop or memcpy. One primitive per buffer, not one
// for K and V: MLX gives each output of a multi-output primitive its own reference to the
// inputs, so their buffers could never be donated (measured: a full copy per call).
// Prompt forwards write their L new rows per head with it too (StaticKVCache): one node per
// buffer instead of astype + slice_update, the float16 cast in F16C instead of MLX's scalar
// conversion, and no copy of the buffer when it can be donated.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlxterm {

namespace mx = mlx::core;

// buf (B, H, S, D) of dtype T; x (B, H, L, D) of dtype T or float32 (then cast to T, with
// mx.astype's bits); pos (B,) int32. Returns buf with row b's x[b, :, l] at position pos[b] + l
// (a position outside [0, S) writes nothing).
mx::array kv_write_rows(const mx::array& buf, const mx::array& x, const mx::array& pos, mx::StreamOrDevice s = {});

class KvWriteRows : public mx::UnaryPrimitive {
 public:
  explicit KvWriteRows(mx::Stream stream) : mx::UnaryPrimitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
  const char* name() const override { return "MlxtermKvWriteRows"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

}  // namespace mlxterm
