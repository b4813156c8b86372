#include "ops.h"
#include "q6k.h"

#include <algorithm>
#include <cstring>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/utils.h"
#include "pool.h"
#include "qmm.h"

namespace mlxterm {

void set_scales(QmmProblem& p, const mx::array& scales, const mx::array& biases) {
  p.scales = p.biases = nullptr;
  p.scales16 = p.biases16 = nullptr;
  p.kscales = nullptr;
  if (scales.dtype() == mx::uint8) {
    p.kscales = scales.data<uint8_t>();
  } else if (scales.dtype() == mx::float16) {
    p.scales16 = scales.data<uint16_t>();
    p.biases16 = biases.data<uint16_t>();
  } else {
    p.scales = scales.data<float>();
    p.biases = biases.data<float>();
  }
}

void check_scales(const mx::array& scales, const mx::array& biases, int N, int K, int group_size,
                  const std::string& where) {
  if (scales.ndim() != 2 || biases.ndim() != 2 || scales.shape(0) != N || biases.shape() != scales.shape())
    throw std::invalid_argument(where + "scales/biases must be 2-D, (N, ...), of one shape.");
  if (scales.dtype() == mx::uint8) {
    if (group_size != 32 || K % 256 != 0 || scales.shape(1) != K / 256 * kKScaleBytes ||
        biases.dtype() != mx::uint8)
      throw std::invalid_argument(where + "K-quant scales (uint8) must be (N, K / 256 * " +
                                  std::to_string(kKScaleBytes) + ") for group_size 32, both arrays.");
    return;
  }
  if (scales.shape(1) * group_size != K)
    throw std::invalid_argument(where + "scales/biases must be (N, K / group_size).");
}

QmmProblem qmm_problem(const mx::array& x, const mx::array& w, const mx::array& scales,
                       const mx::array& biases, int group_size, int bits, float* out) {
  QmmProblem p;
  p.x = x.data<float>();
  p.K = x.shape(-1);
  p.M = int(x.size() / p.K);
  p.N = w.shape(0);
  p.w = w.data<uint8_t>();
  set_scales(p, scales, biases);
  p.group_size = group_size;
  p.bits = bits;
  p.out = out;
  return p;
}

namespace {
// configure()'s instruction-set request ("" = the best the CPU has) and whether best_isa()
// has fixed the choice already.
std::string& isa_request() {
  static std::string want;
  return want;
}
std::atomic<bool> isa_fixed{false};
}  // namespace

void configure(const std::string& isa) {
  if (isa != "" && isa != "avx2" && isa != "avxvnni" && isa != "avx512vnni")
    throw std::invalid_argument("[mlxterm.configure] isa must be avx2, avxvnni, avx512vnni or empty, not " + isa);
  if (isa_fixed.load() && isa != isa_request())
    throw std::runtime_error("[mlxterm.configure] the instruction set is fixed by the first kernel call");
  isa_request() = isa;
}

Isa best_isa() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    isa_fixed.store(true);
    // configure(isa="avx2"|"avxvnni") narrows the choice (tests run every path on one CPU).
    const std::string& want = isa_request();
    if (want == "avx2") return Isa::avx2;
    if (want == "avxvnni" && __builtin_cpu_supports("avxvnni")) return Isa::avxvnni;
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl"))
      return Isa::avx512vnni;
    if (__builtin_cpu_supports("avxvnni")) return Isa::avxvnni;
    return Isa::avx2;
  }();
  return isa;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512vnni: return "avx2+avx512vnni";
    case Isa::avxvnni: return "avx2+avxvnni";
    default: return "avx2";
  }
}

QmmProblem f32_scales(const QmmProblem& p, std::vector<float>& buf) {
  if (!p.scales16 && !p.kscales) return p;
  const int ng = p.K / p.group_size;
  const size_t n = size_t(p.N) * ng;
  buf.resize(2 * n);
  if (p.kscales) {
    const int ns = p.K / 256;
    for (int r = 0; r < p.N; ++r) {
      for (int sb = 0; sb < ns; ++sb) {
        const uint8_t* rec = p.kscales + (size_t(r) * ns + sb) * kKScaleBytes;
        uint16_t h[2];
        std::memcpy(h, rec, 4);
        const float d = _cvtsh_ss(h[0]), dmin = _cvtsh_ss(h[1]);
        for (int j = 0; j < 8; ++j) {
          const size_t i = size_t(r) * ng + sb * 8 + j;
          buf[i] = d * float(rec[4 + j]);
          buf[n + i] = -(dmin * float(rec[12 + j]));
        }
      }
    }
  } else if (p.symmetric) {  // the biases are -2^(bits-1) * scale exactly, and never read
    const float zp = -float(1 << (p.bits - 1));
    for (size_t i = 0; i < n; ++i) {
      buf[i] = _cvtsh_ss(p.scales16[i]);
      buf[n + i] = zp * buf[i];
    }
  } else {
    for (size_t i = 0; i < n; ++i) {
      buf[i] = _cvtsh_ss(p.scales16[i]);
      buf[n + i] = _cvtsh_ss(p.biases16[i]);
    }
  }
  QmmProblem q = p;
  q.scales = buf.data();
  q.biases = buf.data() + n;
  q.scales16 = q.biases16 = nullptr;
  q.kscales = nullptr;
  return q;
}

namespace {

// Every primitive of this extension (names "Mlxterm...") allocates its outputs row contiguous
// (or, kv_write_rows, shares a row-contiguous buffer), so an output of one not yet evaluated
// (the decoder layers' chain, attention's q/k/v and output) needs no Contiguous node either.
bool produced_row_contiguous(const mx::array& a) {
  return a.has_primitive() && std::strncmp(a.primitive().name(), "Mlxterm", 7) == 0;
}

}  // namespace

mx::Stream cpu_stream(mx::StreamOrDevice s, const char* op) {
  auto st = mx::to_stream(s);
  if (st.device != mx::Device::cpu)
    throw std::invalid_argument(std::string("[mlxterm.") + op + "] runs on the CPU stream only.");
  return st;
}

void gpu_unsupported() {
  throw std::runtime_error("[mlxterm] the CPU kernels have no GPU implementation.");
}

mx::array contiguous_in(const mx::array& a, mx::Stream st) {
  if (a.is_available() ? a.flags().row_contiguous : produced_row_contiguous(a)) return a;
  return mx::contiguous(a, false, st);
}

mx::array qmm_scales(const mx::array& a, const mx::array& other, mx::Stream st) {
  if (a.dtype() == mx::float16 && other.dtype() == mx::float16) return contiguous_in(a, st);
  if (a.dtype() == mx::uint8) return contiguous_in(a, st);  // K-quant scales (check_scales)
  return contiguous_in(a.dtype() == mx::float32 ? a : mx::astype(a, mx::float32, st), st);
}

namespace {

// One 32-block of activations into v, and its largest magnitude.
inline float load_block_absmax(const float* xb, __m256 v[4]) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps();
  for (int t = 0; t < 4; ++t) {
    v[t] = _mm256_loadu_ps(xb + 8 * t);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[t]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// One 32-block of 16-bit activations: q16 = round(x / d), d = amax / 16256, split as
// q16 = 128 * hi + lo (hi in [-127, 127], lo in [-64, 63]: int8 for the int8 kernels, and never
// -128, which AVX2's sign trick could not negate). Returns d * sum(q16) (the affine bias's sum).
inline float quantize16(const float* xb, int8_t* hi, int8_t* lo, float& d_out) {
  __m256 v[4];
  const float a = load_block_absmax(xb, v);
  const float d = a / 16256.0f;
  const __m256 inv = _mm256_set1_ps(a > 0.0f ? 16256.0f / a : 0.0f);
  __m256i qh[4], ql[4], sum = _mm256_setzero_si256();
  for (int t = 0; t < 4; ++t) {
    const __m256i q16 = _mm256_cvtps_epi32(_mm256_mul_ps(v[t], inv));
    qh[t] = _mm256_srai_epi32(_mm256_add_epi32(q16, _mm256_set1_epi32(64)), 7);  // floor((q + 64) / 128)
    ql[t] = _mm256_sub_epi32(q16, _mm256_slli_epi32(qh[t], 7));
    sum = _mm256_add_epi32(sum, q16);
  }
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // packs interleave 128-bit lanes
  const __m256i ph = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(qh[0], qh[1]), _mm256_packs_epi32(qh[2], qh[3])), order);
  const __m256i pl = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(ql[0], ql[1]), _mm256_packs_epi32(ql[2], ql[3])), order);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), ph);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), pl);
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  d_out = d;
  return d * float(_mm_cvtsi128_si32(s4));
}

// Rows [m0, m1) of prepare_x into out (already sized): each row on its own, so row ranges can
// run on different threads with the same bits.
void prepare_rows(const QmmProblem& p, bool quantize, PreparedX& out, int m0, int m1) {
  const int K = p.K, nb = K / 32, ng = K / p.group_size;
  std::vector<float> bsum;
  for (int m = m0; m < m1; ++m) {
    const float* xr = p.x + size_t(m) * K;
    for (int g = 0; g < ng && !quantize; ++g) {
      const float* xg = xr + size_t(g) * p.group_size;
      __m256 s = _mm256_setzero_ps();
      for (int t = 0; t < p.group_size; t += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(xg + t));
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      h = _mm_add_ss(h, _mm_movehdup_ps(h));
      out.gsum[size_t(m) * ng + g] = _mm_cvtss_f32(h);
    }
    if (!quantize) continue;
    bsum.resize(nb);
    for (int b = 0; b < nb && out.x16; ++b) bsum[b] = quantize16(xr + size_t(b) * 32,
        out.q.data() + size_t(m) * K + size_t(b) * 32, out.lo.data() + size_t(m) * K + size_t(b) * 32,
        out.d[size_t(m) * nb + b]);
    for (int b = 0; b < nb && !out.x16; ++b) {
      __m256 v[4];
      const float a = load_block_absmax(xr + size_t(b) * 32, v);
      const float d = a / 127.0f;
      const __m256 inv = _mm256_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
      __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], inv));
      __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], inv));
      __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], inv));
      __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], inv));
      // packs interleave 128-bit lanes; the permute restores element order.
      __m256i s01 = _mm256_packs_epi32(i0, i1);
      __m256i s23 = _mm256_packs_epi32(i2, i3);
      __m256i q = _mm256_packs_epi16(s01, s23);
      q = _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + size_t(m) * K + size_t(b) * 32), q);
      out.d[size_t(m) * nb + b] = d;
      // The affine biases multiply the sum of the *quantized* activations, so that the
      // scale and bias parts (which largely cancel) see the same x (as llama.cpp's Q8_1).
      __m256i s16 = _mm256_madd_epi16(_mm256_add_epi16(s01, s23), _mm256_set1_epi16(1));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s16), _mm256_extracti128_si256(s16, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      bsum[b] = d * float(_mm_cvtsi128_si32(s4));
    }
    for (int g = 0; g < ng; ++g) {
      float t = 0.0f;
      for (int j = 0; j < p.group_size / 32; ++j) t += bsum[g * (p.group_size / 32) + j];
      out.gsum[size_t(m) * ng + g] = t;
    }
  }
}

}  // namespace

// Sizes out for M rows (and the zero rows up to `rows` of q and lo: AMX's padding) and fixes
// its activation format for prepare_rows: 16-bit when x16_on() now, unless the caller's kernel
// takes int8 only (allow16 = false: AMX).
void size_x(const QmmProblem& p, bool quantize, PreparedX& out, size_t rows, bool allow16 = true) {
  const int K = p.K, nb = K / 32, ng = K / p.group_size;
  out.gsum.resize(size_t(p.M) * ng);
  out.x16 = quantize && allow16 && x16_on();
  if (quantize) {
    out.q.resize(rows * K);
    out.d.resize(size_t(p.M) * nb);
    std::fill(out.q.begin() + size_t(p.M) * K, out.q.end(), int8_t(0));
    if (out.x16) {
      out.lo.resize(rows * K);
      std::fill(out.lo.begin() + size_t(p.M) * K, out.lo.end(), int8_t(0));
    }
  }
}

void prepare_x(const QmmProblem& p, bool quantize, PreparedX& out) {
  size_x(p, quantize, out, size_t(p.M));
  prepare_rows(p, quantize, out, 0, p.M);
}

namespace {

using Kernel = void (*)(const QmmProblem&, const XView&, int, int);

std::atomic<bool>& rows512_switch() {
  static std::atomic<bool> on{true};
  return on;
}

std::atomic<bool>& rows512_pipe_switch() {
  static std::atomic<bool> on{true};
  return on;
}

// Rows from which the row path runs on the VNNI GEMM's 16-column zmm tiles.
constexpr int kRows512Min = 2;

// The AVX512-VNNI row path's columns: 2..15 rows (a batch's decode step) on the VNNI GEMM's
// register tiles (qmm_gemm512.cpp: 16 weight rows per zmm, 8 `vpdpbusd` per activation row and
// block for 16 outputs instead of 8), one row on the 8-column path (its direct decode). Same
// bits: the GEMM runs group_rows' arithmetic per output. Why: on Sapphire Rapids a zmm
// `vpdpbusd` does twice a ymm one's work per cycle; on Zen 4 it is double-pumped (the same).
void int8_columns_512(const QmmProblem& p, const XView& x, int n0, int n1) {
  if (p.M >= kRows512Min && rows512_switch().load(std::memory_order_relaxed)) gemm512::qmm_gemm(p, x, n0, n1);
  else avx512vnni::qmm_int8(p, x, n0, n1);
}

Kernel pick(bool exact) {
  switch (best_isa()) {
    case Isa::avx512vnni: return exact ? avx512vnni::qmm_exact : int8_columns_512;
    case Isa::avxvnni: return exact ? avxvnni::qmm_exact : avxvnni::qmm_int8;
    default: return exact ? avx2::qmm_exact : avx2::qmm_int8;
  }
}

using DenseKernel = void (*)(const QmmProblem&, float*, int, int);

DenseKernel pick_dense() {
  switch (best_isa()) {
    case Isa::avx512vnni: return avx512vnni::qmm_dense;
    case Isa::avxvnni: return avxvnni::qmm_dense;
    default: return avx2::qmm_dense;
  }
}

// Rows at which non-exact matmuls leave the int8 row path for the many-row paths.
constexpr int kDenseMinRows = 16;
int dense_min_rows() { return kDenseMinRows; }

// The CPU has AMX-TILE and AMX-INT8 (CPUID.(7,0):EDX bits 24, 25) and Linux granted this
// process the tile data state: since 5.16 a process must ask once (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA) before any thread touches the tiles, else the first tile load faults.
// The grant covers every thread of the process, the pool's included.
bool amx_capable() {
  static const bool ok = [] {
    if (best_isa() != Isa::avx512vnni) return false;  // configure(isa=...) narrows AMX away too
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 24)) || !(d & (1u << 25))) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

std::atomic<bool>& amx_switch() {
  static std::atomic<bool> on{true};
  return on;
}

// Rows from which non-exact matmuls run on AMX tiles (set_amx_min_rows; the qmm bench lowers it).
std::atomic<int>& amx_rows_setting() {
  static std::atomic<int> m{16};
  return m;
}
int amx_rows() { return amx_rows_setting().load(std::memory_order_relaxed); }

// The int8 many-row paths' output columns: chunks of whole 16-column panels, about four per
// pool thread (a busy core takes fewer).
int panel_chunk(const QmmProblem& p) {
  const int T = Pool::get().threads();
  const int chunk = (p.N + 4 * T - 1) / (4 * T);
  return std::max(16, (chunk + 15) & ~15);
}

// Problems ps[0..n)'s panel chunks in one pool job, each run as fn(i, n0, n1): q/k/v (and
// gate/up) on one x hand the pool one job instead of three (two), so no thread waits at the
// end of q for the slowest chunk before k starts. Each output's chunk is computed alone, so
// the same bits as one job per problem.
std::atomic<bool>& shared_job_switch() {
  static std::atomic<bool> on{true};
  return on;
}

void run_panel_chunks(const QmmProblem* ps, int n, const std::function<void(int, int, int)>& fn) {
  if (n > 1 && !shared_job_on()) {
    for (int i = 0; i < n; ++i) run_panel_chunks(ps + i, 1, [&](int, int n0, int n1) { fn(i, n0, n1); });
    return;
  }
  std::vector<int> first(n), size(n);
  int total = 0;
  for (int i = 0; i < n; ++i) {
    size[i] = panel_chunk(ps[i]);
    first[i] = total;
    total += (ps[i].N + size[i] - 1) / size[i];
  }
  Pool::get().run(total, [&](int c) {
    int i = n - 1;
    while (c < first[i]) --i;
    const int n0 = (c - first[i]) * size[i];
    fn(i, n0, std::min(ps[i].N, n0 + size[i]));
  });
}

// Many rows on AMX tiles: the row path's int8 activations (prepare_x), padded with zero rows to
// whole 16-row tiles, and the activation scales tile by tile (16 rows of a block side by side:
// the tile's float chain reads one block's 16 from one place).
void prepare_amx(const QmmProblem& p, PreparedX& x, std::vector<float>& dt) {
  Pool& pool = Pool::get();
  const size_t rows = size_t(p.M + 15) & ~size_t(15);
  const int nb = p.K / 32;
  size_x(p, true, x, rows, false);  // zero padding rows; int8 (rows_path sends x16 elsewhere)
  dt.assign(rows * nb, 0.0f);
  // Quantizing the activations on all threads too: on one it was ~30% of a prefill layer's
  // matmul time (the tiles made the rest that much faster).
  float* const dtp = dt.data();
  constexpr int kRowChunk = 32;
  pool.run((p.M + kRowChunk - 1) / kRowChunk, [&](int c) {
    const int m0 = c * kRowChunk, m1 = std::min(p.M, m0 + kRowChunk);
    prepare_rows(p, true, x, m0, m1);
    for (int m = m0; m < m1; ++m)
      for (int b = 0; b < nb; ++b) dtp[size_t(m / 16) * nb * 16 + size_t(b) * 16 + m % 16] = x.d[size_t(m) * nb + b];
  });
}

// Many rows on the AVX512-VNNI GEMM (or the AVX2 / AVX-VNNI row path): the row path's int8 activations, quantized on all threads,
// each row on its own (so the same bits).
void prepare_gemm512(const QmmProblem& p, PreparedX& x) {
  size_x(p, true, x, size_t(p.M));
  constexpr int kRowChunk = 32;
  Pool::get().run((p.M + kRowChunk - 1) / kRowChunk, [&](int c) {
    const int m0 = c * kRowChunk;
    prepare_rows(p, true, x, m0, std::min(p.M, m0 + kRowChunk));
  });
}

std::atomic<bool>& x16_switch() {
  static std::atomic<bool> on{false};
  return on;
}

std::atomic<bool>& small_rows_switch() {
  static std::atomic<bool> on{true};
  return on;
}

std::atomic<bool>& rows4_switch() {
  static std::atomic<bool> on{true};
  return on;
}

std::atomic<bool>& vnni_gemm_switch() {
  static std::atomic<bool> on{true};
  return on;
}

bool vnni_gemm_active() {
  return best_isa() == Isa::avx512vnni && vnni_gemm_switch().load(std::memory_order_relaxed);
}

// Where a non-exact matmul of `rows` rows runs (qmm_path names it): the one decision run_qmm
// and the status report share.
enum class RowsPath { amx, vnni512, float_panels, int8_rows, int8_many, int8_small };

RowsPath rows_path(int rows) {
  // AMX tiles run int8 activations only (16-bit ones go to the VNNI GEMM, the same bits as rows).
  if (rows >= amx_rows() && amx_on() && !x16_on()) return RowsPath::amx;
  if (rows < dense_min_rows()) {
    // The few-row path runs inside the AVX2 row kernel (int8 activations only).
    const bool small = best_isa() == Isa::avx2 && rows >= 2 && rows <= kSmallRowsMax && small_rows_on() && !x16_on();
    return small ? RowsPath::int8_small : RowsPath::int8_rows;
  }
  if (vnni_gemm_active()) return RowsPath::vnni512;
  // AVX2 / AVX-VNNI: the decode row path over every row (a weight group decoded once for all
  // rows), so a prompt forward writes the K/V a decode would, bit for bit (issue 30, item 4);
  // set_vnni_gemm(false) sends these to the float panels too (A/B).
  if (best_isa() != Isa::avx512vnni && vnni_gemm_switch().load(std::memory_order_relaxed))
    return RowsPath::int8_many;
  return RowsPath::float_panels;
}

// The int8 many-row paths (AMX tiles, VNNI GEMM, the AVX2 / AVX-VNNI row path) for n problems on the same x (same M, K and
// group size): x quantized once, then each problem's chunks of whole 16-column panels. The
// kernels read x only, so each output is what its problem alone would give.
void run_qmm_shared(const QmmProblem* ps, int n, RowsPath path) {
  thread_local PreparedX x;
  thread_local std::vector<float> dt;
  // (Through plain references: a lambda does not capture thread_locals, a worker running it
  // would see its own.)
  PreparedX& xs = x;
  if (path == RowsPath::amx) {
    prepare_amx(ps[0], xs, dt);
    const XView xv{xs.q.data(), dt.data(), xs.gsum.data()};
    run_panel_chunks(ps, n, [&](int i, int n0, int n1) { amx::qmm_amx(ps[i], xv, n0, n1); });
    return;
  }
  prepare_gemm512(ps[0], xs);
  const XView xv = x_view(xs);
  if (path == RowsPath::int8_many) {
    const Kernel k = pick(false);
    run_panel_chunks(ps, n, [&](int i, int n0, int n1) { k(ps[i], xv, n0, n1); });
    return;
  }
  run_panel_chunks(ps, n, [&](int i, int n0, int n1) { gemm512::qmm_gemm(ps[i], xv, n0, n1); });
}

bool int8_many_path(RowsPath path) {
  return path == RowsPath::amx || path == RowsPath::vnni512 || path == RowsPath::int8_many;
}

void run_qmm(const QmmProblem& p0, bool exact) {
  if (p0.bits == kQ6KBits) {  // GGUF Q6_K blocks: their own kernel (int8 or 16-bit activations, q6k.h)
    q6k_run(p0.x, p0.w, p0.M, p0.K, p0.N, p0.out);
    return;
  }
  const RowsPath path = exact ? RowsPath::float_panels : rows_path(p0.M);
  if (int8_many_path(path)) {
    run_qmm_shared(&p0, 1, path);  // float16 scales read as such, as the row path does
    return;
  }
  Pool& pool = Pool::get();
  // float16 scales are read as such by the int8 decode path only.
  thread_local std::vector<float> wide;
  const QmmProblem p = (exact || p0.M >= dense_min_rows()) ? f32_scales(p0, wide) : p0;
  const int T = pool.threads();
  if (p.M >= dense_min_rows()) {
    // Prefill: float panels (float activations, so "exact" as well).
    DenseKernel k = pick_dense();
    // Few, wide chunks: each one reuses a K-slice of x across all its panels.
    int chunk = (p.N + 2 * T - 1) / (2 * T);
    chunk = std::max(32, (chunk + 31) & ~31);  // whole 32-column panels (AVX-512)
    const int n_chunks = (p.N + chunk - 1) / chunk;
    pool.run(n_chunks, [&](int c) {
      thread_local std::vector<float> scratch;
      scratch.resize(size_t(2) * 32 * 256);  // decoded rows + panel: kPanel (<= 32) x kKc
      int n0 = c * chunk, n1 = std::min(p.N, n0 + chunk);
      k(p, scratch.data(), n0, n1);
    });
    return;
  }
  thread_local PreparedX x;
  prepare_x(p, !exact, x);
  Kernel k = pick(exact);
  const XView xv = x_view(x);
  const int chunk = qmm_chunk_cols(p.N, p.M);
  const int n_chunks = (p.N + chunk - 1) / chunk;
  pool.run(n_chunks, [&](int c) {
    int n0 = c * chunk, n1 = std::min(p.N, n0 + chunk);
    k(p, xv, n0, n1);
  });
}

}  // namespace

void QuantizedMatmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& x = inputs[0];
  auto& w = inputs[1];
  auto& scales = inputs[2];
  auto& biases = inputs[3];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(x);
  enc.set_input_array(w);
  enc.set_input_array(scales);
  enc.set_input_array(biases);
  enc.set_output_array(out);
  QmmProblem p = qmm_problem(x, w, scales, biases, group_size_, bits_, out.data<float>());
  p.symmetric = symmetric_;
  bool exact = exact_;
  enc.dispatch([p, exact]() { run_qmm(p, exact); });
}

void QuantizedMatmul::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[mlxterm] the CPU kernels have no GPU implementation.");
}

std::vector<mx::Shape> QuantizedMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = inputs[0].shape();
  shape.back() = inputs[1].shape(0);
  return {shape};
}

bool QuantizedMatmul::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const QuantizedMatmul&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && exact_ == o.exact_ && symmetric_ == o.symmetric_;
}

mx::array quantized_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    bool exact,
    bool symmetric,
    mx::StreamOrDevice s) {
  if (bits != 4 && bits != 5 && bits != 8)
    throw std::invalid_argument("[mlxterm.quantized_matmul] bits must be 4, 5 or 8.");
  if (group_size != 32 && group_size != 64 && group_size != 128)
    throw std::invalid_argument("[mlxterm.quantized_matmul] group_size must be 32, 64 or 128.");
  if (x.ndim() < 1 || w.ndim() != 2 || scales.ndim() != 2 || biases.ndim() != 2)
    throw std::invalid_argument("[mlxterm.quantized_matmul] x must be (..., K), w/scales/biases 2-D.");
  const int K = x.shape(-1), N = w.shape(0);
  if (w.dtype() != mx::uint32 || int64_t(w.shape(1)) * 32 != int64_t(K) * bits)
    throw std::invalid_argument("[mlxterm.quantized_matmul] w must be uint32 (N, K * bits / 32).");
  check_scales(scales, biases, N, K, group_size, "[mlxterm.quantized_matmul] ");
  auto st = mx::to_stream(s);
  if (st.device != mx::Device::cpu)
    throw std::invalid_argument("[mlxterm.quantized_matmul] runs on the CPU stream only.");
  auto f32 = [&](const mx::array& a) {
    return contiguous_in(a.dtype() == mx::float32 ? a : mx::astype(a, mx::float32, st), st);
  };
  std::vector<mx::array> inputs = {f32(x), contiguous_in(w, st), qmm_scales(scales, biases, st),
                                   qmm_scales(biases, scales, st)};
  auto shape = x.shape();
  shape.back() = N;
  return mx::array(
      shape, mx::float32, std::make_shared<QuantizedMatmul>(st, group_size, bits, exact, symmetric), inputs);
}

}  // namespace mlxterm

namespace mlxterm {
void qmm_run(const QmmProblem& p, bool exact) { run_qmm(p, exact); }
void qmm_run_shared_x(const QmmProblem* ps, int n) {
  const RowsPath path = rows_path(ps[0].M);
  bool shared = int8_many_path(path);
  for (int i = 1; i < n; ++i)
    shared = shared && ps[i].x == ps[0].x && ps[i].M == ps[0].M && ps[i].K == ps[0].K &&
             ps[i].group_size == ps[0].group_size;
  if (shared) {
    run_qmm_shared(ps, n, path);
    return;
  }
  for (int i = 0; i < n; ++i) run_qmm(ps[i], false);
}
QmmColumns qmm_columns(bool exact) { return pick(exact); }
int qmm_dense_min_rows() { return dense_min_rows(); }
int qmm_chunk_cols(int n, int rows) {
  // Enough chunks that a core busy elsewhere just takes fewer, few enough that each one
  // amortises the hand-off; whole 8-row weight groups for one row, whole 16-column panels for
  // the few-row path's tiles (SmolLM2's 576 columns on 2 threads were 36-column chunks: 4.5
  // groups decoded as 5).
  const int T = Pool::get().threads();
  const int chunk = (n + T * 8 - 1) / (T * 8);
  const int unit = rows >= 2 ? 16 : 8;
  return std::max(16, (chunk + unit - 1) / unit * unit);
}
bool amx_on() { return amx_capable() && amx_switch().load(std::memory_order_relaxed); }
bool set_amx(bool on) { return amx_switch().exchange(on); }
int set_amx_min_rows(int rows) { return amx_rows_setting().exchange(std::max(2, rows)); }
bool rows512_on() { return best_isa() == Isa::avx512vnni && rows512_switch().load(std::memory_order_relaxed); }
bool set_rows512(bool on) { return rows512_switch().exchange(on); }
bool rows512_pipe_on() { return rows512_pipe_switch().load(std::memory_order_relaxed); }
bool set_rows512_pipe(bool on) { return rows512_pipe_switch().exchange(on); }
bool vnni_gemm_on() { return vnni_gemm_active(); }
bool set_vnni_gemm(bool on) { return vnni_gemm_switch().exchange(on); }
bool shared_job_on() { return shared_job_switch().load(std::memory_order_relaxed); }
bool set_shared_job(bool on) { return shared_job_switch().exchange(on); }
bool small_rows_on() { return small_rows_switch().load(std::memory_order_relaxed); }
bool set_small_rows(bool on) { return small_rows_switch().exchange(on); }
bool rows4_on() { return rows4_switch().load(std::memory_order_relaxed); }
bool set_rows4(bool on) { return rows4_switch().exchange(on); }
bool x16_on() { return x16_switch().load(std::memory_order_relaxed); }
bool set_x16(bool on) { return x16_switch().exchange(on); }
const char* qmm_path(int rows) {
  switch (rows_path(rows)) {
    case RowsPath::amx: return "amx";
    case RowsPath::vnni512: return "vnni512";
    case RowsPath::float_panels: return "float panels";
    case RowsPath::int8_many: return "int8 many rows";
    case RowsPath::int8_small: return "int8 few rows";
    default: return "int8 rows";
  }
}
}  // namespace mlxterm
