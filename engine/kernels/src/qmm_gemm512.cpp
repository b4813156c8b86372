// The quantized matmul's many-row path (prefill chunks, long verifies) on AVX512-VNNI CPUs
// without AMX, and its 2..15-row path (a batch's decode step) on every AVX512-VNNI CPU: the row
// path's int8 arithmetic (qmm_kernel.inc's group_rows) in 512-bit register tiles, so every
// output is the row path's bit for bit -- a prefill row equals its decode row.
//
// Why: on AMD Zen 4 (AVX-512 VNNI, no AMX) the float panels (dense_run: dequantize to float,
// fp32 FMA micro-kernel) peak at ~90 GOP/s per core, while `vpdpbusd` does 4 int8 products per
// lane: the row path already ran M >= 16 at ~2x that on 256-bit vectors. This kernel keeps its
// arithmetic and widens the tile to 16 weight rows per vector:
//   - a panel of 16 weight rows (two of pack_group's 8-row panels side by side) is built once
//     per activation slice; block blk is 8 zmm, vector t holding, for weight row j = 0..15, its
//     bytes 4t..4t+3; plus 16 scales per group and 16 bias terms per group;
//   - a block's 8 weight vectors stay in registers while up to 16 activation rows pass over them
//     (16 float accumulators): per row 8 `vpdpbusd` (unsigned weights x signed activations, the
//     activation's 4-byte piece broadcast from memory) give the exact int32 block dot of 16
//     outputs, then the row path's float chain: acc = fma(float(dot), scale_w * scale_x, acc);
//   - at the end the bias chain over groups, + acc, as group_rows does.
// The integer dot is exact in any order, and the float operations per output lane are the row
// path's in the same order, so the results are identical whatever the tile, slice or chunk.
#define MLXTERM_ISA gemm512
#define MLXTERM_VNNI 2
#include "qmm_kernel.inc"

namespace mlxterm {
namespace gemm512 {
namespace {

// One panel of 16 weight rows: the blocks (nb * 8 vectors), per group their 16 scales and 16
// bias terms (bias + shift * scale, pack_scales' values).
struct Panel {
  __m512i* w;
  float* scale;
  float* bias;
};

// A 4-byte piece of an activation block, broadcast (folded into vpdpbusd as {1to16}).
inline __m512i piece16(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// One 32-block's int32 dots of the panel's 16 columns (weight vectors w0..w7) with activation
// block xb: two chains of 4 vpdpbusd, then their sum.
inline __m512i block_dot(__m512i w0, __m512i w1, __m512i w2, __m512i w3, __m512i w4, __m512i w5, __m512i w6,
                         __m512i w7, const int8_t* xb) {
  const __m512i z = _mm512_setzero_si512();
  __m512i d0 = _mm512_dpbusd_epi32(z, w0, piece16(xb));
  __m512i d1 = _mm512_dpbusd_epi32(z, w1, piece16(xb + 4));
  d0 = _mm512_dpbusd_epi32(d0, w2, piece16(xb + 8));
  d1 = _mm512_dpbusd_epi32(d1, w3, piece16(xb + 12));
  d0 = _mm512_dpbusd_epi32(d0, w4, piece16(xb + 16));
  d1 = _mm512_dpbusd_epi32(d1, w5, piece16(xb + 20));
  d0 = _mm512_dpbusd_epi32(d0, w6, piece16(xb + 24));
  d1 = _mm512_dpbusd_epi32(d1, w7, piece16(xb + 28));
  return _mm512_add_epi32(d0, d1);
}

// Nothing to interleave (panel_rows' Fill).
struct NoFill {
  void operator()(int) const {}
};

// Activation rows [m0, m0 + MR) against one panel: out[m, n0 + j] for j < nr. X16: 16-bit
// activations, a second chain on their low parts (x.lo) joined as group_rows joins them.
// fill(blk) runs after block blk's dots (the next panel's decode, see gemm_run).
template <int MR, bool X16, class Fill = NoFill>
void panel_rows(const QmmProblem& p, const XView& x, const Panel& pn, int m0, int n0, int nr,
                const Fill& fill = Fill{}) {
  const int K = p.K, nb = K / 32, ng = K / p.group_size, bpg = p.group_size / 32;
  __m512 acc[MR];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  const int8_t* xq = x.q + size_t(m0) * K;
  const float* xd = x.d + size_t(m0) * nb;
  for (int blk = 0; blk < nb; ++blk) {
    const __m512i* wb = pn.w + size_t(blk) * 8;
    const __m512i w0 = _mm512_loadu_si512(wb), w1 = _mm512_loadu_si512(wb + 1);
    const __m512i w2 = _mm512_loadu_si512(wb + 2), w3 = _mm512_loadu_si512(wb + 3);
    const __m512i w4 = _mm512_loadu_si512(wb + 4), w5 = _mm512_loadu_si512(wb + 5);
    const __m512i w6 = _mm512_loadu_si512(wb + 6), w7 = _mm512_loadu_si512(wb + 7);
    const __m512 sv = _mm512_loadu_ps(pn.scale + (blk / bpg) * 16);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      __m512i di = block_dot(w0, w1, w2, w3, w4, w5, w6, w7, xq + size_t(i) * K + size_t(blk) * 32);
      if constexpr (X16)  // q16 = 128 * hi + lo: exact in int32
        di = _mm512_add_epi32(_mm512_slli_epi32(di, 7),
                              block_dot(w0, w1, w2, w3, w4, w5, w6, w7, x.lo + size_t(m0 + i) * K + size_t(blk) * 32));
      const __m512 dot = _mm512_cvtepi32_ps(di);
      const __m512 s = _mm512_mul_ps(sv, _mm512_set1_ps(xd[size_t(i) * nb + blk]));
      acc[i] = _mm512_fmadd_ps(dot, s, acc[i]);
    }
    fill(blk);
  }
  // The affine biases: per row, sum over groups of bias term * sum(x of the group), in group
  // order, then + acc (group_rows' order); the rows' chains side by side.
  const __mmask16 mask = nr >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << nr) - 1);
  const float* gs = x.gsum + size_t(m0) * ng;
  __m512 b[MR];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) b[i] = _mm512_setzero_ps();
  for (int q = 0; q < ng; ++q) {
    const __m512 bv = _mm512_loadu_ps(pn.bias + q * 16);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) b[i] = _mm512_fmadd_ps(bv, _mm512_set1_ps(gs[size_t(i) * ng + q]), b[i]);
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
    _mm512_mask_storeu_ps(p.out + size_t(m0 + i) * p.N + n0, mask, _mm512_add_ps(acc[i], b[i]));
}

// The tiles of rows [s0, s1) against one packed panel; the first one runs fill (pipelined_slice).
template <bool X16, class Fill>
void slice_rows(const QmmProblem& p, const XView& x, const Panel& pn, int s0, int s1, int n, int nr,
                const Fill& fill) {
  int m = s0;
  bool first = true;
  auto tile = [&](auto mr) {
    constexpr int MR = decltype(mr)::value;
    if (first) panel_rows<MR, X16>(p, x, pn, m, n, nr, fill);
    else panel_rows<MR, X16>(p, x, pn, m, n, nr);
    first = false;
    m += MR;
  };
  while (s1 - m >= 16) tile(std::integral_constant<int, 16>{});
  if (s1 - m >= 8) tile(std::integral_constant<int, 8>{});
  if (s1 - m >= 4) tile(std::integral_constant<int, 4>{});
  if (s1 - m >= 2) tile(std::integral_constant<int, 2>{});
  if (s1 - m >= 1) tile(std::integral_constant<int, 1>{});
}

// Rows [s0, s1) against the panels of columns [n0, n1) of 8-bit weights, software-pipelined:
// the next panel is decoded block by block between this panel's block dots (two panel buffers,
// pn[0] and pn[1]). Decoding 8-bit rows is loads and transposes waiting on the weight stream; the
// dots are vpdpbusd on the rows: one after the other, each phase left the other's units idle.
// The panels hold exactly what pack_pair16 writes, so the results are the same bits.
// Only 8-bit: interleaved, the 4-bit (SmolLM2's step 1.067x) and 5-bit decodes (gate 4864 x 896
// at 8 rows 1.3-1.5x, hot or streamed) got slower -- probably their 256-bit integer work loses
// port 1 beside 512-bit uops, where the 8-bit decode is loads and shuffles (port 5 either way).
template <bool X16>
void pipelined_slice(const QmmProblem& p, const XView& x, const Panel* pn, int s0, int s1, int n0, int n1) {
  const int nb = p.K / 32;
  auto pair16 = [&](const Panel& q, int n) {
    return Pair16<8>(p, n, std::min(16, n1 - n), reinterpret_cast<uint8_t*>(q.w), q.scale, q.bias);
  };
  {
    const Pair16<8> first = pair16(pn[0], n0);
    first.blocks(0, nb);
    first.scales();
  }
  int cur = 0;
  for (int n = n0; n < n1; n += 16) {
    const int nr = std::min(16, n1 - n);
    if (n + 16 >= n1) {
      slice_rows<X16>(p, x, pn[cur], s0, s1, n, nr, NoFill{});
      break;
    }
    const Pair16<8> next = pair16(pn[cur ^ 1], n + 16);
    // Inlined into the dots' block loop: a call there would spill the accumulators.
    auto fill = [&next](int blk) __attribute__((always_inline)) { next.blocks(blk, blk + 1); };
    slice_rows<X16>(p, x, pn[cur], s0, s1, n, nr, fill);
    next.scales();
    cur ^= 1;
  }
}

template <int BITS, bool X16>
void gemm_run(const QmmProblem& p, const XView& x, int n0, int n1) {
  if (n0 >= n1) return;
  const int nb = p.K / 32, ng = p.K / p.group_size;
  thread_local std::vector<float> pf;
  thread_local std::vector<__m512i> pw;
  pw.resize(size_t(nb) * 16);  // two panels: the pipelined 8-bit path decodes into the other
  pf.resize(size_t(ng) * 64);
  Panel pn[2];
  for (int i = 0; i < 2; ++i) {
    float* f = pf.data() + size_t(i) * ng * 32;
    pn[i] = Panel{pw.data() + size_t(i) * nb * 8, f, f + size_t(ng) * 16};
  }
  // Activation rows in slices that stay in L2 while every panel of this chunk passes over them
  // (a panel is decoded once per slice; for K <= ~2k that is once per matmul).
  const int slice = std::max(16, int((512 * 1024) / size_t(p.K)) & ~15);
  for (int s0 = 0; s0 < p.M; s0 += slice) {
    const int s1 = std::min(p.M, s0 + slice);
    if constexpr (BITS == 8) {
      if (rows512_pipe_on()) {
        pipelined_slice<X16>(p, x, pn, s0, s1, n0, n1);
        continue;
      }
    }
    for (int n = n0; n < n1; n += 16) {
      const int nr = std::min(16, n1 - n);
      pack_pair16<BITS>(p, n, nr, reinterpret_cast<uint8_t*>(pn[0].w), pn[0].scale, pn[0].bias);
      slice_rows<X16>(p, x, pn[0], s0, s1, n, nr, NoFill{});
    }
  }
}

}  // namespace

void qmm_gemm(const QmmProblem& p, const XView& x, int n0, int n1) {
  switch (p.bits) {
    case 4: x.lo ? gemm_run<4, true>(p, x, n0, n1) : gemm_run<4, false>(p, x, n0, n1); break;
    case 5: x.lo ? gemm_run<5, true>(p, x, n0, n1) : gemm_run<5, false>(p, x, n0, n1); break;
    default: x.lo ? gemm_run<8, true>(p, x, n0, n1) : gemm_run<8, false>(p, x, n0, n1); break;
  }
}

}  // namespace gemm512
}  // namespace mlxterm
