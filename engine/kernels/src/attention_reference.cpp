// The fused attention's scalar reference (tests compare every path against it).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention_impl.h"

namespace mlxterm::attn {

namespace {

// Scalar reference of one q8 element.
inline float q8_value(const uint8_t* row, int d, int D, int G) {
  float sc;
  std::memcpy(&sc, row + D + 4 * (d / G), 4);
  return float(int8_t(row[d])) * sc;
}

}  // namespace

// Scalar reference (tests): two-pass softmax per row in double.
void run_reference(const Problem& p) {
  const int rep = p.H / p.Hk;
  std::vector<double> s(p.S), acc(p.Dv);
  auto kval = [&](size_t idx) {
    if (p.q8) return double(q8_value(static_cast<const uint8_t*>(p.k) + idx / p.D * p.kst, int(idx % p.D), p.D, p.G));
    return p.half ? double(_cvtsh_ss(static_cast<const uint16_t*>(p.k)[idx]))
                  : double(static_cast<const float*>(p.k)[idx]);
  };
  auto vval = [&](size_t idx) {
    if (p.q8) return double(q8_value(static_cast<const uint8_t*>(p.v) + idx / p.Dv * p.vst, int(idx % p.Dv), p.Dv, p.G));
    return p.half ? double(_cvtsh_ss(static_cast<const uint16_t*>(p.v)[idx]))
                  : double(static_cast<const float*>(p.v)[idx]);
  };
  for (int b = 0; b < p.B; ++b)
    for (int h = 0; h < p.H; ++h)
      for (int i = 0; i < p.L; ++i) {
        const size_t kvh = size_t(b) * p.Hk + h / rep;
        const float* q = p.q + ((size_t(b) * p.H + h) * p.L + i) * p.D;
        std::vector<float> qr;
        if (p.rotate) {
          qr.assign(q, q + p.D);
          rotate_row(qr.data(), p.D);
          q = qr.data();
        }
        std::vector<float> qq;
        double qscale = double(p.scale);
        if (p.q8) {  // the kernel's quantized q (scaled first, then int8 per group)
          std::vector<float> qsc(p.D), qs(p.D / p.G);
          std::vector<int8_t> qi(p.D);
          for (int d = 0; d < p.D; ++d) qsc[d] = q[d] * p.scale;
          quantize_q(qsc.data(), p.D, p.G, qi.data(), qs.data());
          qq.resize(p.D);
          for (int d = 0; d < p.D; ++d) qq[d] = float(double(qi[d]) * double(qs[d / p.G]));
          q = qq.data();
          qscale = 1.0;
        }
        double m = -INFINITY;
        for (int j = 0; j < p.S; ++j) {
          double x = 0.0;
          for (int d = 0; d < p.D; ++d) x += double(q[d]) * qscale * kval((kvh * p.S + j) * p.D + d);
          if (p.mode == 1) {
            int lo, hi;
            causal_range(p, i, lo, hi);
            if (j < lo || j >= hi) x = -INFINITY;
          } else if (p.mode == 2) {
            x += p.mask[(size_t(p.Bm == 1 ? 0 : b) * p.Lm + (p.Lm == 1 ? 0 : i)) * p.S + j];
          }
          s[j] = x;
          m = std::max(m, x);
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        double l = 0.0;
        if (m != -INFINITY) {
          for (int j = 0; j < p.S; ++j) {
            const double e = s[j] == -INFINITY ? 0.0 : std::exp(s[j] - m);
            l += e;
            for (int d = 0; d < p.Dv; ++d) acc[d] += e * vval((kvh * p.S + j) * p.Dv + d);
          }
        }
        float* dst = out_row(p, b, h, i);
        for (int d = 0; d < p.Dv; ++d) dst[d] = l > 0.0 ? float(acc[d] / l) : 0.0f;
      }
}

}  // namespace mlxterm::attn
