// Decode-sized attention scores with 512-bit vectors (flags set in CMakeLists.txt; attention.cpp
// calls them when ops.cpp's best_isa() allows it).
//
// Why: the AVX2 decode tiles (attention.cpp: score_rows) hold one key per ymm accumulator and
// end every score with hadd8's tree of 6 vhaddps; at batched decode (8 rows x ~300 keys) that
// tile was ~45% of the attention's CPU. Here a zmm holds two keys side by side (lanes 0-7 key
// t, lanes 8-15 key t + 1, each with q's 8 dims broadcast into both halves), so a d-step is half
// the FMA and conversion instructions, and 8 keys' trees share 3 in-lane pair sums.
// Same bits as the AVX2 tiles: lane j of a key's half sums the products of dims j, j + 8, ...
// in order (fma(q, k, acc)), and the tree adds (l0 + l1) + (l2 + l3) and (l4 + l5) + (l6 + l7),
// then the two -- hadd8's order for every slot (tests/test_attention_kernel.py compares the
// instruction sets bit for bit).
#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "attention_tiles.h"

namespace mlxterm::avx512 {

namespace {

// Dims [d, d + 8) of keys a and b as one zmm (a in lanes 0-7, b in lanes 8-15), as float.
inline __m512 key_pair(const float* a, const float* b) {
  const __m512d lo = _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a)));
  return _mm512_castpd_ps(_mm512_insertf64x4(lo, _mm256_castps_pd(_mm256_loadu_ps(b)), 1));
}
inline __m512 key_pair(const uint16_t* a, const uint16_t* b) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

// Per 128-bit lane [a0 + a1, a2 + a3, b0 + b1, b2 + b3]: vhaddps's pairs, 16 lanes wide.
inline __m512 hadd16(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

// The 8 scores of keys c..c+7 from their pair accumulators (keys 2i, 2i + 1 in acc[i]).
inline __m256 reduce8(const __m512* acc) {
  const __m512 u = hadd16(hadd16(acc[0], acc[1]), hadd16(acc[2], acc[3]));
  // 128-bit lane 0: even keys' (l0 + l1) + (l2 + l3); 1: their (l4 + l5) + (l6 + l7); 2, 3: odd keys.
  const __m512 lo = _mm512_shuffle_f32x4(u, u, _MM_SHUFFLE(2, 0, 2, 0));
  const __m512 hi = _mm512_shuffle_f32x4(u, u, _MM_SHUFFLE(3, 1, 3, 1));
  const __m256 s = _mm512_castps512_ps256(_mm512_add_ps(lo, hi));  // k0 k2 k4 k6 k1 k3 k5 k7
  return _mm256_permutexvar_ps(_mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), s);
}

// s[u][c..] = q[u] . K[c] for RT rows given by pointers and keys [0, n), 8 keys per tile (keys
// past n read key n - 1; their scores land in the row's kAttnBlock slots past n, never read).
// The decode passes one position's heads; the causal prompt rows up to 6 rows of several
// positions, each key's loads and conversions shared by all of them. ``pf``: the decode's
// prefetch of the next blocks (one row tile per call issues it), or none.
template <int RT, typename T>
void score_tile(const float* const* q, float* const* s, const T* K, int n, int D, const Prefetch* pf) {
  for (int c = 0; c < n; c += 8) {
    if (pf) prefetch_tile(*pf, c), prefetch_tile(*pf, c + 4);
    const T* k[8];
    for (int t = 0; t < 8; ++t) k[t] = K + size_t(std::min(c + t, n - 1)) * D;
    __m512 acc[RT][4];
    for (auto& row : acc)
      for (auto& a : row) a = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 8) {
      __m512 kv[4];
      for (int j = 0; j < 4; ++j) kv[j] = key_pair(k[2 * j] + d, k[2 * j + 1] + d);
      for (int u = 0; u < RT; ++u) {
        const __m512 a = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(q[u] + d))));
        for (int j = 0; j < 4; ++j) acc[u][j] = _mm512_fmadd_ps(a, kv[j], acc[u][j]);
      }
    }
    for (int u = 0; u < RT; ++u) _mm256_storeu_ps(s[u] + c, reduce8(acc[u]));
  }
}

// score_tile over rows [r0, r0 + RT) of Q (row stride D) into s (row stride kAttnBlock).
template <int RT, typename T>
void score_rows_at(const float* Q, int r0, const T* K, int n, int D, float* s, const Prefetch& pf) {
  const float* q[RT];
  float* out[RT];
  for (int u = 0; u < RT; ++u) q[u] = Q + size_t(r0 + u) * D, out[u] = s + size_t(r0 + u) * kAttnBlock;
  score_tile<RT>(q, out, K, n, D, r0 == 0 ? &pf : nullptr);
}

template <typename T>
void scores_impl(const float* Q, int R, const T* K, int n, int D, float* s, const Prefetch& pf) {
  int r = 0;
  for (; r + 3 <= R; r += 3) score_rows_at<3>(Q, r, K, n, D, s, pf);
  if (R - r == 2) score_rows_at<2>(Q, r, K, n, D, s, pf);
  if (R - r == 1) score_rows_at<1>(Q, r, K, n, D, s, pf);
}

template <typename T>
void scores_rows_impl(const float* const* q, float* const* s, int rows, const T* K, int n, int D) {
  int r = 0;
  for (; r + 6 <= rows; r += 6) score_tile<6>(q + r, s + r, K, n, D, nullptr);
  switch (rows - r) {
    case 5: score_tile<5>(q + r, s + r, K, n, D, nullptr); break;
    case 4: score_tile<4>(q + r, s + r, K, n, D, nullptr); break;
    case 3: score_tile<3>(q + r, s + r, K, n, D, nullptr); break;
    case 2: score_tile<2>(q + r, s + r, K, n, D, nullptr); break;
    case 1: score_tile<1>(q + r, s + r, K, n, D, nullptr); break;
    default: break;
  }
}

}  // namespace

void scores_rows(const float* const* q, float* const* s, int rows, const float* K, int n, int D) {
  scores_rows_impl(q, s, rows, K, n, D);
}
void scores_rows(const float* const* q, float* const* s, int rows, const uint16_t* K, int n, int D) {
  scores_rows_impl(q, s, rows, K, n, D);
}

void scores_decode(const float* Q, int R, const float* K, int n, int D, float* s, const Prefetch& pf) {
  scores_impl(Q, R, K, n, D, s, pf);
}
void scores_decode(const float* Q, int R, const uint16_t* K, int n, int D, float* s, const Prefetch& pf) {
  scores_impl(Q, R, K, n, D, s, pf);
}

}  // namespace mlxterm::avx512
