// The fused attention's many-query register tiles built for wider instruction sets in their
// own files (attention_avx512.cpp), chosen at run time by attention.cpp.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace mlxterm {

constexpr int kAttnBlock = 128;  // keys per block (score rows are kAttnBlock floats apart)

constexpr int kAttnRowTile = 6;  // query rows per register tile (every ISA: same grouping)

// Software prefetch of decode's K/V streams. Why: at 8k keys a decode step streams every
// layer's K/V from memory (fp16: 184 MB per SmolLM2 token) and, without it, the cores waited
// for those lines instead of computing meanwhile: 30 layers' attention took the hot-cache
// compute time *plus* the streaming time. While a K block's scores run, each 4-key tile asks
// for K and V rows up to kPrefetchRows ahead into L2. Prefetches never change a result.
// Round 8: the prefetch follows a cursor over the split's own keys -- from its first key, at
// most kPrefetchBurst rows per 4-key tile (so it gets ahead within the first ~40 keys), never
// past the split's last key. Before, it asked for row c + 1024 unclamped: a decode split is
// ~1400 keys (18 splits at 8000 keys), so its first 1024 keys were never prefetched and most
// requests fell in the next split, which the other thread was reading at that moment.
// Streamed op (2 threads, wall, 30 layers x 8000 keys, SmolLM2 shapes, A/B alternating in one
// process, 4-12 rounds per run, load 2-4): q8 0.93 / 1.01 / 0.73 / 0.97 of the old time in
// four runs, fp16 0.86 / 0.95 / 0.87 / 0.98. 256 rows ahead was no better than 128; a ramp to
// 512-1024 rows (16-32 rows per tile) was 16-31% worse (bursts crowd the miss queue).
constexpr int kPrefetchRows = 128;
constexpr int kPrefetchBurst = 8;  // rows per 4-key tile, a multiple of 4

struct Prefetch {
  const char* k = nullptr;  // this block's first K row (null: no prefetch)
  size_t kst = 0;           // bytes per K row
  const char* v = nullptr;  // this block's first V row
  size_t vst = 0;           // bytes per V row
  int row0 = 0;             // this block's first key (the split's coordinates)
  int end = 0;              // the split's end: nothing at or past it is asked for
  int* next = nullptr;      // first key not yet asked for (shared by the split's blocks)
};

inline void prefetch_bytes(const char* p, size_t bytes) {
  for (size_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
}

// Called at the block's key c (a multiple of 4): the lines of K and V rows [*next, ...) up to
// kPrefetchRows past c and the split's end, at most kPrefetchBurst rows, into L2.
inline void prefetch_tile(const Prefetch& pf, int c) {
  if (!pf.k) return;
  const int want = std::min(pf.end, pf.row0 + c + kPrefetchRows);
  int nx = *pf.next;
  for (int b = 0; b < kPrefetchBurst && nx < want; b += 4, nx += 4) {
    prefetch_bytes(pf.k + ptrdiff_t(nx - pf.row0) * ptrdiff_t(pf.kst), 4 * pf.kst);
    prefetch_bytes(pf.v + ptrdiff_t(nx - pf.row0) * ptrdiff_t(pf.vst), 4 * pf.vst);
  }
  *pf.next = nx;
}

namespace avx512 {
// s[r][c] = Q[r] . Kt[:, c] for rows [0, Rp) (Rp % 6 == 0) and keys [0, npad) (npad % 16 == 0);
// Kt is D x kstride (transposed K block), s has row stride kstride.
void scores_tiled(const float* Q, int Rp, const float* Kt, int kstride, int npad, int D, float* s);
// O[r] += P[r] @ V for rows [0, R6) (R6 % 6 == 0), keys [0, n), Dv % 16 == 0.
void pv_tiled(const float* P, int pstride, int R6, const float* V, int n, int Dv, float* O);
// Decode-sized P @ V (rows [0, R), any R; P row stride kAttnBlock; keys [0, n); Dv % 16 == 0),
// float32 or float16 V: the AVX2 accumulate<> chains 64 columns at a time.
void pv_decode(const float* P, int R, const float* V, int n, int Dv, float* O);
void pv_decode(const float* P, int R, const uint16_t* V, int n, int Dv, float* O);
// The decode tiles' scores / value sums for rows given by pointers (several query positions'
// rows at once, up to 6 per pass: the causal prompt rows, attention_rows.cpp).
void scores_rows(const float* const* q, float* const* s, int rows, const float* K, int n, int D);
void scores_rows(const float* const* q, float* const* s, int rows, const uint16_t* K, int n, int D);
void pv_rows(const float* const* P, int rows, const float* V, int n, int Dv, float* const* O);
void pv_rows(const float* const* P, int rows, const uint16_t* V, int n, int Dv, float* const* O);
// Decode-sized scores s[r][c] = Q[r] . K[c] (rows [0, R), keys [0, n) in K's natural layout, s
// row stride kAttnBlock): the AVX2 score_rows chains and tree, two keys per zmm
// (attention_decode512.cpp).
void scores_decode(const float* Q, int R, const float* K, int n, int D, float* s, const Prefetch& pf);
void scores_decode(const float* Q, int R, const uint16_t* K, int n, int D, float* s, const Prefetch& pf);
// s[c] = exp(s[c] - m) for c in [0, n) (n % 8 == 0, s[c] <= m), with vmath.h's exp_neg
// arithmetic lane for lane (same values as the AVX2 loop).
void exp_shifted(float* s, int n, float m);
// q8 decode: scores 16 keys per vector (K transposed in registers, VNNI dpbusd, no horizontal
// sums), P @ V 16 lanes wide; the same bits as the AVX2 versions (attention_q8.inc).
void q8_scores(const int8_t* Qi, const float* Qs, int R, const uint8_t* K, size_t stride, int n, int D, int G,
               float* s, const Prefetch& pf);
void q8_pv(const float* P, int R, const uint8_t* V, size_t stride, int n, int Dv, int G, float* O);
}  // namespace avx512

}  // namespace mlxterm
