// Python bindings: engine/kernels/__init__.py is the only caller.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "ops.h"
#include "pool.h"
#include "qmm.h"
#include "softmax.h"
#include "attention.h"
#include "fused.h"
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>
#include "decoder.h"
#include "kv_write.h"
#include "topp.h"
#include "half_matmul.h"
#include "q6k.h"
#include "activations.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_ext, m) {
  m.doc() = "mlxterm CPU kernels (AVX2/FMA, VNNI where present) as MLX primitives";
  m.def(
      "quantized_matmul",
      [](const mlx::core::array& x, const mlx::core::array& w, const mlx::core::array& scales,
         const mlx::core::array& biases, int group_size, int bits, bool exact, bool symmetric) {
        return mlxterm::quantized_matmul(x, w, scales, biases, group_size, bits, exact, symmetric);
      },
      "x"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "bits"_a, "exact"_a = false,
      "symmetric"_a = false,
      "x @ dequantize(w, scales, biases).T on the CPU, float32 out.");
  m.def("kscales_pack", &mlxterm::kscales_pack, "scales"_a, "biases"_a,
        "K-quant scale records of float32 scales/biases, or an empty array (src/ops.h).");
  m.def(
      "masked_softmax",
      [](const mlx::core::array& scores, int mode, int offset,
         std::optional<mlx::core::array> mask) {
        return mlxterm::masked_softmax(scores, mode, offset, mask ? &*mask : nullptr);
      },
      "scores"_a, "mode"_a, "offset"_a = 0, "mask"_a = nb::none(),
      "softmax over the last axis of (B, H, L, S) float32 scores under a mask.");
  m.def(
      "flash_attention",
      [](const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v,
         float scale, int mode, int offset, int window, std::optional<mlx::core::array> mask,
         bool reference, bool rotate) {
        return mlxterm::flash_attention(
            q, k, v, scale, mode, offset, window, mask ? &*mask : nullptr, reference, rotate);
      },
      "q"_a, "k"_a, "v"_a, "scale"_a, "mode"_a = 0, "offset"_a = 0, "window"_a = 0,
      "mask"_a = nb::none(), "reference"_a = false, "rotate"_a = false,
      "fused softmax(scale * q @ k^T + mask) @ v on the CPU (src/attention.h).");
  m.def(
      "q8_pack",
      [](const mlx::core::array& x, int group) { return mlxterm::q8_pack(x, group); },
      "x"_a, "group"_a, "float (..., D) -> 8-bit KV rows uint8 (..., D + 4 * D / group) (src/attention.h).");
  m.def(
      "quantized_swiglu",
      [](const mlx::core::array& x, const mlx::core::array& wg, const mlx::core::array& sg,
         const mlx::core::array& bg, const mlx::core::array& wu, const mlx::core::array& su,
         const mlx::core::array& bu, int group_size, int bits, bool exact, bool symmetric_gate, bool symmetric_up) {
        return mlxterm::quantized_swiglu(x, wg, sg, bg, wu, su, bu, group_size, bits, exact, symmetric_gate,
                                         symmetric_up);
      },
      "x"_a, "wg"_a, "sg"_a, "bg"_a, "wu"_a, "su"_a, "bu"_a, "group_size"_a, "bits"_a,
      "exact"_a = false, "symmetric_gate"_a = false, "symmetric_up"_a = false,
      "silu(x @ Wg.T) * (x @ Wu.T) on quantized weights, float32 out.");
  m.def(
      "rms_norm",
      [](const mlx::core::array& x, const mlx::core::array& w, float eps) {
        return mlxterm::rms_norm(x, w, eps);
      },
      "x"_a, "w"_a, "eps"_a, "x * rsqrt(mean(x^2) + eps) * w over the last axis, float32.");
  m.def(
      "rope",
      [](const mlx::core::array& x, const mlx::core::array& offset, int dims, bool traditional,
         float base, float scale) {
        return mlxterm::rope(x, offset, dims, traditional, base, scale);
      },
      "x"_a, "offset"_a, "dims"_a, "traditional"_a, "base"_a, "scale"_a,
      "rotary embedding of float32 (B, H, T, D), as mx.fast.rope.");
  m.def(
      "norm_qkv_rope",
      [](const mlx::core::array& x, const mlx::core::array& norm_w, float eps,
         const std::vector<mlx::core::array>& w, const std::vector<int>& formats,
         const std::vector<mlx::core::array>& biases, const mlx::core::array& offset,
         int n_heads, int n_kv_heads, int rope_dims, bool traditional, float base, float scale) {
        if (w.size() != 9 || formats.size() != 9)
          throw std::invalid_argument("[mlxterm.norm_qkv_rope] 9 weight arrays and 9 formats.");
        auto qw = [&](int i) {
          return mlxterm::QWeight{w[3 * i], w[3 * i + 1], w[3 * i + 2], formats[3 * i], formats[3 * i + 1],
                                  formats[3 * i + 2] != 0};
        };
        return mlxterm::norm_qkv_rope(x, norm_w, eps, qw(0), qw(1), qw(2), biases, offset, n_heads,
                                      n_kv_heads, rope_dims, traditional, base, scale);
      },
      "x"_a, "norm_w"_a, "eps"_a, "w"_a, "formats"_a, "biases"_a, "offset"_a, "n_heads"_a,
      "n_kv_heads"_a, "rope_dims"_a, "traditional"_a, "base"_a, "scale"_a,
      "rmsnorm + q/k/v quantized matmuls (+ biases) + RoPE of a decoder layer (src/decoder.h).");
  m.def(
      "attn_out_mlp",
      [](const mlx::core::array& a, const mlx::core::array& h, const mlx::core::array& norm_w,
         float eps, const std::vector<mlx::core::array>& w, const std::vector<int>& formats) {
        if (w.size() != 12 || formats.size() != 12)
          throw std::invalid_argument("[mlxterm.attn_out_mlp] 12 weight arrays and 12 formats.");
        auto qw = [&](int i) {
          return mlxterm::QWeight{w[3 * i], w[3 * i + 1], w[3 * i + 2], formats[3 * i], formats[3 * i + 1],
                                  formats[3 * i + 2] != 0};
        };
        return mlxterm::attn_out_mlp(a, h, qw(0), norm_w, eps, qw(1), qw(2), qw(3));
      },
      "a"_a, "h"_a, "norm_w"_a, "eps"_a, "w"_a, "formats"_a,
      "h + a @ Wo, then + down(swiglu(rmsnorm(.))) of a decoder layer (src/decoder.h).");
  m.def(
      "log_softmax",
      [](const mlx::core::array& x, bool reference) { return mlxterm::log_softmax(x, reference); },
      "x"_a, "reference"_a = false, "x - logsumexp(x) over the last axis, float32 (src/fused.h).");
  m.def(
      "argmax_rows",
      [](const mlx::core::array& x, bool reference) { return mlxterm::argmax_rows(x, reference); },
      "x"_a, "reference"_a = false,
      "Index of each row's largest value (the first of equal ones), float32 (..., V) -> int32 (src/fused.h).");
  m.def(
      "half_matmul",
      [](const mlx::core::array& x, const mlx::core::array& w, std::optional<mlx::core::array> bias, bool reference) {
        return mlxterm::half_matmul(x, w, bias ? *bias : mlx::core::array({}, mlx::core::float32), reference);
      },
      "x"_a, "w"_a, "bias"_a = nb::none(), "reference"_a = false,
      "x @ w.T (+ bias): float32 x (..., K), float16 w (N, K), float32 bias (N,) (src/half_matmul.h).");
  m.def(
      "q6k_matmul",
      [](const mlx::core::array& x, const mlx::core::array& w, bool reference) {
        return mlxterm::q6k_matmul(x, w, reference);
      },
      "x"_a, "w"_a, "reference"_a = false,
      "x @ dequantize(w).T: float32 x (..., K), GGUF Q6_K blocks w uint8 (N, K / 256 * 210) (src/q6k.h).");
  m.def(
      "gelu_erf",
      [](const mlx::core::array& x, bool reference) { return mlxterm::gelu_erf(x, reference); },
      "x"_a, "reference"_a = false, "Exact (erf) GELU x * Phi(x) of float32 x (src/activations.h).");
  m.def(
      "top_p_filter",
      [](const mlx::core::array& x, float top_p, bool reference) {
        return mlxterm::top_p_filter(x, top_p, reference);
      },
      "x"_a, "top_p"_a, "reference"_a = false,
      "x where a token is in its row's top-p nucleus, -inf elsewhere, float32 (..., V) (src/topp.h).");
  m.def(
      "kv_write_rows",
      [](const mlx::core::array& buf, const mlx::core::array& x, const mlx::core::array& pos) {
        return mlxterm::kv_write_rows(buf, x, pos);
      },
      "buf"_a, "x"_a, "pos"_a,
      "Each row's L new keys (or values) from its own position on in a (B, H, S, D) buffer, in place when MLX allows (src/kv_write.h).");
  m.def("configure", [](const std::string& isa) { mlxterm::configure(isa); }, "isa"_a = "",
        "The extension's settings (engine.settings), before the first kernel call: isa \"\" picks the best this CPU has, \"avx2\" or \"avxvnni\" narrow it.");
  m.def("set_amx_min_rows", [](int rows) { return mlxterm::set_amx_min_rows(rows); }, "rows"_a,
        "Rows from which non-exact matmuls run on AMX tiles (default 16, at least 2); returns the previous value.");
  m.def("dense_rows", [] { return mlxterm::qmm_dense_min_rows(); },
        "Rows at which non-exact matmuls leave the int8 row path for the many-row paths.");
  m.def("set_threads", [](int n) { mlxterm::Pool::get().set_threads(n); }, "n"_a);
  m.def("threads", [] { return mlxterm::Pool::get().threads(); });
  m.def("isa", [] { return std::string(mlxterm::isa_name(mlxterm::best_isa())); });
  m.def("amx", [] { return mlxterm::amx_on(); }, "True when non-exact many-row matmuls run on AMX-INT8 tiles.");
  m.def("set_amx", [](bool on) { return mlxterm::set_amx(on); }, "on"_a,
        "Switch the AMX path on or off (A/B); returns the previous setting.");
  m.def("rows512", [] { return mlxterm::rows512_on(); },
        "True when int8 matmuls of 2..15 rows run on the VNNI GEMM's 16-column zmm tiles.");
  m.def("set_rows512", [](bool on) { return mlxterm::set_rows512(on); }, "on"_a,
        "Switch the 16-column few-row path on or off (A/B); returns the previous setting.");
  m.def("rows512_pipe", [] { return mlxterm::rows512_pipe_on(); },
        "True when the 16-column tiles decode the next weight panel between a panel's block dots.");
  m.def("set_rows512_pipe", [](bool on) { return mlxterm::set_rows512_pipe(on); }, "on"_a,
        "Switch the pipelined panel decode on or off (A/B); returns the previous setting.");
  m.def("decode512", [] { return mlxterm::decode512_on(); },
        "True when decode-sized attention scores run two keys per zmm (AVX-512).");
  m.def("set_decode512", [](bool on) { return mlxterm::set_decode512(on); }, "on"_a,
        "Switch the AVX-512 decode attention scores on or off (A/B); returns the previous setting.");
  m.def("set_attn_rows", [](bool on) { return mlxterm::set_attn_rows(on); }, "on"_a,
        "Causal prompt attention per position with the decode's bits (on) or on the many-query tiles "
        "(off, A/B); returns the previous setting.");
  m.def("vnni_gemm", [] { return mlxterm::vnni_gemm_on(); },
        "True when non-exact many-row matmuls (where AMX does not take them) run on the AVX512-VNNI GEMM.");
  m.def("set_vnni_gemm", [](bool on) { return mlxterm::set_vnni_gemm(on); }, "on"_a,
        "Switch the AVX512-VNNI GEMM on or off (A/B); returns the previous setting.");
  m.def("set_shared_job", [](bool on) { return mlxterm::set_shared_job(on); }, "on"_a,
        "Hand q/k/v (gate/up) on one x to the pool as one job, or one job per matmul (A/B); returns the previous setting.");
  m.def("small_rows", [] { return mlxterm::small_rows_on(); },
        "True when int8 matmuls of 2..8 rows on AVX2 may run on the few-row path (decode in registers).");
  m.def("set_small_rows", [](bool on) { return mlxterm::set_small_rows(on); }, "on"_a,
        "Switch the AVX2 few-row path on or off (A/B); returns the previous setting.");
  m.def("rows4", [] { return mlxterm::rows4_on(); },
        "True when one-row 4-bit int8 matmuls (even block count) run row by row (row1_rows4).");
  m.def("set_rows4", [](bool on) { return mlxterm::set_rows4(on); }, "on"_a,
        "Switch the row-by-row one-row 4-bit path on or off (A/B: off is row1_direct4); returns the previous setting.");
  m.def("x16", [] { return mlxterm::x16_on(); },
        "True when quantized matmuls' int8 paths prepare 16-bit activations (two int8 parts).");
  m.def("set_x16", [](bool on) { return mlxterm::set_x16(on); }, "on"_a,
        "Switch 16-bit activations on or off; returns the previous setting.");
  m.def("qmm_path", [](int rows) { return std::string(mlxterm::qmm_path(rows)); }, "rows"_a,
        "The path a non-exact quantized matmul of this many rows takes now.");
}
