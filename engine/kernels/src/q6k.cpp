// Q6_K matmul (q6k.h). AVX2 (the baseline every dispatched CPU has): a block's 6-bit values are
// put together from their nibble and 2-bit planes in registers and multiplied with the int8
// activations by maddubs (u8 x s8 pairs, at most 2 * 63 * 127: no saturation), the pairs by
// madd with the sub-block scales -- the same two instructions per 32 products as llama.cpp's
// q6_K dot. VNNI's vpdpbusd would need a multiply by the scale per lane afterwards: no gain.
#include "q6k.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "ops.h"

namespace mlxterm {

namespace {

constexpr int kSubBlocks = kQ6KValues / 16;

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// ---- activations ----

// One row's super-blocks: q (and with x16 lo) and their 16-value sums; qmax 127 or 16256.
struct RowOut {
  int8_t* q;
  int8_t* lo;  // x16 only
  float* d;
  int16_t* bsum;
  int16_t* bsum_lo;  // x16 only
};

void prepare_row_reference(const float* x, int K, bool x16, const RowOut& o) {
  const int qmax = x16 ? 16256 : 127;
  for (int s = 0; s < K / kQ6KValues; ++s) {
    const float* xs = x + size_t(s) * kQ6KValues;
    float amax = 0.0f;
    for (int k = 0; k < kQ6KValues; ++k) amax = std::max(amax, std::fabs(xs[k]));
    const float id = amax > 0.0f ? float(qmax) / amax : 0.0f;
    o.d[s] = amax / float(qmax);
    int8_t* qs = o.q + size_t(s) * kQ6KValues;
    int8_t* ls = x16 ? o.lo + size_t(s) * kQ6KValues : nullptr;
    for (int k = 0; k < kQ6KValues; ++k) {
      const int v = std::clamp(int(std::nearbyint(xs[k] * id)), -qmax, qmax);
      if (x16) {
        const int hi = (v + 64) >> 7;  // floor: v = 128 hi + lo, lo in [-64, 63]
        qs[k] = int8_t(hi);
        ls[k] = int8_t(v - 128 * hi);
      } else {
        qs[k] = int8_t(v);
      }
    }
    for (int j = 0; j < kSubBlocks; ++j) {
      int t = 0, u = 0;
      for (int k = 0; k < 16; ++k) {
        t += qs[16 * j + k];
        if (x16) u += ls[16 * j + k];
      }
      o.bsum[s * kSubBlocks + j] = int16_t(t);
      if (x16) o.bsum_lo[s * kSubBlocks + j] = int16_t(u);
    }
  }
}

inline __m128i pack8(__m256i a, __m256i b) {  // 16 int32 -> 16 int8 in order
  const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
  return _mm_packs_epi16(_mm256_castsi256_si128(w16), _mm256_extracti128_si256(w16, 1));
}

inline int16_t sum16(__m256i a, __m256i b) {
  const __m256i t = _mm256_add_epi32(a, b);
  __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  u = _mm_add_epi32(u, _mm_unpackhi_epi64(u, u));
  u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 1));
  return int16_t(_mm_cvtsi128_si32(u));
}

// The reference's values: the same max, the same product x * id rounded to nearest even
// (cvtps_epi32 under the default rounding mode = nearbyint), clamped, split alike.
void prepare_row(const float* x, int K, bool x16, const RowOut& o) {
  const int qmax = x16 ? 16256 : 127;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i lo = _mm256_set1_epi32(-qmax), hi = _mm256_set1_epi32(qmax), half = _mm256_set1_epi32(64);
  for (int s = 0; s < K / kQ6KValues; ++s) {
    const float* xs = x + size_t(s) * kQ6KValues;
    __m256 m = _mm256_setzero_ps();
    for (int k = 0; k < kQ6KValues; k += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xs + k)));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    float amax = 0.0f;
    for (float v : lanes) amax = std::max(amax, v);
    const float idf = amax > 0.0f ? float(qmax) / amax : 0.0f;
    o.d[s] = amax / float(qmax);
    const __m256 id = _mm256_set1_ps(idf);
    int8_t* qs = o.q + size_t(s) * kQ6KValues;
    for (int j = 0; j < kSubBlocks; ++j) {
      __m256i a = _mm256_min_epi32(hi, _mm256_max_epi32(lo, _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xs + 16 * j), id))));
      __m256i b = _mm256_min_epi32(hi, _mm256_max_epi32(lo, _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xs + 16 * j + 8), id))));
      if (x16) {
        const __m256i ha = _mm256_srai_epi32(_mm256_add_epi32(a, half), 7);
        const __m256i hb = _mm256_srai_epi32(_mm256_add_epi32(b, half), 7);
        const __m256i la = _mm256_sub_epi32(a, _mm256_slli_epi32(ha, 7));
        const __m256i lb = _mm256_sub_epi32(b, _mm256_slli_epi32(hb, 7));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o.lo + size_t(s) * kQ6KValues + 16 * j), pack8(la, lb));
        o.bsum_lo[s * kSubBlocks + j] = sum16(la, lb);
        a = ha;
        b = hb;
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qs + 16 * j), pack8(a, b));
      o.bsum[s * kSubBlocks + j] = sum16(a, b);
    }
  }
}

// ---- the sums ----

// The exact integer of one super-block (reference): sum_j sc[j] * sum_{k in j} (q_k - 32) * x_k.
int32_t block_isum_reference(const uint8_t* b, const int8_t* x) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  int32_t isum = 0;
  for (int half = 0; half < 2; ++half) {
    const uint8_t* l = ql + 64 * half;
    const uint8_t* h = qh + 32 * half;
    const int8_t* xh = x + 128 * half;
    const int8_t* sh = sc + 8 * half;
    for (int i = 0; i < 4; ++i) {  // values 32 i + t of this half
      int32_t part[2] = {0, 0};
      for (int t = 0; t < 32; ++t) {
        const int nib = (i < 2 ? l[32 * i + t] & 0xF : l[32 * (i - 2) + t] >> 4);
        const int q = nib | (((h[t] >> (2 * i)) & 3) << 4);
        part[t / 16] += (q - 32) * xh[32 * i + t];
      }
      isum += sh[2 * i] * part[0] + sh[2 * i + 1] * part[1];
    }
  }
  return isum;
}

// Shuffles that spread sub-block scale pair (2i, 2i + 1) of a half over 8 + 8 bytes.
inline __m128i scale_shuffle(int p) {
  return _mm_set_epi8(char(2 * p + 1), char(2 * p + 1), char(2 * p + 1), char(2 * p + 1), char(2 * p + 1),
                      char(2 * p + 1), char(2 * p + 1), char(2 * p + 1), char(2 * p), char(2 * p), char(2 * p),
                      char(2 * p), char(2 * p), char(2 * p), char(2 * p), char(2 * p));
}

// One super-block's 256 values (unsigned, 0..63) in 8 vectors (v[4 * half + i] holds values
// 128 half + 32 i + t) and their scales as int16 pairs (s[p] = 8 x sc[2p], 8 x sc[2p + 1]).
struct Unpacked {
  __m256i v[8];
  __m256i s[8];
  __m256i sc16;  // the 16 scales as int16, for the offset term
};

__attribute__((always_inline)) inline void unpack(const uint8_t* b, Unpacked& u) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
  for (int half = 0; half < 2; ++half) {
    const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half));
    const __m256i qb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half + 32));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
    u.v[4 * half + 0] = _mm256_or_si256(_mm256_and_si256(qa, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m2));
    u.v[4 * half + 1] = _mm256_or_si256(_mm256_and_si256(qb, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m2));
    u.v[4 * half + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), m4), _mm256_and_si256(qh, m2));
    u.v[4 * half + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qb, 4), m4),
                                        _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2));
  }
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
  for (int p = 0; p < 8; ++p) u.s[p] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, scale_shuffle(p)));
  u.sc16 = _mm256_cvtepi8_epi16(sc);
}

// The super-block's exact sums in 8 int32 lanes (their total is block_isum_reference's).
__attribute__((always_inline)) inline __m256i block_lanes(const Unpacked& u, const int8_t* x, const int16_t* bsum) {
  __m256i acc = _mm256_setzero_si256();
  for (int p = 0; p < 8; ++p) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * p));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u.v[p], xv), u.s[p]));
  }
  const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsum));
  return _mm256_sub_epi32(acc, _mm256_slli_epi32(_mm256_madd_epi16(bs, u.sc16), 5));
}

inline int32_t hsum_i32(__m256i v) {
  __m128i u = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  u = _mm_add_epi32(u, _mm_unpackhi_epi64(u, u));
  u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 1));
  return _mm_cvtsi128_si32(u);
}

// Four columns' lane vectors -> their four totals (exact integers, any order).
inline __m128i hsum4(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i ab = _mm256_hadd_epi32(a, b), cd = _mm256_hadd_epi32(c, d);
  const __m256i t = _mm256_hadd_epi32(ab, cd);  // per 128-bit half: a, b, c, d partials
  return _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
}

inline void prefetch_rows(const uint8_t* p, size_t row_bytes, int rows, size_t off) {
  for (int j = 0; j < rows; ++j) {
    const char* r = reinterpret_cast<const char*>(p + j * row_bytes + off);
    for (int c = 0; c < kQ6KBlockBytes; c += 64) _mm_prefetch(r + c, _MM_HINT_T1);
    _mm_prefetch(r + kQ6KBlockBytes - 1, _MM_HINT_T1);
  }
}

// Offsets of row m's super-block s in the activation arrays.
inline size_t xoff(int m, int K, int s) { return size_t(m) * K + size_t(s) * kQ6KValues; }
inline size_t boff(int m, int nsb, int s) { return (size_t(m) * nsb + s) * kSubBlocks; }

// Several activation rows: each column's super-block unpacked once, then every row over it.
template <bool X16>
void columns_rows(const uint8_t* w, const Q6KActs& a, int M, int K, int N, float* out, int n0, int n1) {
  const int nsb = K / kQ6KValues;
  const size_t row_bytes = size_t(nsb) * kQ6KBlockBytes;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* r = w + size_t(n) * row_bytes;
    for (int m = 0; m < M; ++m) out[size_t(m) * N + n] = 0.0f;
    for (int s = 0; s < nsb; ++s) {
      const uint8_t* b = r + size_t(s) * kQ6KBlockBytes;
      Unpacked u;
      unpack(b, u);
      const float dw = half_to_float(b + 208);
      for (int m = 0; m < M; ++m) {
        const int32_t hi = hsum_i32(block_lanes(u, a.q.data() + xoff(m, K, s), a.bsum.data() + boff(m, nsb, s)));
        float v = float(hi);
        if constexpr (X16)
          v = q6k_join16(hi, hsum_i32(block_lanes(u, a.lo.data() + xoff(m, K, s), a.bsum_lo.data() + boff(m, nsb, s))));
        float& o = out[size_t(m) * N + n];
        o = std::fma(v, dw * a.d[size_t(m) * nsb + s], o);
      }
    }
  }
}


// Four super-block totals as floats: int8 activations' isum, or q6k_join16 of the two parts.
template <bool X16>
inline __m128 values4(__m128i hi, __m128i lo) {
  if constexpr (!X16) {
    return _mm_cvtepi32_ps(hi);
  } else {
    const __m256d v = _mm256_add_pd(_mm256_mul_pd(_mm256_cvtepi32_pd(hi), _mm256_set1_pd(128.0)), _mm256_cvtepi32_pd(lo));
    return _mm256_cvtpd_ps(v);
  }
}


// One activation row, 4 columns at a time (decode): the 4 rows' blocks stream once.
template <bool X16>
void columns_row1(const uint8_t* w, const Q6KActs& a, int K, float* out, int n0, int n1) {
  const int nsb = K / kQ6KValues;
  const size_t row_bytes = size_t(nsb) * kQ6KBlockBytes;
  int n = n0;
  for (; n + 4 <= n1; n += 4) {
    const uint8_t* r = w + size_t(n) * row_bytes;
    const bool ahead = n + 12 <= n1;
    __m128 acc = _mm_setzero_ps();
    for (int s = 0; s < nsb; ++s) {
      const size_t off = size_t(s) * kQ6KBlockBytes;
      if (ahead) prefetch_rows(r + 8 * row_bytes, row_bytes, 4, off);
      __m256i hi[4], lo[4];
      for (int j = 0; j < 4; ++j) {
        Unpacked u;
        unpack(r + j * row_bytes + off, u);
        hi[j] = block_lanes(u, a.q.data() + xoff(0, K, s), a.bsum.data() + boff(0, nsb, s));
        if constexpr (X16) lo[j] = block_lanes(u, a.lo.data() + xoff(0, K, s), a.bsum_lo.data() + boff(0, nsb, s));
      }
      const __m128i ih = hsum4(hi[0], hi[1], hi[2], hi[3]);
      const __m128i il = X16 ? hsum4(lo[0], lo[1], lo[2], lo[3]) : ih;
      const __m128 dw = _mm_setr_ps(half_to_float(r + off + 208), half_to_float(r + row_bytes + off + 208),
                                    half_to_float(r + 2 * row_bytes + off + 208),
                                    half_to_float(r + 3 * row_bytes + off + 208));
      acc = _mm_fmadd_ps(values4<X16>(ih, il), _mm_mul_ps(dw, _mm_set1_ps(a.d[s])), acc);
    }
    _mm_storeu_ps(out + n, acc);
  }
  for (; n < n1; ++n) columns_rows<X16>(w, a, 1, K, 1, out, n, n + 1);
}


}  // namespace

void q6k_prepare(const float* x, int M, int K, bool x16, Q6KActs& out, bool reference) {
  const int nsb = K / kQ6KValues;
  out.x16 = x16;
  out.q.resize(size_t(M) * K);
  out.d.resize(size_t(M) * nsb);
  out.bsum.resize(size_t(M) * (K / 16));
  out.lo.resize(x16 ? size_t(M) * K : 0);
  out.bsum_lo.resize(x16 ? size_t(M) * (K / 16) : 0);
  auto row = [&](long m) {
    const RowOut o{out.q.data() + size_t(m) * K, x16 ? out.lo.data() + size_t(m) * K : nullptr,
                   out.d.data() + size_t(m) * nsb, out.bsum.data() + size_t(m) * (K / 16),
                   x16 ? out.bsum_lo.data() + size_t(m) * (K / 16) : nullptr};
    (reference ? prepare_row_reference : prepare_row)(x + size_t(m) * K, K, x16, o);
  };
  if (M >= 16) over_rows(M, row);
  else
    for (int m = 0; m < M; ++m) row(m);
}

void q6k_columns(const uint8_t* w, const Q6KActs& a, int M, int K, int N, float* out, int n0, int n1) {
  if (M >= 2 && best_isa() == Isa::avx512vnni) q6k512::columns(w, a, M, K, N, out, n0, n1);
  else if (M == 1) (a.x16 ? columns_row1<true> : columns_row1<false>)(w, a, K, out, n0, n1);
  else (a.x16 ? columns_rows<true> : columns_rows<false>)(w, a, M, K, N, out, n0, n1);
}

void q6k_columns_reference(const uint8_t* w, const Q6KActs& a, int M, int K, int N, float* out, int n0, int n1) {
  const int nsb = K / kQ6KValues;
  const size_t row_bytes = size_t(nsb) * kQ6KBlockBytes;
  for (int m = 0; m < M; ++m)
    for (int n = n0; n < n1; ++n) {
      float acc = 0.0f;
      for (int s = 0; s < nsb; ++s) {
        const uint8_t* b = w + size_t(n) * row_bytes + size_t(s) * kQ6KBlockBytes;
        const size_t xo = size_t(m) * K + size_t(s) * kQ6KValues;
        const int32_t hi = block_isum_reference(b, a.q.data() + xo);
        const float v = a.x16 ? q6k_join16(hi, block_isum_reference(b, a.lo.data() + xo)) : float(hi);
        acc = std::fma(v, half_to_float(b + 208) * a.d[size_t(m) * nsb + s], acc);
      }
      out[size_t(m) * N + n] = acc;
    }
}

namespace {

void run(const float* x, const uint8_t* w, int M, int K, int N, float* out, bool reference) {
  thread_local Q6KActs acts;
  Q6KActs& a = acts;  // a plain reference: pool workers would see their own thread_local
  // Where the other matmuls of M rows take float activations (the float-panel A/B arm), 16-bit
  // ones: the nearest this kernel has.
  const bool x16 = x16_on() || std::strcmp(qmm_path(M), "float panels") == 0;
  q6k_prepare(x, M, K, x16, a, reference);
  if (reference) {
    q6k_columns_reference(w, a, M, K, N, out, 0, N);
    return;
  }
  const int T = Pool::get().threads();
  // Whole 4-column groups, several chunks a thread (even finish when one core is busier).
  // (Many rows: whole 16-column panels.)
  const int align = M == 1 ? 4 : 16;
  int chunk = (N + 4 * T - 1) / (4 * T);
  chunk = std::max(align, (chunk + align - 1) / align * align);
  const int n_chunks = (N + chunk - 1) / chunk;
  Pool::get().run(n_chunks, [&](int c) {
    const int n0 = c * chunk;
    q6k_columns(w, a, M, K, N, out, n0, std::min(N, n0 + chunk));
  });
}

}  // namespace

void q6k_run(const float* x, const uint8_t* w, int M, int K, int N, float* out) { run(x, w, M, K, N, out, false); }

std::vector<mx::Shape> Q6KMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  return {weight_matmul_shape(inputs)};
}

void Q6KMatmul::eval_gpu(const std::vector<mx::array>&, mx::array&) { gpu_unsupported(); }

void Q6KMatmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const mx::array& x = inputs[0];
  const mx::array& w = inputs[1];
  auto& enc = begin_eval(stream(), inputs, out);
  const int K = x.shape(-1), N = w.shape(0);
  const int M = K ? int(x.size() / K) : 0;
  enc.dispatch([xp = x.data<float>(), wp = w.data<uint8_t>(), op = out.data<float>(), M, K, N, ref = reference_]() {
    if (M > 0) run(xp, wp, M, K, N, op, ref);
  });
}

mx::array q6k_matmul(const mx::array& x, const mx::array& w, bool reference, mx::StreamOrDevice s) {
  if (x.ndim() < 1 || x.dtype() != mx::float32 || w.ndim() != 2 || w.dtype() != mx::uint8)
    throw std::invalid_argument("[mlxterm.q6k_matmul] x must be float32 (..., K) and w uint8 (N, K / 256 * 210).");
  const int K = x.shape(-1);
  if (K % kQ6KValues != 0 || int64_t(w.shape(1)) != int64_t(K / kQ6KValues) * kQ6KBlockBytes)
    throw std::invalid_argument("[mlxterm.q6k_matmul] K must be a multiple of 256 and w (N, K / 256 * 210) bytes.");
  auto st = cpu_stream(s, "q6k_matmul");
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(shape, mx::float32, std::make_shared<Q6KMatmul>(st, reference),
                   {contiguous_in(x, st), contiguous_in(w, st)});
}

}  // namespace mlxterm
