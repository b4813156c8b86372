// The quantized matmul kernels for avx512vnni (flags set in CMakeLists.txt).
#define MLXTERM_ISA avx512vnni
#define MLXTERM_VNNI 2
#include "qmm_kernel.inc"
