// Matmul on GGUF Q6_K blocks as the file stores them, for the tensors a Q4_K_M file keeps in
// Q6_K (the output head, half the FFN down projections): 6.5625 bits a weight against the
// 8.5 of their re-quantization to 8-bit affine, and decode streams the weights, so bytes are time.
//
// Block (210 bytes per 256 values of a row): ql[128] low nibbles, qh[64] high 2-bit pairs,
// scales[16] int8 (one per 16 values), d float16; w = d * scales[j] * (q - 32), q in 0..63.
//
// Activations are quantized per row and 256-value super-block to int8 (d_x = amax / 127),
// as llama.cpp's q8_K. Every output is then one fixed sequence: per super-block the exact
// int32 sum_j scales[j] * sum_{k in j} (q_k - 32) * x_k (integer, so any instruction order
// gives it), then acc = fma(float(isum), d_w * d_x, acc) in super-block order from 0. So a
// row's bits do not depend on the row count, the column split, the threads or the ISA, and a
// prompt forward writes the K/V a decode would.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "fused.h"

namespace mlxterm {

constexpr int kQ6KValues = 256;
constexpr int kQ6KBlockBytes = 210;
// QmmProblem::bits of a Q6_K weight (w: the raw blocks; scales and biases unused). The other
// kernels read 4, 5 or 8 bits only, so 6 names this layout.
constexpr int kQ6KBits = 6;

// Activations quantized for the Q6_K dots: per row, per super-block. With 16-bit activations
// (x16_on(), as the other int8 paths: no activation rounding error to speak of) x / d rounds
// to q16 in [-16256, 16256] (d = amax / 16256), split as q16 = 128 * q + lo; a super-block's
// sum is then float(128.0 * isum(q) + isum(lo)), exact in double before the one rounding.
struct Q6KActs {
  std::vector<int8_t> q;  // (M, K)
  std::vector<float> d;  // (M, K / 256)
  std::vector<int16_t> bsum;  // (M, K / 16): sums of 16 consecutive q
  std::vector<int8_t> lo;  // (M, K), x16 only
  std::vector<int16_t> bsum_lo;  // (M, K / 16), x16 only
  bool x16 = false;
};

void q6k_prepare(const float* x, int M, int K, bool x16, Q6KActs& out, bool reference);
// out[m, n] for n in [n0, n1), every row m (out rows N apart).
void q6k_columns(const uint8_t* w, const Q6KActs& a, int M, int K, int N, float* out, int n0, int n1);
// The same sums in plain scalar code (tests).
void q6k_columns_reference(const uint8_t* w, const Q6KActs& a, int M, int K, int N, float* out, int n0, int n1);
// Rows >= 2 on AVX512-VNNI register tiles (q6k_gemm512.cpp), the same bits.
namespace q6k512 {
void columns(const uint8_t* w, const Q6KActs& a, int M, int K, int N, float* out, int n0, int n1);
}
// x (M, K) @ w.T -> out (M, N) on the kernel pool.
void q6k_run(const float* x, const uint8_t* w, int M, int K, int N, float* out);

// x (..., K) float32, w (N, K / 256 * 210) uint8 -> (..., N) float32. `reference`: the scalar
// code for the activations and the sums (the same bits).
mx::array q6k_matmul(const mx::array& x, const mx::array& w, bool reference, mx::StreamOrDevice s = {});

// A super-block's two 16-bit-activation sums as the one float every path uses.
inline float q6k_join16(int32_t hi, int32_t lo) { return float(double(hi) * 128.0 + double(lo)); }

class Q6KMatmul : public mx::UnaryPrimitive {
 public:
  Q6KMatmul(mx::Stream stream, bool reference) : mx::UnaryPrimitive(stream), reference_(reference) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "MlxtermQ6KMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return reference_ == static_cast<const Q6KMatmul&>(other).reference_;
  }

 private:
  bool reference_;
};

}  // namespace mlxterm
