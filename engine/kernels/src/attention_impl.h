// Internal to the fused attention (attention.cpp and the files beside it: attention_rows.cpp,
// attention_reference.cpp, attention_op.cpp): the problem a call describes, a task's key split
// and scratch, and the steps those files share. Not part of the extension's interface
// (attention.h is).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "attention_tiles.h"

namespace mlxterm::attn {

constexpr int kBlock = kAttnBlock;  // keys per block (scores: rows x kBlock floats)
constexpr int kMinTasks = 16;   // below this many tasks, split the keys too
const float kNegInf = -std::numeric_limits<float>::infinity();

struct Problem {
  const float* q;
  const void* k;
  const void* v;
  const float* mask;
  float* out;
  bool half;  // K/V float16
  bool q8;    // K/V 8-bit rows: D int8 values, then D / G float32 scales (see attention.h)
  int G;      // q8 group size along the head dim
  size_t kst, vst;  // q8: bytes per K / V row
  int B, H, L, D, Hk, S, Dv, Bm, Lm;
  // Rows between batch entries and between KV heads of K and V (dense: Hk * S and S). A view of
  // a longer cache buffer (the first S of its slots) is read in place, not copied first.
  size_t k_batch, k_head, v_batch, v_head;
  float scale;
  int mode, offset, window;
  bool rotate;  // q times the orthonormal Walsh-Hadamard matrix first (q8 K rows are rotated)
};

struct Split {
  int b, kvh, i0, nt, s0, s1;
};

// Scratch of one task, reused across calls on the same thread.
struct Scratch {
  std::vector<float> q, o, s, m, l, kf, vf, kt, qs;
  std::vector<int8_t> qi;
};

inline void widen(const uint16_t* src, float* dst, int n) {
  int t = 0;
  for (; t + 8 <= n; t += 8)
    _mm256_storeu_ps(dst + t, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + t))));
  for (; t < n; ++t) dst[t] = _cvtsh_ss(src[t]);
}

// Visible key range [lo, hi) of query position i under the causal/window mask.
inline void causal_range(const Problem& p, int i, int& lo, int& hi) {
  hi = std::min(p.S, i + p.offset + 1);
  lo = p.window > 0 ? std::max(0, i + p.offset - p.window + 1) : 0;
}

inline float* out_row(const Problem& p, int b, int h, int i) {
  return p.out + ((size_t(b) * p.H + h) * p.L + i) * p.Dv;
}

// Key splits of a call whose batch row has `row_groups` (KV head, query tile) tasks over
// `blocks` key blocks: enough tasks for the pool (kMinTasks), never more than the blocks.
inline int key_splits(int row_groups, int blocks) {
  return std::max(1, std::min(blocks, (kMinTasks + row_groups - 1) / row_groups));
}

// Batch row b's K/V of KV head kvh.
struct HeadKV {
  const uint8_t *k8 = nullptr, *v8 = nullptr;
  const float *kf32 = nullptr, *vf32 = nullptr;
  const uint16_t *k16 = nullptr, *v16 = nullptr;
};

// Steps of the kernel, defined (and described) in attention.cpp.
void rotate_row(float* x, int D);
void quantize_q(const float* q, int D, int G, int8_t* qi, float* qs);
void begin_split(const Problem& p, const Split& t, Scratch& sc, bool tiled);
template <typename T>  // float and uint16_t (float16), instantiated in attention.cpp
void decode_block_rows(const Problem& p, const Split* ts, Scratch* scs, int np, int R, int kb, int n,
                       const T* kblk, const T* vblk);
template <typename T>
void decode_scores(const Problem& p, Scratch& sc, int R, int n, const T* kblk, const Prefetch& pf);
template <typename T>
void decode_pv(const Problem& p, const Split& t, Scratch& sc, int R, int kb, int n, const T* vblk);
template <typename T>  // instantiated for float in attention.cpp
void decode_block(const Problem& p, const Split& t, Scratch& sc, int R, int kb, int n, const T* kblk, const T* vblk,
                  const Prefetch& pf);
void decode_block_q8(const Problem& p, const Split& t, Scratch& sc, int R, int kb, int n, const uint8_t* kblk,
                     const uint8_t* vblk, const Prefetch& pf);
HeadKV head_kv(const Problem& p, int b, int kvh);
void run_split(const Problem& p, const Split& t, Scratch& sc);
void merge_row(const float* part, size_t step, int n_splits, int Dv, float* dst);
void finish_rows(const Problem& p, const Split& t, const Scratch& sc, int R, float* part);

// The whole call: tasks over the pool, key splits merged (attention.cpp).
void run_flash(const Problem& p);

// A causal prompt forward with the decode's bits (attention_rows.cpp).
void run_flash_rows(const Problem& p);

// Scalar reference (tests): two-pass softmax per row in double (attention_reference.cpp).
void run_reference(const Problem& p);

}  // namespace mlxterm::attn
