// The quantized matmul kernels for avxvnni (flags set in CMakeLists.txt).
#define MLXTERM_ISA avxvnni
#define MLXTERM_VNNI 1
#include "qmm_kernel.inc"
