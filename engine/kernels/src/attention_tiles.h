// The fused attention's many-query register tiles built for wider instruction sets in their
// own files (attention_avx512.cpp), chosen at run time by attention.cpp.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mlxterm {

constexpr int kAttnBlock = 128;  // keys per block (score rows are kAttnBlock floats apart)

constexpr int kAttnRowTile = 6;  // query rows per register tile (every ISA: same grouping)

namespace avx512 {
// s[r][c] = Q[r] . Kt[:, c] for rows [0, Rp) (Rp % 6 == 0) and keys [0, npad) (npad % 16 == 0);
// Kt is D x kstride (transposed K block), s has row stride kstride.
void scores_tiled(const float* Q, int Rp, const float* Kt, int kstride, int npad, int D, float* s);
// O[r] += P[r] @ V for rows [0, R6) (R6 % 6 == 0), keys [0, n), Dv % 16 == 0.
void pv_tiled(const float* P, int pstride, int R6, const float* V, int n, int Dv, float* O);
// s[c] = exp(s[c] - m) for c in [0, n) (n % 8 == 0, s[c] <= m), with vmath.h's exp_neg
// arithmetic lane for lane (same values as the AVX2 loop).
void exp_shifted(float* s, int n, float m);
// q8 decode (attention_q8.inc): scores with VNNI dot products, P @ V 16 lanes wide; the same
// bits as the AVX2 versions.
void q8_scores(const int8_t* Qi, const float* Qs, int R, const uint8_t* K, size_t stride, int n, int D, int G,
               float* s);
void q8_pv(const float* P, int R, const uint8_t* V, size_t stride, int n, int Dv, int G, float* O);
}  // namespace avx512

}  // namespace mlxterm
