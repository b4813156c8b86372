// Python bindings: engine/kernels/__init__.py is the only caller.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "ops.h"
#include "pool.h"
#include "qmm.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_ext, m) {
  m.doc() = "mlxterm CPU kernels (AVX2/FMA, VNNI where present) as MLX primitives";
  m.def(
      "quantized_matmul",
      [](const mlx::core::array& x, const mlx::core::array& w, const mlx::core::array& scales,
         const mlx::core::array& biases, int group_size, int bits, bool exact) {
        return mlxterm::quantized_matmul(x, w, scales, biases, group_size, bits, exact);
      },
      "x"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "bits"_a, "exact"_a = false,
      "x @ dequantize(w, scales, biases).T on the CPU, float32 out.");
  m.def("set_threads", [](int n) { mlxterm::Pool::get().set_threads(n); }, "n"_a);
  m.def("threads", [] { return mlxterm::Pool::get().threads(); });
  m.def("isa", [] { return std::string(mlxterm::isa_name(mlxterm::best_isa())); });
}
