// q8_pack: float rows -> the 8-bit KV row format (attention.h) as one MLX primitive.
#include "attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/utils.h"

namespace mlxterm {

void Q8Pack::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(inputs[0]);
  enc.set_output_array(out);
  const float* x = inputs[0].data<float>();
  uint8_t* o = out.data<uint8_t>();
  const int D = inputs[0].shape(-1), G = group_;
  const size_t rows = inputs[0].size() / size_t(D), W = size_t(out.shape(-1));
  enc.dispatch([x, o, D, G, rows, W]() {
    for (size_t r = 0; r < rows; ++r) {
      const float* xr = x + r * D;
      uint8_t* orow = o + r * W;
      for (int g = 0; g < D / G; ++g) {
        float amax = 0.0f;
        for (int d = g * G; d < (g + 1) * G; ++d) amax = std::max(amax, std::fabs(xr[d]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int d = g * G; d < (g + 1) * G; ++d)
          orow[d] = uint8_t(int8_t(std::clamp(std::nearbyint(xr[d] * inv), -127.0f, 127.0f)));
        const float sc = amax / 127.0f;
        std::memcpy(orow + D + 4 * g, &sc, 4);
      }
    }
  });
}

void Q8Pack::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[mlxterm] the CPU kernels have no GPU implementation.");
}

std::vector<mx::Shape> Q8Pack::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = inputs[0].shape();
  shape.back() += 4 * (shape.back() / group_);
  return {shape};
}

mx::array q8_pack(const mx::array& x, int group, mx::StreamOrDevice s) {
  const int D = x.ndim() ? x.shape(-1) : 0;
  if (group <= 0 || D % group != 0) throw std::invalid_argument("[mlxterm.q8_pack] the last axis must be a multiple of group.");
  auto st = mx::to_stream(s);
  if (st.device != mx::Device::cpu) throw std::invalid_argument("[mlxterm.q8_pack] runs on the CPU stream only.");
  auto shape = x.shape();
  shape.back() += 4 * (D / group);
  return mx::array(shape, mx::uint8, std::make_shared<Q8Pack>(st, group),
                   {mx::contiguous(mx::astype(x, mx::float32, st), false, st)});
}

}  // namespace mlxterm
