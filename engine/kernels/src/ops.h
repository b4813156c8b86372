// MLX primitives backed by the engine's CPU kernels.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "qmm.h"

namespace mlxterm {

namespace mx = mlx::core;

// x (..., K) float32 @ dequantize(w, scales, biases).T -> (..., N) float32.
// exact: float activations (for tests); else activations run as int8 per 32-block.
mx::array quantized_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    bool exact,
    bool symmetric = false,
    mx::StreamOrDevice s = {});

// The kernel's view of evaluated arrays: x (..., K) float32, w/scales/biases as
// quantized_matmul takes them, out (M, N) float32 (may be null and set later).
QmmProblem qmm_problem(const mx::array& x, const mx::array& w, const mx::array& scales,
                       const mx::array& biases, int group_size, int bits, float* out);

// p's scales/biases from the arrays: float32, float16 (scales16) or K-quant uint8 (kscales).
void set_scales(QmmProblem& p, const mx::array& scales, const mx::array& biases);
// invalid_argument (prefixed `where`) unless scales/biases fit (N, K) at group_size: float
// (N, K / group_size), or K-quant uint8 (N, K / 256 * kKScaleBytes) at group 32.
void check_scales(const mx::array& scales, const mx::array& biases, int N, int K, int group_size,
                  const std::string& where);

// K-quant scale records (QmmProblem::kscales) of float32 scales/biases (N, K / 32) that factor
// exactly as d * sc and -(dmin * m), else an empty array: engine/kernels/kscales.py's pack,
// the same bytes, at load time (evaluates its inputs).
mx::array kscales_pack(const mx::array& scales, const mx::array& biases);

// The CPU stream of `s` for op `op`, or invalid_argument: the kernels run on the CPU only.
mx::Stream cpu_stream(mx::StreamOrDevice s, const char* op);

// Every primitive's eval_gpu: the kernels have no GPU implementation (runtime_error).
[[noreturn]] void gpu_unsupported();

// `a` as a row-contiguous primitive input: `a` itself when it is already evaluated and row
// contiguous (weights, scales) or an output of this extension's primitives, else
// mx::contiguous(a). Why: MLX's contiguous() is a graph node even for a row-contiguous array,
// and a SmolLM2 decode step held ~930 of them (each evaluated every step).
mx::array contiguous_in(const mx::array& a, mx::Stream st);

// scales or biases (`a`) as the kernels take them: float16 when both are float16 (read as
// such by the decode path), else float32.
mx::array qmm_scales(const mx::array& a, const mx::array& other, mx::Stream st);

class QuantizedMatmul : public mx::UnaryPrimitive {
 public:
  QuantizedMatmul(mx::Stream stream, int group_size, int bits, bool exact, bool symmetric = false)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits), exact_(exact), symmetric_(symmetric) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "MlxtermQuantizedMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int group_size_, bits_;
  bool exact_;
  bool symmetric_;  // biases == -2^(bits-1) * scales (the caller checked): see QmmProblem
};

}  // namespace mlxterm
