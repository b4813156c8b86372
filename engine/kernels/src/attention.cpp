// Fused attention over the kernel pool (see attention.h for the contract).
//
// Why: MLX's CPU attention is matmul -> softmax -> matmul; its matmul against a transposed K
// runs far below sgemm speed, the softmax materialises L x S scores, and at decode the K/V
// stream dominates. Here a task owns the query rows of one (batch, KV head, query tile) --
// every query head of that KV head, so a K/V block read from memory serves them all (GQA) --
// and walks the keys in blocks of kBlock with an online softmax (running max m, sum l,
// unnormalised output O rescaled when the max grows). Decode-sized tasks (<= 8 rows) score
// with 3-row (GQA multiples of 3) or 2-row x 4-key dot-product tiles (FMA chains reduced by a
// horizontal-add tree) on K's natural (S, D) layout, P @ V 64 columns wide with AVX-512;
// many-row tasks (prefill) transpose each K block once and run
// GEMM-style 6-row x 16-key register tiles (no horizontal sums, K loaded once per 6 rows). Causal tiles skip the key blocks no row can see; a key
// mask shared by every query (the static caches' validity vector) ends the key range at the
// last valid key, so a half-empty cache buffer costs nothing. When one batch row has fewer
// (head, tile) tasks than kMinTasks (decode) the keys are also split, each split keeps its own
// (m, l, O), and a merge combines them -- how the work is split depends on one row's shapes
// and mask only, never on the batch size or the thread count, so a row's result is identical
// alone or in a batch (batched decode, speculative verify) and for any number of threads.
// float16 K/V (half the bytes to stream) are widened with F16C: in registers at decode, once
// per block into scratch for prefill tiles.
#include "attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

#include <immintrin.h>

#include "attention_impl.h"
#include "attention_tiles.h"
#include "ops.h"
#include "pool.h"
#include "qmm.h"
#include "vmath.h"

namespace mlxterm {

namespace attn {

namespace {

constexpr int kTileRows = 66;   // query rows per task (query heads of a KV head x positions;
                                // 66 = 6 x 11: whole 6-row register tiles for 1, 2, 3 or 6 heads per KV head)
// Below this many multiply-adds (rows x keys x (D + Dv)) a call runs on the calling thread:
// waking the pool costs more than the work (Whisper's per-token cross-attention, decode at
// short context). Which thread runs a task never changes its result.
constexpr size_t kInlineWork = size_t(1) << 18;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Rows [0, n) of 8-bit K or V (row stride `stride` bytes) as float (n x D): int8 * the
// group's scale (an int8 converts exactly; one rounding in the multiply).
void widen_q8(const uint8_t* src, size_t stride, int n, int D, int G, float* dst) {
  for (int c = 0; c < n; ++c) {
    const uint8_t* row = src + size_t(c) * stride;
    for (int g = 0; g < D / G; ++g) {
      float sc;
      std::memcpy(&sc, row + D + 4 * g, 4);
      const __m256 vs = _mm256_set1_ps(sc);
      for (int d = g * G; d < (g + 1) * G; d += 8) {
        const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d))));
        _mm256_storeu_ps(dst + size_t(c) * D + d, _mm256_mul_ps(x, vs));
      }
    }
  }
}

#include "attention_q8.inc"

// s[r][c] = Q[r] . K[c] for rows r0..r0+RT-1 (clamped to R - 1) and keys [0, n): RT rows x 4
// keys per tile. Every score is the same chain whatever RT: lane j of its accumulator sums
// the products of dims j, j + 8, ... in order, then hadd8's tree (the same for every slot).
template <int RT, typename T>
inline void score_rows(const float* Q, int r0, int R, const T* K, int n, int D, float* s, const Prefetch& pf) {
  int rr[RT];
  const float* q[RT];
  for (int u = 0; u < RT; ++u) rr[u] = std::min(r0 + u, R - 1), q[u] = Q + size_t(rr[u]) * D;
  for (int c = 0; c < n; c += 4) {
    if (r0 == 0) prefetch_tile(pf, c);
    const T* k[4];
    for (int t = 0; t < 4; ++t) k[t] = K + size_t(std::min(c + t, n - 1)) * D;
    __m256 acc[RT == 3 ? 16 : 8];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
      __m256 a[RT];
      for (int u = 0; u < RT; ++u) a[u] = _mm256_loadu_ps(q[u] + d);
      for (int t = 0; t < 4; ++t) {
        const __m256 kv = load8(k[t] + d);
        for (int u = 0; u < RT; ++u) acc[4 * u + t] = _mm256_fmadd_ps(a[u], kv, acc[4 * u + t]);
      }
    }
    alignas(32) float res[16];
    _mm256_store_ps(res, hadd8(acc));
    if (RT == 3) _mm256_store_ps(res + 8, hadd8(acc + 8));
    for (int u = 0; u < RT; ++u)
      if (u == 0 || rr[u] != rr[u - 1]) std::copy(res + 4 * u, res + 4 * u + 4, s + size_t(rr[u]) * kBlock + c);
  }
}

bool use_avx512();

std::atomic<bool>& decode512_switch() {
  static std::atomic<bool> on{true};
  return on;
}

// s[r][c] = Q[r] . K[c] for rows [0, R) and keys [0, n): 3-row tiles when R is a multiple of
// 3 (SmolLM2's 3 query heads per KV head: 2-row tiles computed a duplicate fourth row),
// else 2-row tiles.
template <typename T>
void scores(const float* Q, int R, const T* K, int n, int D, float* s, const Prefetch& pf) {
  if (decode512_on()) {  // the same chains and tree, two keys per zmm
    avx512::scores_decode(Q, R, K, n, D, s, pf);
    return;
  }
  if (R % 3 == 0) {
    for (int r = 0; r < R; r += 3) score_rows<3>(Q, r, R, K, n, D, s, pf);
  } else {
    for (int r = 0; r < R; r += 2) score_rows<2>(Q, r, R, K, n, D, s, pf);
  }
}

// O[r] += sum_c P[r][c] V[c] for R rows (R <= 6), keys [0, n), Dv % 16 == 0.
template <int R, typename T>
inline void accumulate(const float* P, const T* V, size_t vstride, int n, int Dv, float* O) {
  for (int c0 = 0; c0 < Dv; c0 += 16) {
    __m256 acc[R][2];
    for (int t = 0; t < R; ++t) {
      acc[t][0] = _mm256_loadu_ps(O + size_t(t) * Dv + c0);
      acc[t][1] = _mm256_loadu_ps(O + size_t(t) * Dv + c0 + 8);
    }
    for (int c = 0; c < n; ++c) {
      const T* vr = V + size_t(c) * vstride + c0;
      const __m256 v0 = load8(vr), v1 = load8(vr + 8);
      for (int t = 0; t < R; ++t) {
        const __m256 p = _mm256_broadcast_ss(P + size_t(t) * kBlock + c);
        acc[t][0] = _mm256_fmadd_ps(p, v0, acc[t][0]);
        acc[t][1] = _mm256_fmadd_ps(p, v1, acc[t][1]);
      }
    }
    for (int t = 0; t < R; ++t) {
      _mm256_storeu_ps(O + size_t(t) * Dv + c0, acc[t][0]);
      _mm256_storeu_ps(O + size_t(t) * Dv + c0 + 8, acc[t][1]);
    }
  }
}

// ---- Many-query tiles (prefill, long verify): GEMM-style register tiles ------------------
// Scores: the K block is transposed once per block into Kt (D x kBlock, zero-padded to a
// multiple of 16 keys), then kRowTile query rows x 16 keys live in 12 accumulators: per d, two
// loads of Kt and kRowTile broadcasts of q feed 2 * kRowTile FMAs (no horizontal sums).
// P @ V: kRowTile rows x 16 value columns per accumulator tile, V in its natural layout.
// With AVX-512 (attention_avx512.cpp) the same chains run 6 rows x 64 keys / columns at once.
constexpr int kRowTile = kAttnRowTile;

bool use_avx512() {
  static const bool yes = best_isa() == Isa::avx512vnni;
  return yes;
}

inline void transpose8(const float* src, size_t sstride, float* dst, size_t dstride) {
  __m256 r0 = _mm256_loadu_ps(src), r1 = _mm256_loadu_ps(src + sstride);
  __m256 r2 = _mm256_loadu_ps(src + 2 * sstride), r3 = _mm256_loadu_ps(src + 3 * sstride);
  __m256 r4 = _mm256_loadu_ps(src + 4 * sstride), r5 = _mm256_loadu_ps(src + 5 * sstride);
  __m256 r6 = _mm256_loadu_ps(src + 6 * sstride), r7 = _mm256_loadu_ps(src + 7 * sstride);
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  r0 = _mm256_shuffle_ps(t0, t2, 0x44), r1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  r2 = _mm256_shuffle_ps(t1, t3, 0x44), r3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  r4 = _mm256_shuffle_ps(t4, t6, 0x44), r5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  r6 = _mm256_shuffle_ps(t5, t7, 0x44), r7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(dst, _mm256_permute2f128_ps(r0, r4, 0x20));
  _mm256_storeu_ps(dst + dstride, _mm256_permute2f128_ps(r1, r5, 0x20));
  _mm256_storeu_ps(dst + 2 * dstride, _mm256_permute2f128_ps(r2, r6, 0x20));
  _mm256_storeu_ps(dst + 3 * dstride, _mm256_permute2f128_ps(r3, r7, 0x20));
  _mm256_storeu_ps(dst + 4 * dstride, _mm256_permute2f128_ps(r0, r4, 0x31));
  _mm256_storeu_ps(dst + 5 * dstride, _mm256_permute2f128_ps(r1, r5, 0x31));
  _mm256_storeu_ps(dst + 6 * dstride, _mm256_permute2f128_ps(r2, r6, 0x31));
  _mm256_storeu_ps(dst + 7 * dstride, _mm256_permute2f128_ps(r3, r7, 0x31));
}

// Kt[d][c] = K[c][d] for keys [0, n) (float K), columns [n, round16(n)) zero.
void transpose_block(const float* K, int n, int D, float* Kt) {
  const int n8 = n & ~7, npad = (n + 15) & ~15;
  for (int c = 0; c < n8; c += 8)
    for (int d = 0; d < D; d += 8) transpose8(K + size_t(c) * D + d, size_t(D), Kt + size_t(d) * kBlock + c, kBlock);
  for (int d = 0; d < D; ++d) {
    float* row = Kt + size_t(d) * kBlock;
    for (int c = n8; c < n; ++c) row[c] = K[size_t(c) * D + d];
    std::fill(row + n, row + npad, 0.0f);
  }
}

// s[r][c] = Q[r] . K[c] for rows [0, Rp) (Rp % kRowTile == 0) and keys [0, round16(n)).
void scores_tiled(const float* Q, int Rp, const float* Kt, int n, int D, float* s) {
  const int npad = (n + 15) & ~15;
  for (int r = 0; r < Rp; r += kRowTile) {
    const float* q = Q + size_t(r) * D;
    for (int c = 0; c < npad; c += 16) {
      __m256 acc[kRowTile][2];
      for (auto& a : acc) a[0] = a[1] = _mm256_setzero_ps();
      const float* kt = Kt + c;
      for (int d = 0; d < D; ++d) {
        const __m256 k0 = _mm256_loadu_ps(kt + size_t(d) * kBlock), k1 = _mm256_loadu_ps(kt + size_t(d) * kBlock + 8);
        for (int t = 0; t < kRowTile; ++t) {
          const __m256 b = _mm256_broadcast_ss(q + size_t(t) * D + d);
          acc[t][0] = _mm256_fmadd_ps(b, k0, acc[t][0]);
          acc[t][1] = _mm256_fmadd_ps(b, k1, acc[t][1]);
        }
      }
      for (int t = 0; t < kRowTile; ++t) {
        _mm256_storeu_ps(s + size_t(r + t) * kBlock + c, acc[t][0]);
        _mm256_storeu_ps(s + size_t(r + t) * kBlock + c + 8, acc[t][1]);
      }
    }
  }
}

// Mask the block's scores, update each row's running max / sum, rescale its output, and leave
// exp(score - max) in the scores. False when no row sees any key of the block.
// wide: the exponentials run 16 lanes at a time (AVX-512; same values per element), summed
// in the 8-lane order below either way.
bool softmax_block(const Problem& p, const Split& t, Scratch& sc, int R, int kb, int n, bool wide = false) {
  const int Dv = p.Dv;
  const int bm = p.Bm == 1 ? 0 : t.b;
  bool any = false;
  for (int r = 0; r < R; ++r) {
    float* s = sc.s.data() + size_t(r) * kBlock;
    const int i = t.i0 + r % t.nt;
    if (p.mode == 1) {
      int a, b;
      causal_range(p, i, a, b);
      const int lo = std::clamp(a - kb, 0, n), hi = std::clamp(b - kb, 0, n);
      std::fill(s, s + lo, kNegInf);
      std::fill(s + std::max(lo, hi), s + n, kNegInf);
    } else if (p.mode == 2) {
      const float* mr = p.mask + (size_t(bm) * p.Lm + (p.Lm == 1 ? 0 : i)) * p.S + kb;
      int c = 0;
      for (; c + 8 <= n; c += 8)
        _mm256_storeu_ps(s + c, _mm256_add_ps(_mm256_loadu_ps(s + c), _mm256_loadu_ps(mr + c)));
      for (; c < n; ++c) s[c] += mr[c];
    }
    __m256 vmax = _mm256_set1_ps(kNegInf);
    int c = 0;
    for (; c + 8 <= n; c += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + c));
    float mb = hmax(vmax);
    for (; c < n; ++c) mb = std::max(mb, s[c]);
    const float m_old = sc.m[r], m_new = std::max(m_old, mb);
    if (m_new == kNegInf) {  // nothing visible yet for this row
      std::fill(s, s + n, 0.0f);
      continue;
    }
    any = true;
    if (m_new != m_old) {
      const float alpha = m_old == kNegInf ? 0.0f : std::exp(m_old - m_new);
      sc.l[r] *= alpha;
      float* o = sc.o.data() + size_t(r) * Dv;
      const __m256 va = _mm256_set1_ps(alpha);
      for (int d = 0; d < Dv; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), va));
      sc.m[r] = m_new;
    }
    const __m256 vm = _mm256_set1_ps(m_new);
    __m256 vs = _mm256_setzero_ps();
    c = 0;
    if (wide) {
      const int n8 = n & ~7;
      avx512::exp_shifted(s, n8, m_new);
      for (; c < n8; c += 8) vs = _mm256_add_ps(vs, _mm256_loadu_ps(s + c));
    }
    for (; c + 8 <= n; c += 8) {
      const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + c), vm));
      _mm256_storeu_ps(s + c, e);
      vs = _mm256_add_ps(vs, e);
    }
    float sum = hadd(vs);
    for (; c < n; ++c) {
      s[c] = s[c] == kNegInf ? 0.0f : std::exp(s[c] - m_new);
      sum += s[c];
    }
    sc.l[r] += sum;
  }
  return any;
}

// O[r] += P[r] @ V for every row, in groups of 6 rows (tiled) or 4 (decode). An output
// element is the same FMA chain over the keys whatever the grouping.
template <typename T>
void pv(Scratch& sc, int R, const T* V, int n, int Dv, bool tiled = false) {
  if (!tiled && use_avx512()) {  // decode: 64 columns x up to 4 rows per register tile
    avx512::pv_decode(sc.s.data(), R, V, n, Dv, sc.o.data());
    return;
  }
  int r = 0;
  if constexpr (std::is_same_v<T, float>) {
    if (tiled && use_avx512()) {
      r = R / kRowTile * kRowTile;
      avx512::pv_tiled(sc.s.data(), kBlock, r, V, n, Dv, sc.o.data());
    }
  }
  if (tiled)
    for (; r + kRowTile <= R; r += kRowTile)
      accumulate<kRowTile>(sc.s.data() + size_t(r) * kBlock, V, size_t(Dv), n, Dv, sc.o.data() + size_t(r) * Dv);
  for (; r + 4 <= R; r += 4)
    accumulate<4>(sc.s.data() + size_t(r) * kBlock, V, size_t(Dv), n, Dv, sc.o.data() + size_t(r) * Dv);
  const float* P = sc.s.data() + size_t(r) * kBlock;
  float* O = sc.o.data() + size_t(r) * Dv;
  switch (R - r) {
    case 3: accumulate<3>(P, V, size_t(Dv), n, Dv, O); break;
    case 2: accumulate<2>(P, V, size_t(Dv), n, Dv, O); break;
    case 1: accumulate<1>(P, V, size_t(Dv), n, Dv, O); break;
    default: break;
  }
}

}  // namespace


// x (D) times the orthonormal Walsh-Hadamard matrix on blocks of P = the largest power of two
// dividing D, in place: butterflies (a + b, a - b) over strides 1, 2, ..., P / 2, then
// P^-1/2 (exact for D = 64). The same transform as kv_cache.q8_rotate (mx.hadamard_transform)
// up to float rounding; the kernel's paths and its reference all read this one.
void rotate_row(float* x, int D) {
  const int P = D & -D;
  const float norm = float(1.0 / std::sqrt(double(P)));
  for (int b = 0; b < D; b += P) {
    float* y = x + b;
    for (int h = 1; h < P; h *= 2)
      for (int i = 0; i < P; i += 2 * h)
        for (int j = i; j < i + h; ++j) {
          const float a = y[j], c = y[j + h];
          y[j] = a + c;
          y[j + h] = a - c;
        }
    for (int d = 0; d < P; ++d) y[d] *= norm;
  }
}

// q (already scaled) quantized per group of G dims as the q8 decode scores read it:
// qs = max|q| / 127, qi = round-to-even(q * (127 / max|q|)) in -127..127 (all zero: 0, 0).
// Prefill tiles read the same q back as float (qi * qs), so every path scores the same q.
void quantize_q(const float* q, int D, int G, int8_t* qi, float* qs) {
  for (int g = 0; g < D / G; ++g) {
    float amax = 0.0f;
    for (int d = g * G; d < (g + 1) * G; ++d) amax = std::max(amax, std::fabs(q[d]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    qs[g] = amax / 127.0f;
    for (int d = g * G; d < (g + 1) * G; ++d)
      qi[d] = int8_t(std::clamp(std::nearbyint(q[d] * inv), -127.0f, 127.0f));
  }
}

// A task's rows of (b, kvh, i0..i0+nt) into sc: q scaled (rotated, quantized for q8 K) and an
// empty (m, l, O) per row. Many rows (prefill tiles, long verifies) run register tiles over a
// transposed K block; decode-sized tasks (a row of a batch, a verify's single-query rows) keep
// the dot-product path: which path runs depends on one batch row's shapes only.
void begin_split(const Problem& p, const Split& t, Scratch& sc, bool tiled) {
  const int rep = p.H / p.Hk, R = rep * t.nt, D = p.D, Dv = p.Dv;
  const int Rp = tiled ? (R + kRowTile - 1) / kRowTile * kRowTile : R;
  sc.q.assign(size_t(Rp) * D, 0.0f);
  sc.o.assign(size_t(R) * Dv, 0.0f);
  sc.s.resize(size_t(Rp) * kBlock);
  sc.m.assign(R, kNegInf);
  sc.l.assign(R, 0.0f);
  const __m256 vscale = _mm256_set1_ps(p.scale);
  for (int r = 0; r < R; ++r) {
    const int h = t.kvh * rep + r / t.nt, i = t.i0 + r % t.nt;
    const float* src = p.q + ((size_t(t.b) * p.H + h) * p.L + i) * D;
    float* dst = sc.q.data() + size_t(r) * D;
    if (p.rotate) {
      std::copy(src, src + D, dst);
      rotate_row(dst, D);
      src = dst;
    }
    for (int d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(src + d), vscale));
  }
  if (p.q8) {  // q quantized per group: int8 dots at decode, its float values in the tiles
    const int ng = D / p.G;
    sc.qi.resize(size_t(Rp) * D);
    sc.qs.resize(size_t(Rp) * ng);
    for (int r = 0; r < Rp; ++r) {
      quantize_q(sc.q.data() + size_t(r) * D, D, p.G, sc.qi.data() + size_t(r) * D, sc.qs.data() + size_t(r) * ng);
      if (tiled)
        for (int d = 0; d < D; ++d) sc.q[size_t(r) * D + d] = float(sc.qi[size_t(r) * D + d]) * sc.qs[size_t(r) * ng + d / p.G];
    }
  }
}

// The decode path's step over keys [kb, kb + n) for sc's R rows: float32 / float16 K and V
// rows from kblk / vblk (float16 widened in registers as they are read: the same values as
// widened first, so the same bits).
template <typename T>
void decode_block(const Problem& p, const Split& t, Scratch& sc, int R, int kb, int n, const T* kblk, const T* vblk,
                  const Prefetch& pf) {
  decode_scores(p, sc, R, n, kblk, pf);
  decode_pv(p, t, sc, R, kb, n, vblk);
}

// decode_block's two halves, for callers that run many rows' scores over a block before their
// value sums (attention_rows.cpp: the K block then stays in L1 across positions, then V).
template <typename T>
void decode_scores(const Problem& p, Scratch& sc, int R, int n, const T* kblk, const Prefetch& pf) {
  scores(sc.q.data(), R, kblk, n, p.D, sc.s.data(), pf);
}
template <typename T>
void decode_pv(const Problem& p, const Split& t, Scratch& sc, int R, int kb, int n, const T* vblk) {
  if (!softmax_block(p, t, sc, R, kb, n, use_avx512())) return;
  pv(sc, R, vblk, n, p.Dv);
}

// decode_block for np query positions of one KV head over the same keys [kb, kb + n) (the
// causal prompt rows' full blocks): each position's scores, softmax and value sums exactly as
// decode_block computes them, the score and value tiles taking up to 6 rows of several
// positions per pass on AVX-512, so each key's loads and conversions serve them all.
template <typename T>
void decode_block_rows(const Problem& p, const Split* ts, Scratch* scs, int np, int R, int kb, int n,
                       const T* kblk, const T* vblk) {
  if (!decode512_on()) {
    for (int j = 0; j < np; ++j) decode_block(p, ts[j], scs[j], R, kb, n, kblk, vblk, Prefetch{});
    return;
  }
  thread_local std::vector<const float*> q, pr;
  thread_local std::vector<float*> sr, orow;
  q.clear(), sr.clear(), pr.clear(), orow.clear();
  for (int j = 0; j < np; ++j)
    for (int r = 0; r < R; ++r) {
      q.push_back(scs[j].q.data() + size_t(r) * p.D);
      sr.push_back(scs[j].s.data() + size_t(r) * kBlock);
    }
  avx512::scores_rows(q.data(), sr.data(), int(q.size()), kblk, n, p.D);
  for (int j = 0; j < np; ++j) {
    if (!softmax_block(p, ts[j], scs[j], R, kb, n, true)) continue;
    for (int r = 0; r < R; ++r) {
      pr.push_back(scs[j].s.data() + size_t(r) * kBlock);
      orow.push_back(scs[j].o.data() + size_t(r) * p.Dv);
    }
  }
  avx512::pv_rows(pr.data(), int(pr.size()), vblk, n, p.Dv, orow.data());
}

// The same for 8-bit K/V rows (int8 dot products against sc's quantized q).
void decode_block_q8(const Problem& p, const Split& t, Scratch& sc, int R, int kb, int n, const uint8_t* kblk,
                     const uint8_t* vblk, const Prefetch& pf) {
  if (use_avx512()) avx512::q8_scores(sc.qi.data(), sc.qs.data(), R, kblk, p.kst, n, p.D, p.G, sc.s.data(), pf);
  else q8::scores(sc.qi.data(), sc.qs.data(), R, kblk, p.kst, n, p.D, p.G, sc.s.data(), pf);
  if (!softmax_block(p, t, sc, R, kb, n, use_avx512())) return;
  if (use_avx512()) avx512::q8_pv(sc.s.data(), R, vblk, p.vst, n, p.Dv, p.G, sc.o.data());
  else q8::pv_rows(sc.s.data(), 0, R, vblk, p.vst, n, p.Dv, p.G, sc.o.data());
}

HeadKV head_kv(const Problem& p, int b, int kvh) {
  const size_t k_row = size_t(b) * p.k_batch + size_t(kvh) * p.k_head;  // the head's first row
  const size_t v_row = size_t(b) * p.v_batch + size_t(kvh) * p.v_head;
  HeadKV h;
  if (p.q8) {
    h.k8 = static_cast<const uint8_t*>(p.k) + k_row * p.kst;
    h.v8 = static_cast<const uint8_t*>(p.v) + v_row * p.vst;
  } else if (p.half) {
    h.k16 = static_cast<const uint16_t*>(p.k) + k_row * p.D;
    h.v16 = static_cast<const uint16_t*>(p.v) + v_row * p.Dv;
  } else {
    h.kf32 = static_cast<const float*>(p.k) + k_row * p.D;
    h.vf32 = static_cast<const float*>(p.v) + v_row * p.Dv;
  }
  return h;
}

// One task: rows of (b, kvh, i0..i0+nt) against keys [s0, s1); leaves the unnormalised O and
// (m, l) per row in sc.
void run_split(const Problem& p, const Split& t, Scratch& sc) {
  const int rep = p.H / p.Hk, R = rep * t.nt, D = p.D, Dv = p.Dv;
  const bool tiled = R > 8;
  const int Rp = tiled ? (R + kRowTile - 1) / kRowTile * kRowTile : R;
  begin_split(p, t, sc, tiled);
  // Keys any row of the tile can see.
  int klo = t.s0, khi = t.s1;
  if (p.mode == 1) {
    int lo0, hi0, lo1, hi1;
    causal_range(p, t.i0, lo0, hi0);
    causal_range(p, t.i0 + t.nt - 1, lo1, hi1);
    klo = std::max(klo, lo0);
    khi = std::min(khi, hi1);
  }
  const HeadKV h = head_kv(p, t.b, t.kvh);
  if (tiled && (p.half || p.q8)) {
    sc.kf.resize(size_t(kBlock) * D);
    sc.vf.resize(size_t(kBlock) * Dv);
  }
  if (tiled) sc.kt.resize(size_t(kBlock) * D);
  int pf_next = klo;  // the decode prefetch cursor (attention_tiles.h)
  for (int kb = klo; kb < khi; kb += kBlock) {
    const int n = std::min(kBlock, khi - kb);
    if (tiled) {
      // float16 K/V are widened once per block (every row group re-reads them).
      const float* kblk = h.kf32 + size_t(kb) * D;
      if (p.half) {
        widen(h.k16 + size_t(kb) * D, sc.kf.data(), n * D);
        kblk = sc.kf.data();
      } else if (p.q8) {
        widen_q8(h.k8 + size_t(kb) * p.kst, p.kst, n, D, p.G, sc.kf.data());
        kblk = sc.kf.data();
      }
      transpose_block(kblk, n, D, sc.kt.data());
      if (use_avx512()) avx512::scores_tiled(sc.q.data(), Rp, sc.kt.data(), kBlock, (n + 15) & ~15, D, sc.s.data());
      else scores_tiled(sc.q.data(), Rp, sc.kt.data(), n, D, sc.s.data());
      if (!softmax_block(p, t, sc, R, kb, n, use_avx512())) continue;
      if (p.half || p.q8) {
        if (p.half) widen(h.v16 + size_t(kb) * Dv, sc.vf.data(), n * Dv);
        else widen_q8(h.v8 + size_t(kb) * p.vst, p.vst, n, Dv, p.G, sc.vf.data());
        pv(sc, R, static_cast<const float*>(sc.vf.data()), n, Dv, true);
      } else {
        pv(sc, R, h.vf32 + size_t(kb) * Dv, n, Dv, true);
      }
      continue;
    }
    // Decode: float16 / 8-bit K/V widened in registers as they are read.
    if (p.q8) {
      const uint8_t* kblk = h.k8 + size_t(kb) * p.kst;
      const uint8_t* vblk = h.v8 + size_t(kb) * p.vst;
      const Prefetch pf{reinterpret_cast<const char*>(kblk), p.kst, reinterpret_cast<const char*>(vblk), p.vst, kb, khi, &pf_next};
      decode_block_q8(p, t, sc, R, kb, n, kblk, vblk, pf);
      continue;
    }
    const size_t es = p.half ? 2 : 4;  // bytes per K/V element
    const char* kbase = p.half ? reinterpret_cast<const char*>(h.k16) : reinterpret_cast<const char*>(h.kf32);
    const char* vbase = p.half ? reinterpret_cast<const char*>(h.v16) : reinterpret_cast<const char*>(h.vf32);
    const Prefetch pf{kbase + size_t(kb) * D * es, D * es, vbase + size_t(kb) * Dv * es, Dv * es, kb, khi, &pf_next};
    if (p.half) decode_block(p, t, sc, R, kb, n, h.k16 + size_t(kb) * D, h.v16 + size_t(kb) * Dv, pf);
    else decode_block(p, t, sc, R, kb, n, h.kf32 + size_t(kb) * D, h.vf32 + size_t(kb) * Dv, pf);
  }
}

// One output row from its key splits' (m, l, O) -- split sp's at part + sp * step -- merged
// in split order (a split that saw no key is skipped).
void merge_row(const float* part, size_t step, int n_splits, int Dv, float* dst) {
  float M = kNegInf;
  for (int sp = 0; sp < n_splits; ++sp) M = std::max(M, part[size_t(sp) * step]);
  std::fill(dst, dst + Dv, 0.0f);
  if (M == kNegInf) return;
  float l = 0.0f;
  for (int sp = 0; sp < n_splits; ++sp) {
    const float* src = part + size_t(sp) * step;
    if (src[0] == kNegInf) continue;
    const float w = std::exp(src[0] - M);
    l += w * src[1];
    for (int d = 0; d < Dv; ++d) dst[d] += w * src[2 + d];
  }
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  for (int d = 0; d < Dv; ++d) dst[d] *= inv;
}

// A task's rows (sc, R of them) as final outputs (one key split) or as its (m, l, O) parts.
void finish_rows(const Problem& p, const Split& t, const Scratch& sc, int R, float* part) {
  const int rep = p.H / p.Hk;
  for (int r = 0; r < R; ++r) {
    const float* o = sc.o.data() + size_t(r) * p.Dv;
    if (part) {
      float* dst = part + size_t(r) * (p.Dv + 2);
      dst[0] = sc.m[r];
      dst[1] = sc.l[r];
      std::copy(o, o + p.Dv, dst + 2);
      continue;
    }
    float* dst = out_row(p, t.b, t.kvh * rep + r / t.nt, t.i0 + r % t.nt);
    const float inv = sc.l[r] > 0.0f ? 1.0f / sc.l[r] : 0.0f;
    for (int d = 0; d < p.Dv; ++d) dst[d] = o[d] * inv;
  }
}

void run_flash(const Problem& p) {
  if (p.mode == 1 && p.window == 0 && p.L > 1 && attn_rows_on()) {
    run_flash_rows(p);
    return;
  }
  const int rep = p.H / p.Hk;
  const int nt_max = std::max(1, std::min(p.L, kTileRows / rep));
  const int n_tiles = (p.L + nt_max - 1) / nt_max;
  // A key mask shared by every query ends the key range at its last valid key.
  std::vector<int> s_end(p.B, p.S);
  if (p.mode == 2 && p.Lm == 1) {
    for (int b = 0; b < p.B; ++b) {
      const float* mr = p.mask + size_t(p.Bm == 1 ? 0 : b) * p.S;
      int e = p.S;
      while (e > 0 && mr[e - 1] == kNegInf) --e;
      s_end[b] = e;
    }
  }
  const int groups = p.B * p.Hk * n_tiles;
  const int max_blocks = (*std::max_element(s_end.begin(), s_end.end()) + kBlock - 1) / kBlock;
  // The split count depends on one batch row's problem, never on B: a row of a batch (or a
  // speculative verify run as L single-query rows) then splits its keys exactly as the same
  // row alone in a decode step does, and gets the step's bits.
  const int row_groups = p.Hk * n_tiles;
  const int n_splits = key_splits(row_groups, max_blocks);
  std::vector<Split> tasks;
  tasks.reserve(size_t(groups) * n_splits);
  for (int b = 0; b < p.B; ++b)
    for (int kvh = 0; kvh < p.Hk; ++kvh)
      for (int ti = 0; ti < n_tiles; ++ti) {
        const int i0 = ti * nt_max, nt = std::min(nt_max, p.L - i0);
        const int blocks = (s_end[b] + kBlock - 1) / kBlock;
        const int per = (blocks + n_splits - 1) / n_splits;
        for (int sp = 0; sp < n_splits; ++sp) {
          const int s0 = std::min(s_end[b], sp * per * kBlock);
          const int s1 = std::min(s_end[b], (sp + 1) * per * kBlock);
          tasks.push_back({b, kvh, i0, nt, s0, s1});
        }
      }
  const int R_max = rep * nt_max;
  // Per split: (m, l, O) for every row; only used when the keys are split. Kept with the
  // calling thread (no allocation and zero fill per call: every entry read is written first).
  thread_local std::vector<float> kept_part;
  std::vector<float>& part = kept_part;  // the caller's: on a pool thread the name is that thread's
  const size_t part_stride = size_t(R_max) * (p.Dv + 2);
  if (n_splits > 1 && part.size() < tasks.size() * part_stride) part.resize(tasks.size() * part_stride);
  size_t work = 0;
  for (const Split& t : tasks) work += size_t(rep) * t.nt * size_t(t.s1 - t.s0);
  const bool inline_ = work * size_t(p.D + p.Dv) < kInlineWork;
  auto run = [inline_](int n, const std::function<void(int)>& fn) {
    if (inline_) {
      for (int i = 0; i < n; ++i) fn(i);
    } else {
      Pool::get().run(n, fn);
    }
  };
  run(int(tasks.size()), [&](int ti) {
    thread_local Scratch sc;
    const Split& t = tasks[ti];
    run_split(p, t, sc);
    finish_rows(p, t, sc, rep * t.nt, n_splits > 1 ? part.data() + size_t(ti) * part_stride : nullptr);
  });
  if (n_splits == 1) return;
  // Merge the splits of each (b, kvh, tile): splits are consecutive in `tasks`.
  run(groups, [&](int g) {
    const Split& t = tasks[size_t(g) * n_splits];
    const int R = rep * t.nt;
    for (int r = 0; r < R; ++r)
      merge_row(part.data() + size_t(g) * n_splits * part_stride + size_t(r) * (p.Dv + 2), part_stride, n_splits,
                p.Dv, out_row(p, t.b, t.kvh * rep + r / t.nt, t.i0 + r % t.nt));
  });
}

// The causal prompt rows' decode tiles (attention_rows.cpp) run decode_block on float K/V.
template void decode_block_rows<float>(const Problem&, const Split*, Scratch*, int, int, int, int, const float*,
                                       const float*);
template void decode_block_rows<uint16_t>(const Problem&, const Split*, Scratch*, int, int, int, int,
                                          const uint16_t*, const uint16_t*);
template void decode_scores<float>(const Problem&, Scratch&, int, int, const float*, const Prefetch&);
template void decode_scores<uint16_t>(const Problem&, Scratch&, int, int, const uint16_t*, const Prefetch&);
template void decode_pv<float>(const Problem&, const Split&, Scratch&, int, int, int, const float*);
template void decode_pv<uint16_t>(const Problem&, const Split&, Scratch&, int, int, int, const uint16_t*);
template void decode_block<float>(const Problem&, const Split&, Scratch&, int, int, int, const float*, const float*,
                                  const Prefetch&);

}  // namespace attn

bool decode512_on() { return attn::use_avx512() && attn::decode512_switch().load(std::memory_order_relaxed); }
bool set_decode512(bool on) { return attn::decode512_switch().exchange(on); }

}  // namespace mlxterm
