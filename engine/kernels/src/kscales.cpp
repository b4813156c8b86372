// kscales_pack: K-quant scale records (QmmProblem::kscales) from float32 scales/biases, or an
// empty array when they do not factor as d * sc, -(dmin * m) bit for bit (kscales.py is the
// numpy reference, the same bytes; docs/kernels.md "K-quant scale records").
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include <immintrin.h>

#include "ops.h"

namespace mlxterm {

namespace {

// One super-block's 8 values as d * q (d a float16 value, q in [0, 63]) bit for bit, trying the
// largest q first: kscales.py's factor() for one row, the same choices (the same bytes).
bool factor8(const float* v, uint16_t& dh, uint8_t* q) {
  uint32_t bits[8];
  std::memcpy(bits, v, sizeof(bits));
  bool zero = true;
  for (int i = 0; i < 8; ++i) zero = zero && bits[i] == 0;
  if (zero) {
    dh = 0;
    std::memset(q, 0, 8);
    return true;
  }
  int im = 0;
  for (int i = 1; i < 8; ++i)
    if (std::fabs(v[i]) > std::fabs(v[im])) im = i;
  for (int k = 63; k > 0; --k) {
    const uint16_t h = _cvtss_sh(v[im] / float(k), _MM_FROUND_TO_NEAREST_INT);
    const float dc = _cvtsh_ss(h);
    if (dc == 0.0f) continue;
    bool ok = true;
    uint8_t qq[8];
    for (int i = 0; i < 8 && ok; ++i) {
      const float r = std::nearbyint(v[i] / dc);
      if (!(r >= 0.0f && r <= 63.0f)) {
        ok = false;
        break;
      }
      qq[i] = uint8_t(r);
      const float back = dc * float(qq[i]);
      uint32_t b;
      std::memcpy(&b, &back, 4);
      ok = b == bits[i];
    }
    if (ok) {
      dh = h;
      std::memcpy(q, qq, 8);
      return true;
    }
  }
  return false;
}

}  // namespace

mx::array kscales_pack(const mx::array& scales_in, const mx::array& biases_in) {
  if (scales_in.ndim() != 2 || scales_in.shape() != biases_in.shape() || scales_in.dtype() != mx::float32 ||
      biases_in.dtype() != mx::float32)
    throw std::invalid_argument("[mlxterm.kscales_pack] scales/biases must be float32 (N, groups), one shape.");
  const int n = scales_in.shape(0), ng = scales_in.shape(1);
  auto none = [] {
    const uint8_t* nothing = nullptr;
    return mx::array(nothing, mx::Shape{0}, mx::uint8);
  };
  if (ng % 8 != 0) return none();
  mx::array sc = mx::contiguous(scales_in), bi = mx::contiguous(biases_in);
  sc.eval();
  bi.eval();
  const float* s = sc.data<float>();
  const float* b = bi.data<float>();
  const size_t blocks = size_t(n) * (ng / 8);
  std::vector<uint8_t> out(blocks * kKScaleBytes);
  for (size_t i = 0; i < blocks; ++i) {
    uint8_t* rec = out.data() + i * kKScaleBytes;
    float nb[8];
    for (int j = 0; j < 8; ++j) nb[j] = -b[i * 8 + j];
    uint16_t d, dmin;
    if (!factor8(s + i * 8, d, rec + 4) || !factor8(nb, dmin, rec + 12))
      return none();
    const float dm = _cvtsh_ss(dmin);
    for (int j = 0; j < 8; ++j) {  // the sign of a zero bias: -(dmin * 0) is -0.0
      const float back = -(dm * float(rec[12 + j]));
      if (std::memcmp(&back, b + i * 8 + j, 4) != 0) return none();
    }
    std::memcpy(rec, &d, 2);
    std::memcpy(rec + 2, &dmin, 2);
  }
  return mx::array(out.begin(), mx::Shape{n, ng / 8 * kKScaleBytes}, mx::uint8);
}

}  // namespace mlxterm
