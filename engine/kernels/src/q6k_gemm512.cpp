// Q6_K matmul of several activation rows on AVX512-VNNI register tiles (q6k.h; ops.cpp sends
// rows >= 2 here where best_isa() is avx512vnni). Per 16 output columns every super-block is
// unpacked once into a VNNI panel (64 vectors of 16 columns x 4 values), then each tile of
// rows runs one vpdpbusd per 4 values of 16 columns and, per 16-value sub-block, folds in the
// offset and the scale: isum += (sub - 32 * bsum) * sc. The int32 totals are the row path's
// exact integers and the float step is the same fma(float(isum), d_w * d_x, acc) per
// super-block in order, so every output has the one-row path's bits.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "q6k.h"

namespace mlxterm {
namespace q6k512 {

namespace {

constexpr int kCols = 16;
constexpr int kSub = kQ6KValues / 16;
constexpr int kMaxTile = 6;

// One column's super-block as its 256 values (0..63) in order.
inline void unpack_column(const uint8_t* b, uint8_t* out) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
  for (int half = 0; half < 2; ++half) {
    const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half));
    const __m256i qb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half + 32));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
    __m256i v[4];
    v[0] = _mm256_or_si256(_mm256_and_si256(qa, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m2));
    v[1] = _mm256_or_si256(_mm256_and_si256(qb, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m2));
    v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), m4), _mm256_and_si256(qh, m2));
    v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qb, 4), m4), _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2));
    for (int i = 0; i < 4; ++i) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 128 * half + 32 * i), v[i]);
  }
}

// 16 x 16 int32 transpose (rows r[0..15] -> columns).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // r[4i + c]: rows 4i..4i+3, element c of each 128-bit lane group -> combine lanes across i.
  for (int c = 0; c < 4; ++c) {
    const __m512i a = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88);  // lanes 0,2 of r[c]; 0,2 of r[4+c]
    const __m512i b = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xDD);
    const __m512i e = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
    const __m512i f = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xDD);
    t[c] = _mm512_shuffle_i32x4(a, e, 0x88);       // lane 0 of every 4-row group
    t[8 + c] = _mm512_shuffle_i32x4(a, e, 0xDD);   // lane 2
    t[4 + c] = _mm512_shuffle_i32x4(b, f, 0x88);   // lane 1
    t[12 + c] = _mm512_shuffle_i32x4(b, f, 0xDD);  // lane 3
  }
  // Output column j = 4 * lane + c lives in t[4 * lane + c].
  for (int j = 0; j < 16; ++j) r[j] = t[j];
}

// The panel of 16 columns [n, n + nc) for every super-block: per super-block 64 vectors
// (4 values x 16 columns each), 16 scale vectors (int32 per column) and the 16 d_w.
struct Panel {
  std::vector<__m512i> v;  // nsb * 64
  std::vector<__m512i> sc;  // nsb * 16
  std::vector<float> dw;  // nsb * 16
};

void build_panel(const uint8_t* w, size_t row_bytes, int nsb, int n, int nc, Panel& p) {
  p.v.resize(size_t(nsb) * 64);
  p.sc.resize(size_t(nsb) * kSub);
  p.dw.resize(size_t(nsb) * kCols);
  alignas(64) uint8_t buf[kCols][kQ6KValues];
  alignas(64) int32_t sc[kSub][kCols];
  for (int s = 0; s < nsb; ++s) {
    for (int c = 0; c < kCols; ++c) {
      if (c < nc) {
        const uint8_t* b = w + size_t(n + c) * row_bytes + size_t(s) * kQ6KBlockBytes;
        unpack_column(b, buf[c]);
        const int8_t* bs = reinterpret_cast<const int8_t*>(b + 192);
        for (int j = 0; j < kSub; ++j) sc[j][c] = bs[j];
        uint16_t h;
        std::memcpy(&h, b + 208, 2);
        p.dw[size_t(s) * kCols + c] = _cvtsh_ss(h);
      } else {
        std::memset(buf[c], 0, kQ6KValues);
        for (int j = 0; j < kSub; ++j) sc[j][c] = 0;
        p.dw[size_t(s) * kCols + c] = 0.0f;
      }
    }
    for (int j = 0; j < kSub; ++j) p.sc[size_t(s) * kSub + j] = _mm512_load_si512(sc[j]);
    // buf as 16 rows of 64 dwords -> 64 vectors of 16 columns, a 16 x 16 block at a time.
    for (int q = 0; q < 4; ++q) {
      __m512i r[16];
      for (int c = 0; c < kCols; ++c) r[c] = _mm512_load_si512(buf[c] + 64 * q);
      transpose16(r);
      for (int j = 0; j < 16; ++j) p.v[size_t(s) * 64 + 16 * q + j] = r[j];
    }
  }
}

// 16 super-block totals as floats: int32 lanes, or q6k_join16 of the two parts.
inline __m512 join16(__m512i hi, __m512i lo) {
  const __m512d k = _mm512_set1_pd(128.0);
  const __m512d a = _mm512_add_pd(_mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(hi)), k),
                                  _mm512_cvtepi32_pd(_mm512_castsi512_si256(lo)));
  const __m512d b = _mm512_add_pd(_mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(hi, 1)), k),
                                  _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(lo, 1)));
  const __m256 fa = _mm512_cvtpd_ps(a), fb = _mm512_cvtpd_ps(b);
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(fa)), _mm256_castps_pd(fb), 1));
}

// One sub-block's dots of R rows (x: their int8 parts) over the panel, the offset and scale
// folded in: isum[r] += (sum - 32 * bsum) * sc.
template <int R>
__attribute__((always_inline)) inline void sub_block(const __m512i* P, const int8_t* const* x, size_t k0,
                                                     const int16_t* const* bsum, size_t b0, __m512i scv, __m512i* isum) {
  __m512i sub[R];
  for (int r = 0; r < R; ++r) sub[r] = _mm512_setzero_si512();
  for (int g = 0; g < 4; ++g) {
    const __m512i wv = P[g];
    for (int r = 0; r < R; ++r) {
      int32_t xv;
      std::memcpy(&xv, x[r] + k0 + 4 * g, 4);
      sub[r] = _mm512_dpbusd_epi32(sub[r], wv, _mm512_set1_epi32(xv));
    }
  }
  for (int r = 0; r < R; ++r) {
    const int32_t off = 32 * int32_t(bsum[r][b0]);
    isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(_mm512_sub_epi32(sub[r], _mm512_set1_epi32(off)), scv));
  }
}

template <int R, bool X16>
void tile(const Panel& p, const Q6KActs& a, int K, int nsb, int m0, int N, int n, int nc, float* out) {
  __m512 acc[R];
  const int8_t* x[R];
  const int8_t* xl[R];
  const int16_t* bs[R];
  const int16_t* bl[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
    x[r] = a.q.data() + size_t(m0 + r) * K;
    bs[r] = a.bsum.data() + size_t(m0 + r) * nsb * kSub;
    xl[r] = X16 ? a.lo.data() + size_t(m0 + r) * K : nullptr;
    bl[r] = X16 ? a.bsum_lo.data() + size_t(m0 + r) * nsb * kSub : nullptr;
  }
  for (int s = 0; s < nsb; ++s) {
    const __m512i* P = p.v.data() + size_t(s) * 64;
    __m512i isum[R], ilo[R];
    for (int r = 0; r < R; ++r) isum[r] = ilo[r] = _mm512_setzero_si512();
    for (int j = 0; j < kSub; ++j) {
      const __m512i scv = p.sc[size_t(s) * kSub + j];
      const size_t k0 = size_t(s) * kQ6KValues + 16 * j, b0 = size_t(s) * kSub + j;
      sub_block<R>(P + 4 * j, x, k0, bs, b0, scv, isum);
      if constexpr (X16) sub_block<R>(P + 4 * j, xl, k0, bl, b0, scv, ilo);
    }
    const __m512 dw = _mm512_loadu_ps(p.dw.data() + size_t(s) * kCols);
    for (int r = 0; r < R; ++r) {
      const __m512 v = X16 ? join16(isum[r], ilo[r]) : _mm512_cvtepi32_ps(isum[r]);
      acc[r] = _mm512_fmadd_ps(v, _mm512_mul_ps(dw, _mm512_set1_ps(a.d[size_t(m0 + r) * nsb + s])), acc[r]);
    }
  }
  const __mmask16 mask = nc >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << nc) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + size_t(m0 + r) * N + n, mask, acc[r]);
}

template <bool X16>
void tiles(const Panel& panel, const Q6KActs& a, int M, int K, int nsb, int N, int n, int nc, float* out) {
  // Rows in tiles of at most kMaxTile, sizes within one of each other.
  const int count = (M + kMaxTile - 1) / kMaxTile;
  int m = 0;
  for (int t = 0; t < count; ++t) {
    const int R = (M - m) / (count - t) + ((M - m) % (count - t) ? 1 : 0);
    switch (R) {
      case 1: tile<1, X16>(panel, a, K, nsb, m, N, n, nc, out); break;
      case 2: tile<2, X16>(panel, a, K, nsb, m, N, n, nc, out); break;
      case 3: tile<3, X16>(panel, a, K, nsb, m, N, n, nc, out); break;
      case 4: tile<4, X16>(panel, a, K, nsb, m, N, n, nc, out); break;
      case 5: tile<5, X16>(panel, a, K, nsb, m, N, n, nc, out); break;
      default: tile<6, X16>(panel, a, K, nsb, m, N, n, nc, out); break;
    }
    m += R;
  }
}

}  // namespace

void columns(const uint8_t* w, const Q6KActs& a, int M, int K, int N, float* out, int n0, int n1) {
  const int nsb = K / kQ6KValues;
  const size_t row_bytes = size_t(nsb) * kQ6KBlockBytes;
  thread_local Panel panel;
  for (int n = n0; n < n1; n += kCols) {
    const int nc = std::min(kCols, n1 - n);
    build_panel(w, row_bytes, nsb, n, nc, panel);
    (a.x16 ? tiles<true> : tiles<false>)(panel, a, M, K, nsb, N, n, nc, out);
  }
}

}  // namespace q6k512
}  // namespace mlxterm
