// Fused ("flash") attention on the CPU: out = softmax(scale * q @ k^T + mask) @ v without
// materialising the L x S scores. q (B, H, L, D) float32; k (B, Hk, S, D) and v (B, Hk, S, Dv)
// float32 or float16 (H % Hk == 0, query head h reads KV head h / (H / Hk)); out (B, H, L, Dv)
// float32. D % 8 == 0 and Dv % 16 == 0.
// 8-bit K/V (the live "q8" KV format): uint8 (B, Hk, S, D + 4 * D / G), each row D int8 values
// (symmetric, -127..127) then D / G float32 scales, one per group of G dims (G % 32 == 0, D % G
// == 0); value d is int8[d] * scale[d / G]. G follows from q's D and the row width; V rows
// use the same G (Dv = width * G / (G + 4)).
// mode 0: no mask; 1: causal, query i sees keys j <= i + offset (and, with window > 0, only
// j > i + offset - window); 2: an additive float mask (Bm, 1, Lm, S), Bm in {1, B},
// Lm in {1, L} (Lm == 1: one key mask for every query, as the static caches' validity vector).
// Rows whose keys are all masked come out as zeros (MLX gives NaN).
// rotate: q is first multiplied by the orthonormal Walsh-Hadamard matrix on blocks of the
// largest power of two dividing D (kv_cache.q8_rotate, which q8 K rows are stored with), inside
// the kernel instead of as an MLX op per layer.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlxterm {

namespace mx = mlx::core;

// q8 rows: the group size for head dim D and row width W = D + 4 * D / G (0 if none fits),
// and the head dim of a W-byte row with group size G.
inline int q8_group(int D, int W) {
  const int ng4 = W - D;
  return ng4 > 0 && ng4 % 4 == 0 && D % (ng4 / 4) == 0 ? D / (ng4 / 4) : 0;
}
inline int q8_dim(int W, int G) { return G > 0 && W * G % (G + 4) == 0 ? W * G / (G + 4) : 0; }

mx::array flash_attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    int mode,
    int offset,
    int window,
    const mx::array* mask,
    bool reference,
    bool rotate = false,
    mx::StreamOrDevice s = {});

class FlashAttention : public mx::UnaryPrimitive {
 public:
  FlashAttention(mx::Stream stream, float scale, int mode, int offset, int window, bool reference, bool rotate)
      : mx::UnaryPrimitive(stream),
        scale_(scale), mode_(mode), offset_(offset), window_(window), reference_(reference), rotate_(rotate) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "MlxtermFlashAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const FlashAttention&>(other);
    return scale_ == o.scale_ && mode_ == o.mode_ && offset_ == o.offset_ &&
           window_ == o.window_ && reference_ == o.reference_ && rotate_ == o.rotate_;
  }

 private:
  float scale_;
  int mode_, offset_, window_;
  bool reference_, rotate_;
};

// Decode-sized float / float16 scores on AVX-512 (attention_decode512.cpp, two keys per zmm; the
// AVX2 tiles' bits): on where the CPU has it; set_decode512(false) is for A/B runs.
bool decode512_on();
bool set_decode512(bool on);  // returns the previous setting

// Causal prompt forwards (no window) run each query position as the decode step at that
// position runs it (the decode's bits, so cold prefill K/V equal decoded ones); off: the
// many-query register tiles (A/B).
bool attn_rows_on();
bool set_attn_rows(bool on);  // returns the previous setting

// Float (..., D) -> q8 rows uint8 (..., D + 4 * D / G): per group of G dims, scale = max|x| / 127,
// int8 = round-half-even(x * (127 / max|x|)) in -127..127 (an all-zero group: 0 and scale 0),
// then the float32 scales. One op per cache write (the same rows as kv_cache.q8_pack's MLX ops,
// which cost ~15 graph nodes per K and V per layer at every decode step).
mx::array q8_pack(const mx::array& x, int group, mx::StreamOrDevice s = {});

class Q8Pack : public mx::UnaryPrimitive {
 public:
  Q8Pack(mx::Stream stream, int group) : mx::UnaryPrimitive(stream), group_(group) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override { return "MlxtermQ8Pack"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return group_ == static_cast<const Q8Pack&>(other).group_;
  }

 private:
  int group_;
};

}  // namespace mlxterm
