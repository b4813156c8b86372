// The fused attention's many-query register tiles with 512-bit vectors (flags set in
// CMakeLists.txt; chosen at run time by attention.cpp when ops.cpp's best_isa() allows it).
// Same arithmetic as the AVX2 tiles in attention.cpp: every score is one FMA chain over d and
// every output element one FMA chain over the keys, in the same order, so both give the same
// bits; only more of them run per instruction (6 rows x 64 keys / 64 value columns).
#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "attention_tiles.h"

namespace mlxterm::avx512 {

namespace {

// s[r][c] for rows [r0, r0 + 6) and keys [c, c + 16 * NC).
template <int NC>
inline void score_tile(const float* q, int D, const float* Kt, int kstride, float* s, int sstride) {
  __m512 acc[kAttnRowTile][NC];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (int d = 0; d < D; ++d) {
    __m512 k[NC];
    for (int j = 0; j < NC; ++j) k[j] = _mm512_loadu_ps(Kt + size_t(d) * kstride + 16 * j);
    for (int t = 0; t < kAttnRowTile; ++t) {
      const __m512 b = _mm512_set1_ps(q[size_t(t) * D + d]);
      for (int j = 0; j < NC; ++j) acc[t][j] = _mm512_fmadd_ps(b, k[j], acc[t][j]);
    }
  }
  for (int t = 0; t < kAttnRowTile; ++t)
    for (int j = 0; j < NC; ++j) _mm512_storeu_ps(s + size_t(t) * sstride + 16 * j, acc[t][j]);
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// O[t][c0 + 16 NC columns] += sum_c P[t][c] V[c][...] for RT rows given by pointers:
// attention.cpp's chain per element (fma(p, v, acc) over the keys in order), 16 lanes per
// instruction, each V row's loads and conversions shared by the RT rows. Prefill tiles (6
// rows, float V), decode rows and the causal prompt rows' several positions (float or
// float16 V) share it.
template <int RT, int NC, typename T>
inline void pv_tile(const float* const* P, const T* V, int n, int Dv, float* const* O, int c0) {
  __m512 acc[RT][NC];
  for (int t = 0; t < RT; ++t)
    for (int j = 0; j < NC; ++j) acc[t][j] = _mm512_loadu_ps(O[t] + c0 + 16 * j);
  for (int c = 0; c < n; ++c) {
    __m512 v[NC];
    for (int j = 0; j < NC; ++j) v[j] = load16(V + size_t(c) * Dv + c0 + 16 * j);
    for (int t = 0; t < RT; ++t) {
      const __m512 p = _mm512_set1_ps(P[t][c]);
      for (int j = 0; j < NC; ++j) acc[t][j] = _mm512_fmadd_ps(p, v[j], acc[t][j]);
    }
  }
  for (int t = 0; t < RT; ++t)
    for (int j = 0; j < NC; ++j) _mm512_storeu_ps(O[t] + c0 + 16 * j, acc[t][j]);
}

// pv_tile over all Dv columns: 64 at a time, then the 16-column rest.
template <int RT, typename T>
inline void pv_columns(const float* const* P, const T* V, int n, int Dv, float* const* O) {
  int c0 = 0;
  for (; c0 + 64 <= Dv; c0 += 64) pv_tile<RT, 4>(P, V, n, Dv, O, c0);
  switch ((Dv - c0) / 16) {
    case 3: pv_tile<RT, 3>(P, V, n, Dv, O, c0); break;
    case 2: pv_tile<RT, 2>(P, V, n, Dv, O, c0); break;
    case 1: pv_tile<RT, 1>(P, V, n, Dv, O, c0); break;
    default: break;
  }
}

// pv_columns for RT rows of P and O stored pstride and Dv apart.
template <int RT, typename T>
inline void pv_columns_at(const float* P, int pstride, const T* V, int n, int Dv, float* O) {
  const float* p[RT];
  float* o[RT];
  for (int t = 0; t < RT; ++t) p[t] = P + size_t(t) * pstride, o[t] = O + size_t(t) * Dv;
  pv_columns<RT>(p, V, n, Dv, o);
}

// vmath.h's exp_neg, 16 lanes: the same operations per element.
inline __m512 exp_neg16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 valid = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(valid, _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
}

}  // namespace

void exp_shifted(float* s, int n, float m) {
  const __m512 vm = _mm512_set1_ps(m);
  int c = 0;
  for (; c + 16 <= n; c += 16) _mm512_storeu_ps(s + c, exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(s + c), vm)));
  if (c < n) {  // 8 left
    const __mmask16 k = 0xFF;
    _mm512_mask_storeu_ps(s + c, k, exp_neg16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + c), vm)));
  }
}

void scores_tiled(const float* Q, int Rp, const float* Kt, int kstride, int npad, int D, float* s) {
  for (int r = 0; r < Rp; r += kAttnRowTile) {
    const float* q = Q + size_t(r) * D;
    float* srow = s + size_t(r) * kstride;
    int c = 0;
    for (; c + 64 <= npad; c += 64) score_tile<4>(q, D, Kt + c, kstride, srow + c, kstride);
    switch ((npad - c) / 16) {
      case 3: score_tile<3>(q, D, Kt + c, kstride, srow + c, kstride); break;
      case 2: score_tile<2>(q, D, Kt + c, kstride, srow + c, kstride); break;
      case 1: score_tile<1>(q, D, Kt + c, kstride, srow + c, kstride); break;
      default: break;
    }
  }
}

void pv_tiled(const float* P, int pstride, int R6, const float* V, int n, int Dv, float* O) {
  for (int r = 0; r < R6; r += kAttnRowTile)
    pv_columns_at<kAttnRowTile>(P + size_t(r) * pstride, pstride, V, n, Dv, O + size_t(r) * Dv);
}

namespace {
template <typename T>
void pv_decode_impl(const float* P, int R, const T* V, int n, int Dv, float* O) {
  int r = 0;
  for (; r + 4 <= R; r += 4) pv_columns_at<4>(P + size_t(r) * kAttnBlock, kAttnBlock, V, n, Dv, O + size_t(r) * Dv);
  const float* p = P + size_t(r) * kAttnBlock;
  float* o = O + size_t(r) * Dv;
  switch (R - r) {
    case 3: pv_columns_at<3>(p, kAttnBlock, V, n, Dv, o); break;
    case 2: pv_columns_at<2>(p, kAttnBlock, V, n, Dv, o); break;
    case 1: pv_columns_at<1>(p, kAttnBlock, V, n, Dv, o); break;
    default: break;
  }
}
template <typename T>
void pv_rows_impl(const float* const* P, int rows, const T* V, int n, int Dv, float* const* O) {
  int r = 0;
  for (; r + 6 <= rows; r += 6) pv_columns<6>(P + r, V, n, Dv, O + r);
  switch (rows - r) {
    case 5: pv_columns<5>(P + r, V, n, Dv, O + r); break;
    case 4: pv_columns<4>(P + r, V, n, Dv, O + r); break;
    case 3: pv_columns<3>(P + r, V, n, Dv, O + r); break;
    case 2: pv_columns<2>(P + r, V, n, Dv, O + r); break;
    case 1: pv_columns<1>(P + r, V, n, Dv, O + r); break;
    default: break;
  }
}
}  // namespace

void pv_rows(const float* const* P, int rows, const float* V, int n, int Dv, float* const* O) {
  pv_rows_impl(P, rows, V, n, Dv, O);
}
void pv_rows(const float* const* P, int rows, const uint16_t* V, int n, int Dv, float* const* O) {
  pv_rows_impl(P, rows, V, n, Dv, O);
}

void pv_decode(const float* P, int R, const float* V, int n, int Dv, float* O) { pv_decode_impl(P, R, V, n, Dv, O); }
void pv_decode(const float* P, int R, const uint16_t* V, int n, int Dv, float* O) {
  pv_decode_impl(P, R, V, n, Dv, O);
}

namespace {
// 16 x 16 int32 transpose: rows a[i] (one key's 16 dwords) -> a[j] lane i = key i's dword j.
// Four shuffle stages (64 shuffles), shared by every query row scored against these keys.
inline void transpose16(__m512i a[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(a[i], a[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(a[i], a[i + 1]);
  }
  __m512i u[16];  // u[4q + k], 128-bit lane L: keys 4q..4q+3, dword 4L + k
  for (int q = 0; q < 4; ++q) {
    u[4 * q + 0] = _mm512_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
    u[4 * q + 1] = _mm512_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
    u[4 * q + 2] = _mm512_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
    u[4 * q + 3] = _mm512_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // 4 x 4 transpose of 128-bit lanes
    const __m512i y0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x44), y1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xEE);
    const __m512i y2 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x44),
                  y3 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xEE);
    a[k] = _mm512_shuffle_i32x4(y0, y2, 0x88);
    a[4 + k] = _mm512_shuffle_i32x4(y0, y2, 0xDD);
    a[8 + k] = _mm512_shuffle_i32x4(y1, y3, 0x88);
    a[12 + k] = _mm512_shuffle_i32x4(y1, y3, 0xDD);
  }
}

// Scale of group g of 16 rows (`stride` bytes apart from `scale0`) as one vector. Scalar
// loads: vgatherdps measured slower here than the loads it replaces.
inline __m512 scales16(const uint8_t* scale0, size_t stride, int nk) {
  alignas(64) float v[16];
  for (int i = 0; i < 16; ++i) std::memcpy(v + i, scale0 + size_t(std::min(i, nk - 1)) * stride, 4);
  return _mm512_load_ps(v);
}

// acc[t][*] += the dwords [8 H, 8 H + 8) of a (keys' transposed dims) x row t's q dwords:
// two accumulators per row (alternate dwords) so consecutive dpbusd do not wait for each other.
template <int RT, int H>
inline void q8_dots8(const __m512i a[16], const int32_t* qd, int qstride, __m512i acc[][2]) {
#pragma GCC unroll 8
  for (int j = 8 * H; j < 8 * H + 8; ++j)
    for (int t = 0; t < RT; ++t)
      acc[t][j & 1] = _mm512_dpbusd_epi32(acc[t][j & 1], a[j], _mm512_set1_epi32(qd[t * qstride + j]));
}

// Scores of RT query rows against 16 keys (rows k[0..15]), lanes = keys: the keys' 64-byte
// chunks are transposed to one dword (4 dims) of 16 keys per vector, so dpbusd runs 16 keys x
// 4 dims per instruction against q's dword broadcast, with no horizontal sums. dpbusd wants
// unsigned x signed: k ^ 0x80 = k + 128 in 0..255, so it adds k.q + 128 sum(q), and corr
// (128 sum(q) per row and group) is taken off -- the exact integer dot of the AVX2 path. Then
// the same float chain per score: f = fma(float(dot_g), qs_g * sk_g, f) over the groups.
template <int RT>
inline void q8_score_tile(const int32_t* qd, const int32_t* corr, const float* Qs, int D, int G,
                          const uint8_t* const* k, size_t stride, int nk, const uint8_t* scale0, float* s) {
  const int ng = D / G, qstride = D / 4;
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  __m512 f[RT];
  for (auto& x : f) x = _mm512_setzero_ps();
  __m512i acc[RT][2];
  int g = 0, left = G;  // current group, its dims still to add
  for (int b = 0; b < D; b += 64) {
    const bool half = D - b < 64;  // a 32-dim tail (D % 32 == 0)
    const __mmask64 lm = half ? __mmask64(0xFFFFFFFF) : ~__mmask64(0);
    __m512i a[16];
    for (int i = 0; i < 16; ++i) a[i] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(lm, k[i] + b), flip);
    transpose16(a);
    for (int h = 0; h < (half ? 1 : 2); ++h) {
      if (left == G)
        for (auto& row : acc) row[0] = row[1] = _mm512_setzero_si512();
      if (h == 0) q8_dots8<RT, 0>(a, qd + b / 4, qstride, acc);
      else q8_dots8<RT, 1>(a, qd + b / 4, qstride, acc);
      left -= 32;
      if (left == 0) {  // group done: exact dot, then the float chain
        const __m512 sk = scales16(scale0 + 4 * g, stride, nk);
        for (int t = 0; t < RT; ++t) {
          const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(acc[t][0], acc[t][1]), _mm512_set1_epi32(corr[t * ng + g]));
          f[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(_mm512_set1_ps(Qs[t * ng + g]), sk), f[t]);
        }
        ++g;
        left = G;
      }
    }
  }
  const __mmask16 keep = __mmask16((1u << nk) - 1);
  for (int t = 0; t < RT; ++t) _mm512_mask_storeu_ps(s + size_t(t) * kAttnBlock, keep, f[t]);
}
}  // namespace

void q8_scores(const int8_t* Qi, const float* Qs, int R, const uint8_t* K, size_t stride, int n, int D, int G,
               float* s, const Prefetch& pf) {
  const int ng = D / G;
  // q as dwords (4 int8 dims each) and 128 * sum(q) per row and group (the unsigned offset).
  int32_t qd[8 * 512 / 4], corr[8 * 512 / 32];
  std::memcpy(qd, Qi, size_t(R) * D);
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < ng; ++g) {
      int sum = 0;
      for (int d = g * G; d < (g + 1) * G; ++d) sum += Qi[size_t(r) * D + d];
      corr[r * ng + g] = 128 * sum;
    }
  for (int c = 0; c < n; c += 16) {
    for (int t = 0; t < 16; t += 4) prefetch_tile(pf, c + t);
    const int nk = std::min(16, n - c);
    const uint8_t* k[16];
    for (int i = 0; i < 16; ++i) k[i] = K + size_t(c + std::min(i, nk - 1)) * stride;
    const uint8_t* scale0 = K + size_t(c) * stride + D;
    for (int r = 0; r < R;) {
      const int rt = std::min(R - r, R == 4 || R > 6 ? 4 : 3);  // rows per pass (3: SmolLM2's GQA)
      const int32_t* q = qd + size_t(r) * (D / 4);
      float* sr = s + size_t(r) * kAttnBlock + c;
      switch (rt) {
        case 4: q8_score_tile<4>(q, corr + r * ng, Qs + r * ng, D, G, k, stride, nk, scale0, sr); break;
        case 3: q8_score_tile<3>(q, corr + r * ng, Qs + r * ng, D, G, k, stride, nk, scale0, sr); break;
        case 2: q8_score_tile<2>(q, corr + r * ng, Qs + r * ng, D, G, k, stride, nk, scale0, sr); break;
        default: q8_score_tile<1>(q, corr + r * ng, Qs + r * ng, D, G, k, stride, nk, scale0, sr); break;
      }
      r += rt;
    }
  }
}

namespace {
// q8::pv_chunk with NC x 16 columns per 512-bit accumulator row: same chain per element.
template <int RT, int NC>
inline void q8_pv_chunk(const float* P, const uint8_t* V, size_t stride, int n, int Dv, int G, int c0, float* O) {
  __m512 acc[RT][NC];
  for (int t = 0; t < RT; ++t)
    for (int j = 0; j < NC; ++j) acc[t][j] = _mm512_loadu_ps(O + size_t(t) * Dv + c0 + 16 * j);
  const int g = c0 / G;
  for (int c = 0; c < n; ++c) {
    const uint8_t* vr = V + size_t(c) * stride;
    float sv;
    std::memcpy(&sv, vr + Dv + 4 * g, 4);
    __m512 v[NC];
    for (int j = 0; j < NC; ++j)
      v[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vr + c0 + 16 * j))));
    for (int t = 0; t < RT; ++t) {
      const __m512 p = _mm512_set1_ps(P[size_t(t) * kAttnBlock + c] * sv);
      for (int j = 0; j < NC; ++j) acc[t][j] = _mm512_fmadd_ps(p, v[j], acc[t][j]);
    }
  }
  for (int t = 0; t < RT; ++t)
    for (int j = 0; j < NC; ++j) _mm512_storeu_ps(O + size_t(t) * Dv + c0 + 16 * j, acc[t][j]);
}

template <int RT>
inline void q8_pv_row_tile(const float* P, const uint8_t* V, size_t stride, int n, int Dv, int G, float* O) {
  int c0 = 0;
  if (G % 64 == 0)
    for (; c0 < Dv; c0 += 64) q8_pv_chunk<RT, 4>(P, V, stride, n, Dv, G, c0, O);
  for (; c0 < Dv; c0 += 32) q8_pv_chunk<RT, 2>(P, V, stride, n, Dv, G, c0, O);
}
}  // namespace

void q8_pv(const float* P, int R, const uint8_t* V, size_t stride, int n, int Dv, int G, float* O) {
  int r = 0;
  for (; r + 3 <= R; r += 3) q8_pv_row_tile<3>(P + size_t(r) * kAttnBlock, V, stride, n, Dv, G, O + size_t(r) * Dv);
  if (R - r == 2) q8_pv_row_tile<2>(P + size_t(r) * kAttnBlock, V, stride, n, Dv, G, O + size_t(r) * Dv);
  else if (R - r == 1) q8_pv_row_tile<1>(P + size_t(r) * kAttnBlock, V, stride, n, Dv, G, O + size_t(r) * Dv);
}

}  // namespace mlxterm::avx512
