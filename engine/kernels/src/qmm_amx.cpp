// The quantized matmul's many-row path (prefill chunks) on AMX-INT8 tiles: the int8 block dot
// products of the row path (qmm_kernel.inc's group_rows) done by `tdpbsud` 16x16 at a time,
// followed by the row path's own float chain, so every output is the row path's bit for bit.
//
// Why: at M >= 16 the int8 row path is compute-bound on its VNNI dot products and the float
// panels on fp32 FMAs; one tdpbsud does 16 x 16 x 32 exact int8 products in a few cycles, which
// leaves the per-block float chain (convert, scale, FMA) as the whole cost.
//
// Tiles (configured per call, released at its end; see tile_config):
//   tmm0, tmm1  C: 16 activation rows x 16 weight rows, int32 -- blocks blk and blk + 1
//   tmm2, tmm3  A: 16 activation rows x 32 int8 (one 32-block), straight from PreparedX.q
//   tmm4, tmm5  B: one 32-block of 16 weight rows in the VNNI layout: row t holds, for weight
//               row j = 0..15, its bytes 4t..4t+3 (pack_pair16: pack_group's 8-row panels side by side)
// The int32 block dot is exact (any summation order), so C[m][n] equals the row path's
// per-block integer; the float chain per output is then identical: acc = fma(float(dot),
// scale_w * scale_x, acc) block by block, then + the bias chain over groups.
//
// Built with AVX-512 besides -mamx-tile -mamx-int8 (every AMX CPU has it; ops.cpp dispatches
// here only when best_isa() is avx512vnni) and including qmm_kernel.inc as the avx512vnni
// build does, for its pack_group/pack_scales: the same weight bytes, scales and bias terms.
#define QMM_ISA amx
#define QMM_VNNI 2
#include "qmm_kernel.inc"

namespace mlxterm {
namespace amx {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// A constant in memory: _tile_loadconfig's asm tells the compiler it reads 8 bytes only, so a
// local would risk its other 56 being treated as dead stores.
const TileConfig kTiles = [] {
  TileConfig c;
  for (int t = 0; t < 2; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }  // C
  for (int t = 2; t < 4; ++t) { c.rows[t] = 16; c.colsb[t] = 32; }  // A
  for (int t = 4; t < 6; ++t) { c.rows[t] = 8; c.colsb[t] = 64; }  // B
  return c;
}();

// tilestored of C tile T into buf (16 x 16 int32). The header's _tile_stored clobbers all
// memory, which makes GCC keep the 16 float accumulators on the stack across it; this says
// exactly which bytes it writes.
template <int T>
inline void tile_store(int32_t* buf) {
  asm volatile("tilestored %%tmm%c[t], (%[b],%[s],1)"
               : "=m"(*reinterpret_cast<int32_t(*)[256]>(buf))
               : [t] "i"(T), [b] "r"(buf), [s] "r"(64L));
}

// One weight panel: 16 rows' blocks in the B layout, their scales and bias terms (16 per
// group), as pack_pair16 writes them.
struct Panel {
  uint8_t* w;  // nb * 512 bytes
  float* scale;  // ng * 16
  float* bias;  // ng * 16
};

// One block's C tile (in cbuf, 16 x 16 int32) into the 16 row accumulators; d: the 16 rows'
// activation scales of the block.
inline void block_chain(const int32_t* cbuf, __m512 sv, const float* d, __m512 acc[16]) {
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(cbuf + 16 * i));
    acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(sv, _mm512_set1_ps(d[i])), acc[i]);
  }
}

// Activation rows [m0, m0 + 16) against one panel: out[m, n0 + j] for m < M, j < nr.
void tile_rows(const QmmProblem& p, const XView& x, const Panel& pn, int m0, int n0, int nr) {
  const int K = p.K, nb = K / 32, ng = K / p.group_size;
  const int lg = __builtin_ctz(unsigned(p.group_size / 32));  // block -> group: a shift
  // Software-pipelined by block pairs: a pair's two tile products are issued, then the
  // previous pair's float chains run (from memory) while the tile unit works, then this pair's
  // results are stored. The chains still run in block order.
  alignas(64) int32_t cb[2][2][256];
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const int8_t* xq = x.q + size_t(m0) * K;
  const float* xd = x.d + size_t(m0) * nb;  // (nb, 16): this tile's scales block by block
  int blk = 0, cur = 0;
  for (; blk + 2 <= nb; blk += 2, cur ^= 1) {
    _tile_zero(0);
    _tile_loadd(2, xq + size_t(blk) * 32, K);
    _tile_loadd(4, pn.w + size_t(blk) * 512, 64);
    _tile_dpbsud(0, 2, 4);
    _tile_zero(1);
    _tile_loadd(3, xq + size_t(blk + 1) * 32, K);
    _tile_loadd(5, pn.w + size_t(blk + 1) * 512, 64);
    _tile_dpbsud(1, 3, 5);
    if (blk > 0) {
      block_chain(cb[cur ^ 1][0], _mm512_loadu_ps(pn.scale + ((blk - 2) >> lg) * 16), xd + (blk - 2) * 16, acc);
      block_chain(cb[cur ^ 1][1], _mm512_loadu_ps(pn.scale + ((blk - 1) >> lg) * 16), xd + (blk - 1) * 16, acc);
    }
    tile_store<0>(cb[cur][0]);
    tile_store<1>(cb[cur][1]);
  }
  if (blk > 0) {
    block_chain(cb[cur ^ 1][0], _mm512_loadu_ps(pn.scale + ((blk - 2) >> lg) * 16), xd + (blk - 2) * 16, acc);
    block_chain(cb[cur ^ 1][1], _mm512_loadu_ps(pn.scale + ((blk - 1) >> lg) * 16), xd + (blk - 1) * 16, acc);
  }
  if (blk < nb) {
    _tile_zero(0);
    _tile_loadd(2, xq + size_t(blk) * 32, K);
    _tile_loadd(4, pn.w + size_t(blk) * 512, 64);
    _tile_dpbsud(0, 2, 4);
    tile_store<0>(cb[0][0]);
    block_chain(cb[0][0], _mm512_loadu_ps(pn.scale + (blk >> lg) * 16), xd + blk * 16, acc);
  }
  const __mmask16 mask = nr >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << nr) - 1);
  const int rows = std::min(16, p.M - m0);
  // The affine biases: per row, sum over groups of bias term * sum(x of the group), in group
  // order -- 8 rows' chains side by side (one row's chain alone waits on each FMA's latency).
  const float* gs = x.gsum + size_t(m0) * ng;
  for (int h = 0; h < 16; h += 8) {
    __m512 b[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) b[i] = _mm512_setzero_ps();
    const int hr = std::min(8, rows - h);
    if (hr <= 0) break;
    for (int q = 0; q < ng; ++q) {
      const __m512 bv = _mm512_loadu_ps(pn.bias + q * 16);
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i)  // rows past M repeat the last one (never stored)
        b[i] = _mm512_fmadd_ps(bv, _mm512_set1_ps(gs[size_t(std::min(h + i, rows - 1)) * ng + q]), b[i]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i)
      if (i < hr) _mm512_mask_storeu_ps(p.out + size_t(m0 + h + i) * p.N + n0, mask, _mm512_add_ps(acc[h + i], b[i]));
  }
}

template <int BITS>
void amx_run(const QmmProblem& p, const XView& x, int n0, int n1) {
  const int nb = p.K / 32, ng = p.K / p.group_size;
  thread_local std::vector<uint8_t> pw;
  thread_local std::vector<float> pf;
  pw.resize(size_t(nb) * 512);
  pf.resize(size_t(ng) * 32);
  const Panel pn{pw.data(), pf.data(), pf.data() + size_t(ng) * 16};
  // Activation rows in slices that stay in L2 while every panel of this chunk passes over them
  // (a panel is decoded once per slice; for K <= ~2k that is once per matmul).
  const int slice = std::max(16, int((768 * 1024) / size_t(p.K)) & ~15);
  _tile_loadconfig(&kTiles);
  for (int s0 = 0; s0 < p.M; s0 += slice) {
    const int s1 = std::min(p.M, s0 + slice);
    for (int n = n0; n < n1; n += 16) {
      const int nr = std::min(16, n1 - n);
      pack_pair16<BITS>(p, n, nr, pn.w, pn.scale, pn.bias);
      asm volatile("" ::: "memory");  // the panel's stores before the tile loads that read them
      for (int m = s0; m < s1; m += 16) tile_rows(p, x, pn, m, n, nr);
    }
  }
  _tile_release();
}

}  // namespace

// x: see qmm.h (q padded to whole 16-row tiles, d tile by tile).
void qmm_amx(const QmmProblem& p, const XView& x, int n0, int n1) {
  switch (p.bits) {
    case 4: amx_run<4>(p, x, n0, n1); break;
    case 5: amx_run<5>(p, x, n0, n1); break;
    default: amx_run<8>(p, x, n0, n1); break;
  }
}

}  // namespace amx
}  // namespace mlxterm
