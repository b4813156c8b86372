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
#define QMM_ISA gemm512
#define QMM_VNNI 2
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

// The 16 weight rows of a panel [n0, n0 + nr) as pack_pair16 takes them: the first half's rows
// (the last one repeated), the second half's, or the first half again when nr <= 8 (never
// stored); and the rows 16 on (the panel after), a block's share prefetched per block.
template <int BITS>
struct PanelRows {
  const uint8_t* wr[16];
  const uint8_t* next;

  PanelRows(const QmmProblem& p, int n0, int nr) {
    const size_t row_bytes = size_t(p.K) * BITS / 8;
    const int lo = std::min(8, nr);
    for (int j = 0; j < 8; ++j) {
      wr[j] = p.w + size_t(n0 + std::min(j, lo - 1)) * row_bytes;
      wr[8 + j] = nr > 8 ? p.w + size_t(n0 + 8 + std::min(j, nr - 9)) * row_bytes : wr[j];
    }
    next = p.w + size_t(n0 + 16) * row_bytes;
  }
};

// A 16-row panel of 5-bit weights decoded two rows per zmm: row j of the panel's first half in
// the low 256 bits, row j + 8 (its second half) in the high 256 bits, so every shuffle, multiply
// and shift of decode5 runs once for two rows, and the 8x8 dword transpose per 256-bit half leaves
// vector t of a block as the panel's 64-byte row t (weight rows 0-7, then 8-15) -- the bytes
// pack_pair16<5> writes. Why: the 256-bit decode of the 5-bit rows was ~20% of Qwen 0.5B's
// 8-row step (146 of its 170 matrices are Q5_0), and it lost port 1 when interleaved with the
// dots (pipelined_slice).
struct Rows5x16 : PanelRows<5> {
  using PanelRows<5>::PanelRows;

  // Block blk of the 16 rows into the panel's 8 vectors at out.
  __attribute__((always_inline)) void block(int blk, __m512i* out) const {
    for (int t = 0; t < 320; t += 64) _mm_prefetch(reinterpret_cast<const char*>(next) + size_t(blk) * 320 + t, _MM_HINT_T0);
    const __m512i shuf_a = _mm512_broadcast_i64x4(_mm256_setr_epi8(
        0, 1, 0, 1, 1, 2, 1, 2, 2, 3, 3, 4, 3, 4, 4, 5, 5, 6, 5, 6, 6, 7, 6, 7, 7, 8, 8, 9, 8, 9, 9, 10));
    const __m512i shuf_b = _mm512_broadcast_i64x4(_mm256_setr_epi8(
        6, 7, 6, 7, 7, 8, 7, 8, 8, 9, 9, 10, 9, 10, 10, 11, 11, 12, 11, 12, 12, 13, 12, 13, 13, 14, 14, 15, 14, 15, 15, -128));
    const __m512i mul = _mm512_broadcast_i64x4(_mm256_setr_epi16(
        1 << 11, 1 << 6, 1 << 9, 1 << 4, 1 << 7, 1 << 10, 1 << 5, 1 << 8,
        1 << 11, 1 << 6, 1 << 9, 1 << 4, 1 << 7, 1 << 10, 1 << 5, 1 << 8));
    const __m512i order = _mm512_setr_epi64(0, 2, 1, 3, 4, 6, 5, 7);
    __m512i r[8];
    for (int j = 0; j < 8; ++j) {
      const uint8_t* a = wr[j] + size_t(blk) * 20;
      const uint8_t* b = wr[8 + j] + size_t(blk) * 20;
      // 128-bit lanes: bytes 0-15 of row j twice, then of row j + 8 twice (decode5's b0, b0);
      // bytes 4-19 likewise (b1, b1)
      const __m512i b0 = _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                                     0xFF00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
      const __m512i b1 = _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 4))),
                                                     0xFF00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4)));
      const __m512i x = _mm512_srli_epi16(_mm512_mullo_epi16(_mm512_shuffle_epi8(b0, shuf_a), mul), 11);
      const __m512i y = _mm512_srli_epi16(_mm512_mullo_epi16(_mm512_shuffle_epi8(b1, shuf_b), mul), 11);
      r[j] = _mm512_permutexvar_epi64(order, _mm512_packus_epi16(x, y));
    }
    // transpose8i per 256-bit half (its unpacks work per 128-bit lane; its permute2x128 across
    // the half's two lanes is a two-source qword permute here)
    __m512i t[8], u[8];
    for (int k = 0; k < 4; ++k) {
      t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
      t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    u[0] = _mm512_unpacklo_epi64(t[0], t[2]), u[1] = _mm512_unpackhi_epi64(t[0], t[2]);
    u[2] = _mm512_unpacklo_epi64(t[1], t[3]), u[3] = _mm512_unpackhi_epi64(t[1], t[3]);
    u[4] = _mm512_unpacklo_epi64(t[4], t[6]), u[5] = _mm512_unpackhi_epi64(t[4], t[6]);
    u[6] = _mm512_unpacklo_epi64(t[5], t[7]), u[7] = _mm512_unpackhi_epi64(t[5], t[7]);
    const __m512i lo_lanes = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i hi_lanes = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    __m512i* o = out + size_t(blk) * 8;
    for (int k = 0; k < 4; ++k) {
      _mm512_storeu_si512(o + k, _mm512_permutex2var_epi64(u[k], lo_lanes, u[4 + k]));
      _mm512_storeu_si512(o + 4 + k, _mm512_permutex2var_epi64(u[k], hi_lanes, u[4 + k]));
    }
  }
};

// The same for 4-bit weights, two blocks at a time as pack_blocks<4> does them: a row's blocks
// blk and blk + 1 are 32 contiguous bytes, row j's in the low 256 bits and row j + 8's in the
// high; pack_blocks<4>'s word transposes and nibble split per 128-bit lane, then a two-source
// qword permute splits the two blocks (its permute2x128 per 256-bit half).
struct Rows4x16 : PanelRows<4> {
  using PanelRows<4>::PanelRows;

  // Blocks blk and blk + 1 of the 16 rows into the panel's vectors at out.
  __attribute__((always_inline)) void pair(int blk, __m512i* out) const {
    for (int t = 0; t < 512; t += 64) _mm_prefetch(reinterpret_cast<const char*>(next) + size_t(blk) * 256 + t, _MM_HINT_T0);
    __m512i a[8], b[8], c[8];
    for (int j = 0; j < 8; ++j)
      a[j] = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[j] + size_t(blk) * 16))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[8 + j] + size_t(blk) * 16)), 1);
    for (int j = 0; j < 4; ++j) {
      b[2 * j] = _mm512_unpacklo_epi16(a[2 * j], a[2 * j + 1]);
      b[2 * j + 1] = _mm512_unpackhi_epi16(a[2 * j], a[2 * j + 1]);
    }
    for (int h = 0; h < 2; ++h) {
      const __m512i* sb = b + 4 * h;
      c[4 * h + 0] = _mm512_unpacklo_epi32(sb[0], sb[2]);
      c[4 * h + 1] = _mm512_unpackhi_epi32(sb[0], sb[2]);
      c[4 * h + 2] = _mm512_unpacklo_epi32(sb[1], sb[3]);
      c[4 * h + 3] = _mm512_unpackhi_epi32(sb[1], sb[3]);
    }
    const __m512i m = _mm512_set1_epi8(0x0F);
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    __m512i* o0 = out + size_t(blk) * 8;
    __m512i* o1 = o0 + 8;
    for (int t = 0; t < 8; ++t) {
      const __m512i lo_rows = c[t / 2], hi_rows = c[4 + t / 2];
      const __m512i w = (t % 2 == 0) ? _mm512_unpacklo_epi64(lo_rows, hi_rows) : _mm512_unpackhi_epi64(lo_rows, hi_rows);
      const __m512i lo = _mm512_and_si512(w, m), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m);
      const __m512i u0 = _mm512_unpacklo_epi8(lo, hi), u1 = _mm512_unpackhi_epi8(lo, hi);
      _mm512_storeu_si512(o0 + t, _mm512_permutex2var_epi64(u0, first, u1));
      _mm512_storeu_si512(o1 + t, _mm512_permutex2var_epi64(u0, second, u1));
    }
  }
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

// f(std::integral_constant<int, mr>) for a tile of mr = 1..MAX rows (mr <= MAX).
template <int MAX, int R = MAX, class F>
void with_tile(int mr, F&& f) {
  if constexpr (R > 1) {
    if (mr < R) return with_tile<MAX, R - 1>(mr, f);
  }
  f(std::integral_constant<int, R>{});
}

// The tiles of rows [s0, s1) against one packed panel; the first one runs fill (pipelined_slice).
// As few tiles as the register file allows, their sizes within one row of each other: a tile's
// rows are its independent vpdpbusd chains, and a short tile waits on their latency (18 rows as
// 16 + 2 or 8 + 8 + 2: the 2-row tile cost about as much as 8 rows of the 16-row one). The fill's
// decode needs the registers a 16-row tile's accumulators would take: it goes with a tile of at
// most 8 rows. Tiles do not change bits (each output lane's operations are the row path's).
template <bool X16, class Fill>
void slice_rows(const QmmProblem& p, const XView& x, const Panel& pn, int s0, int s1, int n, int nr,
                const Fill& fill) {
  int m = s0;
  auto tiles = [](int rows, int first_max) {  // how many tiles for `rows`, the first <= first_max
    return rows <= first_max ? 1 : 1 + (rows - first_max + 15) / 16;
  };
  if constexpr (!std::is_same_v<Fill, NoFill>) {
    const int rows = s1 - m, t = tiles(rows, 8);
    with_tile<8>(std::min(8, (rows + t - 1) / t), [&](auto mr) {
      panel_rows<decltype(mr)::value, X16>(p, x, pn, m, n, nr, fill);
      m += decltype(mr)::value;
    });
  }
  while (m < s1) {
    const int rows = s1 - m, t = tiles(rows, 16);
    with_tile<16>((rows + t - 1) / t, [&](auto mr) {
      panel_rows<decltype(mr)::value, X16>(p, x, pn, m, n, nr);
      m += decltype(mr)::value;
    });
  }
}

// The decode of one 16-row panel, block by block (pipelined_slice): 8-bit rows by pack_group's
// block code (Pair16), 4- and 5-bit rows two per zmm (Rows4x16, Rows5x16); the scales as
// pack_pair16 makes them. Both halves prefetch the rows 16 on (the panel after): the half beside
// them is being decoded now (8 ahead made the head 1.23x slower pipelined).
template <int BITS>
struct PanelFill;

template <>
struct PanelFill<8> {
  Pair16<8> pair;
  PanelFill(const QmmProblem& p, const Panel& q, int n, int nr)
      : pair(p, n, nr, reinterpret_cast<uint8_t*>(q.w), q.scale, q.bias, 16) {}
  __attribute__((always_inline)) void block(int blk) const { pair.blocks(blk, blk + 1); }
  void scales() const { pair.scales(); }
};

template <>
struct PanelFill<5> {
  Pair16<5> pair;
  Rows5x16 rows;
  __m512i* w;
  PanelFill(const QmmProblem& p, const Panel& q, int n, int nr)
      : pair(p, n, nr, reinterpret_cast<uint8_t*>(q.w), q.scale, q.bias, 16), rows(p, n, nr), w(q.w) {}
  __attribute__((always_inline)) void block(int blk) const { rows.block(blk, w); }
  void scales() const { pair.scales(); }
};

template <>
struct PanelFill<4> {
  Pair16<4> pair;
  Rows4x16 rows;
  __m512i* w;
  int nb;
  PanelFill(const QmmProblem& p, const Panel& q, int n, int nr)
      : pair(p, n, nr, reinterpret_cast<uint8_t*>(q.w), q.scale, q.bias, 16), rows(p, n, nr), w(q.w), nb(p.K / 32) {}
  // After block blk's dots: the pair (blk - 1, blk), or an odd count's last block alone.
  __attribute__((always_inline)) void block(int blk) const {
    if (blk % 2 == 1) rows.pair(blk - 1, w);
    else if (blk == nb - 1) pair.blocks(blk, blk + 1);
  }
  void scales() const { pair.scales(); }
};

// Rows [s0, s1) against the panels of columns [n0, n1), software-pipelined: the next panel is
// decoded block by block between this panel's block dots (two panel buffers, pn[0] and pn[1]).
// Decoding is loads, shuffles and shifts waiting on the weight stream, the dots are vpdpbusd on
// the rows: one after the other (panel by panel), each phase left the other's units idle. The
// panels hold exactly what pack_pair16 writes, so the results are the same bits.
// The 4- and 5-bit decodes run in zmm here: their 256-bit versions, interleaved with the 512-bit
// dots, got slower (5-bit 4864 x 896 at 8 rows 1.3-1.5x, hot or streamed; SmolLM2's 4-bit step
// 1.067x) -- probably 256-bit integer work loses port 1 beside 512-bit uops. The 8-bit decode is
// loads and shuffles (port 5 either way) and stays pack_group's.
template <int BITS, bool X16>
void pipelined_slice(const QmmProblem& p, const XView& x, const Panel* pn, int s0, int s1, int n0, int n1) {
  const int nb = p.K / 32;
  {
    const PanelFill<BITS> first(p, pn[0], n0, std::min(16, n1 - n0));
    for (int blk = 0; blk < nb; ++blk) first.block(blk);
    first.scales();
  }
  int cur = 0;
  for (int n = n0; n < n1; n += 16) {
    const int nr = std::min(16, n1 - n);
    if (n + 16 >= n1) {
      slice_rows<X16>(p, x, pn[cur], s0, s1, n, nr, NoFill{});
      break;
    }
    const PanelFill<BITS> next(p, pn[cur ^ 1], n + 16, std::min(16, n1 - n - 16));
    // Inlined into the dots' block loop: a call there would spill the accumulators.
    auto fill = [&next](int blk) __attribute__((always_inline)) { next.block(blk); };
    slice_rows<X16>(p, x, pn[cur], s0, s1, n, nr, fill);
    next.scales();
    cur ^= 1;
  }
}

// Whether a slice of `rows` rows decodes the next panel between the dots (pipelined_slice).
// 4-bit panels at any row count: measured 1.1-1.5x at 16-128 rows (Qwen 1.5B's 8960 x 1536
// and 1536 x 8960 at 1 thread), the serial decode being a large share at 16-32 rows. 5-bit
// ones gained nothing from 16 rows on and 8-bit ones lost 3-10% (pack_group's shuffles beside
// the dots), so they pipeline below 16 rows only.
template <int BITS>
bool pipelined_rows(int rows) {
  return rows512_pipe_on() && (BITS == 4 || rows < 16);
}

template <int BITS, bool X16>
void gemm_run(const QmmProblem& p, const XView& x, int n0, int n1) {
  if (n0 >= n1) return;
  const int nb = p.K / 32, ng = p.K / p.group_size;
  thread_local std::vector<float> pf;
  thread_local std::vector<__m512i> pw;
  pw.resize(size_t(nb) * 16);  // two panels: the pipelined path decodes into the other
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
    if (pipelined_rows<BITS>(s1 - s0)) {
      pipelined_slice<BITS, X16>(p, x, pn, s0, s1, n0, n1);
      continue;
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
