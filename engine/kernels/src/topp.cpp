// Top-p filter in three passes over the row, no sort of the vocabulary:
//   1. the row's max m;
//   2. e = exp(x - m) (vmath.h's exp) summed into buckets of d = m - x, kPerUnit buckets per
//      unit of d up to kBuckets - 1, the rest (d >= 64: e < 2e-28 each) in the last one;
//   3. walk the buckets from d = 0 until their mass reaches top_p * sum(e): every token of an
//      earlier bucket is kept, every token of a later one dropped, and only the boundary
//      bucket's tokens (those within 1/32 of each other in x) are sorted, by x descending
//      then index, and walked one by one.
// The bucket of d is monotone in x (fl(m - x) and the power-of-two scale are monotone), so the
// kept set is a prefix of the stable descending sort, as MLX's argsort makes it. Masses are
// summed in double; they differ from a float32 cumsum over the sorted row only by rounding,
// which moves the boundary only where a token's cumulative mass is within rounding of top_p.
#include "topp.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <vector>

#include <immintrin.h>

#include "ops.h"
#include "pool.h"
#include "vmath.h"

namespace mlxterm {

namespace {

constexpr int kBuckets = 2048;
constexpr float kPerUnit = 32.0f;  // a power of two: d * kPerUnit is exact
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Scalar bucket of d = m - x (NaN and +inf: the last bucket), as the vector code computes it.
inline int bucket_of(float d) {
  const float y = d * kPerUnit;
  return y < float(kBuckets - 1) ? int(y) : kBuckets - 1;
}

struct Member {
  float x;
  int32_t j;
  float e;
};

float row_max(const float* x, int V) {
  __m256 vm = _mm256_set1_ps(kNegInf);
  int j = 0;
  for (; j + 8 <= V; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(x + j));
  float m = hmax(vm);
  for (; j < V; ++j) m = std::max(m, x[j]);
  return m;
}

// Loads x[j .. j + 8), padding past V with -inf (e = 0, last bucket).
inline __m256 load_padded(const float* x, int j, int V) {
  if (j + 8 <= V) return _mm256_loadu_ps(x + j);
  alignas(32) float buf[8];
  for (int l = 0; l < 8; ++l) buf[l] = j + l < V ? x[j + l] : kNegInf;
  return _mm256_load_ps(buf);
}

void top_p_row(const float* x, float* o, int V, float top_p) {
  const float m = row_max(x, V);
  if (!(top_p < 1.0f) || !std::isfinite(m)) {
    std::copy(x, x + V, o);
    return;
  }
  thread_local std::vector<double> mass(kBuckets);
  thread_local std::vector<Member> members;
  std::fill(mass.begin(), mass.end(), 0.0);
  const __m256 vm = _mm256_set1_ps(m), scale = _mm256_set1_ps(kPerUnit);
  const __m256 last = _mm256_set1_ps(float(kBuckets - 1));
  const __m256i last_i = _mm256_set1_epi32(kBuckets - 1);
  alignas(32) int32_t bk[8];
  alignas(32) float ev[8];
  // Pass 2: masses per bucket (e is recomputed for the boundary bucket's tokens only).
  for (int j = 0; j < V; j += 8) {
    const __m256 v = load_padded(x, j, V);
    const __m256 d = _mm256_sub_ps(vm, v);
    const __m256 e = exp_neg(_mm256_sub_ps(v, vm));
    const __m256 y = _mm256_mul_ps(d, scale);
    const __m256 in = _mm256_cmp_ps(y, last, _CMP_LT_OQ);
    const __m256i b = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(last_i), _mm256_castsi256_ps(_mm256_cvttps_epi32(y)), in));
    _mm256_store_si256(reinterpret_cast<__m256i*>(bk), b);
    _mm256_store_ps(ev, e);
    const int n = std::min(8, V - j);
    for (int l = 0; l < n; ++l) mass[bk[l]] += ev[l];
  }
  // Pass 3: the boundary bucket. The total is summed in the walk's own order, so the walk
  // reaches top_p * total at the last bucket at the latest.
  const double total = std::accumulate(mass.begin(), mass.end(), 0.0);
  const double target = double(top_p) * total;
  double cum = 0.0;
  int b = 0;
  for (; b < kBuckets - 1; ++b) {
    if (cum + mass[b] >= target) break;
    cum += mass[b];
  }
  // Tokens before bucket b kept, after it dropped; b's own collected with their e.
  members.clear();
  const __m256 vb = _mm256_set1_ps(float(b)), vb1 = _mm256_set1_ps(float(b + 1));
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  const bool tail = b == kBuckets - 1;
  for (int j = 0; j < V; j += 8) {
    const __m256 v = load_padded(x, j, V);
    const __m256 y = _mm256_mul_ps(_mm256_sub_ps(vm, v), scale);
    const __m256 keep = _mm256_cmp_ps(y, vb, _CMP_LT_OQ);
    const __m256 inb = tail ? _mm256_cmp_ps(y, last, _CMP_NLT_UQ)
                            : _mm256_and_ps(_mm256_cmp_ps(y, vb, _CMP_GE_OQ), _mm256_cmp_ps(y, vb1, _CMP_LT_OQ));
    const int n = std::min(8, V - j);
    int bits = _mm256_movemask_ps(inb) & ((1 << n) - 1);
    if (bits) {
      _mm256_store_ps(ev, exp_neg(_mm256_sub_ps(v, vm)));  // pass 2's e, lane for lane
      while (bits) {
        const int l = __builtin_ctz(bits);
        bits &= bits - 1;
        members.push_back({x[j + l], j + l, ev[l]});
      }
    }
    const __m256 out = _mm256_blendv_ps(ninf, v, keep);
    if (n == 8) {
      _mm256_storeu_ps(o + j, out);
    } else {
      alignas(32) float buf[8];
      _mm256_store_ps(buf, out);
      std::copy(buf, buf + n, o + j);
    }
  }
  std::sort(members.begin(), members.end(), [](const Member& a, const Member& c) {
    return a.x > c.x || (a.x == c.x && a.j < c.j);
  });
  for (const Member& t : members) {
    if (!(cum < target)) break;
    o[t.j] = t.x;
    cum += t.e;
  }
}

// Scalar reference: stable sort of the whole row, double-precision exp and sums.
void top_p_row_ref(const float* x, float* o, int V, float top_p) {
  double m = -INFINITY;
  for (int j = 0; j < V; ++j) m = std::max(m, double(x[j]));
  if (!(top_p < 1.0f) || !std::isfinite(m)) {
    std::copy(x, x + V, o);
    return;
  }
  std::vector<int32_t> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [x](int32_t a, int32_t c) { return x[a] > x[c]; });
  double total = 0.0;
  for (int j = 0; j < V; ++j) total += std::exp(double(x[j]) - m);
  const double target = double(top_p) * total;
  std::fill(o, o + V, kNegInf);
  double cum = 0.0;
  for (int32_t j : order) {
    if (!(cum < target)) break;
    o[j] = x[j];
    cum += std::exp(double(x[j]) - m);
  }
}

}  // namespace

void TopPFilter::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const bool ref = reference_;
  const float p = top_p_;
  dispatch_rows<float>(stream(), inputs[0], out, [ref, p](const float* xp, float* op, int V, long rows) {
    auto row = [&](long r) {
      if (ref) top_p_row_ref(xp + size_t(r) * V, op + size_t(r) * V, V, p);
      else top_p_row(xp + size_t(r) * V, op + size_t(r) * V, V, p);
    };
    if (rows == 1) row(0);  // the usual call (one row per sampled token): no pool hand-off
    else Pool::get().run(int(rows), [&](int r) { row(r); });
  });
}

mx::array top_p_filter(const mx::array& x, float top_p, bool reference, mx::StreamOrDevice s) {
  auto st = row_stream(x, "top_p_filter", s);
  if (!(top_p > 0.0f))
    throw std::invalid_argument("[mlxterm.top_p_filter] top_p must be > 0.");
  return mx::array(x.shape(), mx::float32, std::make_shared<TopPFilter>(st, top_p, reference),
                   {contiguous_in(x, st)});
}

}  // namespace mlxterm
