// The fused attention's many-query register tiles built for wider instruction sets in their
// own files (attention_avx512.cpp), chosen at run time by attention.cpp.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace mlxterm {

constexpr int kAttnBlock = 128;  // keys per block (score rows are kAttnBlock floats apart)

constexpr int kAttnRowTile = 6;  // query rows per register tile (every ISA: same grouping)

// Software prefetch of decode's K/V streams. Why: at 8k keys a decode step streams every
// layer's K/V from memory (fp16: 184 MB per SmolLM2 token) and, without it, the cores waited
// for those lines instead of computing meanwhile: 30 layers' attention took the hot-cache
// compute time *plus* the streaming time. While a K block's scores run, each 4-key tile asks
// for the K and V rows kPrefetchRows ahead into L2 (A/B, 30 layers x 8000 fp16 keys, CPU ms:
// 26.3 without, 26.4-27.7 for K ahead + this block's V into L1, 24.1-24.6 this way). Prefetches
// never change a result. 1024 rows ahead since round 7 (2-core Zen 4, ~18 GB/s read on one
// core, ~33 on two): the streamed fp16 op, 2 threads, 30 layers x 8000 keys, median of 6 runs each
// alternating, 0.359 ms at 256 rows -> 0.309 at 1024 (-14%); q8 0.304 -> 0.300 (same); the
// hint T1 beat T0 and NTA there.
constexpr int kPrefetchRows = 1024;

struct Prefetch {
  const char* k = nullptr;  // this block's first K row (null: no prefetch)
  size_t kst = 0;           // bytes per K row
  const char* v = nullptr;  // this block's first V row
  size_t vst = 0;           // bytes per V row
};

inline void prefetch_bytes(const char* p, size_t bytes) {
  for (size_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
}

// The lines of K and V rows [c + kPrefetchRows, ... + 4), into L2.
inline void prefetch_tile(const Prefetch& pf, int c) {
  if (!pf.k) return;
  prefetch_bytes(pf.k + size_t(c + kPrefetchRows) * pf.kst, 4 * pf.kst);
  prefetch_bytes(pf.v + size_t(c + kPrefetchRows) * pf.vst, 4 * pf.vst);
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
