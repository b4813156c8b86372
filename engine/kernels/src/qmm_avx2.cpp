// The quantized matmul kernels for avx2 (flags set in CMakeLists.txt).
#define MLXTERM_ISA avx2
#define MLXTERM_VNNI 0
#include "qmm_kernel.inc"
