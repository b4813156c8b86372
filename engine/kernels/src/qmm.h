// Quantized matmul on MLX affine-packed weights: out[m, n] = sum_k x[m, k] * w[n, k], with
// w[n, k] = scales[n, g] * q[n, k] + biases[n, g] for g = k / group_size.
// q is packed as mx.quantize packs it: a little-endian bit stream, value i of a row at bit
// i * bits (bits 4, 5 or 8).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mlxterm {

struct QmmProblem {
  const float* x;  // (M, K) row-major
  int M, K, N;
  const uint8_t* w;  // (N, K * bits / 8)
  const float* scales;  // (N, K / group_size), or null when scales16 is set
  const float* biases;  // (N, K / group_size), or null when biases16 is set
  int group_size, bits;
  float* out;  // (M, N)
  // float16 scales/biases (both or neither): a GGUF Q4_0/Q4_1/Q8_0's own d and m are float16,
  // so a copy in float16 is exact and the decode path reads 20 bytes per 32 4-bit weights
  // instead of 24 (decode streams the weights: bytes are time). Only the int8 path's
  // pack_group reads them as such; the other paths widen them first (f32_scales).
  const uint16_t* scales16 = nullptr;
  const uint16_t* biases16 = nullptr;
  // The biases are exactly -2^(bits-1) * scales (GGUF Q8_0/Q4_0/Q5_0 hold a scale only): the
  // int8 path's pack_group then makes the bias terms from the scales and never reads the
  // biases (2 of a Q8_0 block's 36 bytes; the same numbers, so the same bits).
  bool symmetric = false;
  // A GGUF K-quant's scales in their own compact form (group 32, K a multiple of 256): per
  // row, per 256-value super-block, kKScaleBytes bytes [d f16][dmin f16][sc 8 x u8][m 8 x u8]
  // with scale = d * sc and bias = -(dmin * m) -- exact in float32 (an 11-bit by 6-bit product),
  // so the float32 arrays' values, in 2.5 bytes per 32 weights instead of 8 (Q4_K: 18.5 bytes
  // per 32 4-bit weights instead of 24; the GGUF has 18). scales/biases/scales16 are then null;
  // f32_scales widens them for the paths that read float32.
  const uint8_t* kscales = nullptr;
};

// Bytes of one 256-value super-block's scales in QmmProblem::kscales.
constexpr int kKScaleBytes = 20;

// p with float32 scales/biases: p itself, or widened into buf when p has float16 or
// K-quant (kscales) ones.
QmmProblem f32_scales(const QmmProblem& p, std::vector<float>& buf);

// Activations prepared once per matmul: int8 per 32-block with a scale (fast mode) and the
// exact float sum of every weight group (for the affine biases), shared by all ISAs.
struct PreparedX {
  std::vector<int8_t> q;  // (M, K)
  std::vector<float> d;  // (M, K / 32)
  std::vector<float> gsum;  // (M, K / group_size)
  // 16-bit activations (x16_on() when prepared): x / d rounds to q16 in [-16256, 16256],
  // d = amax / 16256, split as q16 = 128 * q + lo with q in [-127, 127], lo in [-64, 63].
  std::vector<int8_t> lo;  // (M, K); empty for int8 activations
  bool x16 = false;
};

void prepare_x(const QmmProblem& p, bool quantize, PreparedX& out);

// Raw view of PreparedX for the per-ISA kernels (they use no library code, so nothing built
// with wider instructions can be shared with the rest of the module).
struct XView {
  const int8_t* q;
  const float* d;
  const float* gsum;
  const int8_t* lo = nullptr;  // the low parts of 16-bit activations (PreparedX), else null
};

// The view of x as prepared (lo set for 16-bit activations); d: the scales as the kernel reads them.
inline XView x_view(const PreparedX& x, const float* d) {
  return XView{x.q.data(), d, x.gsum.data(), x.x16 ? x.lo.data() : nullptr};
}
inline XView x_view(const PreparedX& x) { return x_view(x, x.d.data()); }

// Whether quantized matmuls with int8 paths prepare 16-bit activations (set_x16,
// off by default): two integer dot products per block instead of one, no activation rounding error
// to speak of. The float panels and exact matmuls do not change.
bool x16_on();
bool set_x16(bool on);

// Output columns [n0, n1) for all M rows. One function per instruction set; each output
// element is computed by the same instruction sequence whatever the split.
#define QMM_DECLARE_ISA(ns)                                                        \
  namespace ns {                                                                       \
  void qmm_int8(const QmmProblem& p, const XView& x, int n0, int n1);             \
  void qmm_exact(const QmmProblem& p, const XView& x, int n0, int n1);            \
  void qmm_dense(const QmmProblem& p, float* scratch, int n0, int n1);              \
  }
QMM_DECLARE_ISA(avx2)
QMM_DECLARE_ISA(avxvnni)
QMM_DECLARE_ISA(avx512vnni)

// The many-row path on AMX-INT8 tiles (qmm_amx.cpp), output columns [n0, n1) for all M rows,
// the row path's bits. x as prepare_x makes it, but q padded with zero rows to whole 16-row
// tiles and d laid out tile by tile: d[(m / 16) * nb * 16 + blk * 16 + m % 16].
namespace amx {
void qmm_amx(const QmmProblem& p, const XView& x, int n0, int n1);
}

// The many-row path on AVX512-VNNI register tiles (qmm_gemm512.cpp) for CPUs without AMX (or
// with it switched off): output columns [n0, n1) for all M rows, the row path's bits; x exactly
// as prepare_x makes it.
namespace gemm512 {
void qmm_gemm(const QmmProblem& p, const XView& x, int n0, int n1);
}

enum class Isa { avx2 = 0, avxvnni = 1, avx512vnni = 2 };
Isa best_isa();
const char* isa_name(Isa isa);

}  // namespace mlxterm

namespace mlxterm {
// For fused primitives built on the quantized matmul (fused.cpp): the whole matmul as
// QuantizedMatmul runs it, and the kernel for output columns [n0, n1) of the int8/exact path.
using QmmColumns = void (*)(const QmmProblem&, const XView&, int, int);
void qmm_run(const QmmProblem& p, bool exact);
// n non-exact matmuls of the same x (same rows, K and group size: a layer's q/k/v or gate/up),
// as n qmm_run calls give them, but on the int8 many-row paths x is quantized once for all and
// the n matmuls' column chunks go to the pool as one job.
void qmm_run_shared_x(const QmmProblem* ps, int n);
QmmColumns qmm_columns(bool exact);
int qmm_dense_min_rows();
// Output columns per pool chunk of the int8 row path for n columns and `rows` activation rows
// (run_qmm, the SwiGLU and the decoder primitives cut alike; the split changes no result).
int qmm_chunk_cols(int n, int rows);
// AMX-INT8 usable in this process: the CPU has it, the OS granted the tile state
// (arch_prctl), best_isa() is avx512vnni and it is switched on (set_amx).
bool amx_on();
// Turn the AMX path on or off at run time (A/B in one process); returns the old setting.
// Has no effect on a machine without AMX.
bool set_amx(bool on);
// Rows from which AMX takes a non-exact matmul (default 16, at least 2); returns the old value.
int set_amx_min_rows(int rows);
// The extension's settings from Python (engine.settings), before the first kernel call: the
// instruction set ("" = the best this CPU has; "avx2" or "avxvnni" narrow it).
void configure(const std::string& isa);
// Int8 matmuls of 2..15 rows (a batch's decode step, a verify) run on the AVX512-VNNI GEMM's
// 16-column register tiles where best_isa() is avx512vnni (the same bits as the 8-column row
// path); set_rows512(false) keeps them on the row path (A/B).
bool rows512_on();
// Turn it on or off at run time; returns the old setting.
bool set_rows512(bool on);
// The 16-column tiles decode the next weight panel between a panel's block dots (the same
// values, so the same bits); set_rows512_pipe(false) decodes each
// panel whole before its dots (A/B).
bool rows512_pipe_on();
bool set_rows512_pipe(bool on);
// Non-exact matmuls of qmm_dense_min_rows() rows or more run on the AVX512-VNNI GEMM
// (qmm_gemm512.cpp) where AMX does not take them: best_isa() is avx512vnni and it is switched
// on (set_vnni_gemm(false) turns it off: the float panels run). Below avx512vnni the same
// switch runs them on the row path over every row ("int8 many rows", the decode rows' bits).
bool vnni_gemm_on();
// Turn the VNNI GEMM on or off at run time (A/B in one process); returns the old setting.
bool set_vnni_gemm(bool on);
// qmm_run_shared_x's matmuls go to the pool as one job (on by default);
// off: one job per matmul (A/B). set_shared_job returns the old setting.
bool shared_job_on();
bool set_shared_job(bool on);
// Int8 matmuls of 2..8 rows (a batch's decode step) on AVX2 without VNNI run on the few-row
// path (qmm_small_rows.inc: each weight block decoded in registers once for all rows, the
// one-row paths' bits); set_small_rows(false) sends them to the panel path (A/B).
bool small_rows_on();
bool set_small_rows(bool on);
// A one-row 4-bit matmul with an even block count runs row by row (row1_rows4: each weight row's
// block pair against x split into even and odd values) on every ISA; set_rows4(false) sends it
// to the transposing one-row path (row1_direct4, A/B). Same bits.
bool rows4_on();
bool set_rows4(bool on);
constexpr int kSmallRowsMax = 8;  // more rows go to the panel path (its decode shared by enough)
// The path a non-exact matmul of `rows` rows takes now: "amx", "vnni512", "int8 many rows",
// "float panels" or "int8 rows" (the row path, below the many-row threshold).
const char* qmm_path(int rows);
}  // namespace mlxterm
