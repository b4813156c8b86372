// The quantized matmul kernels for avx512vnni (flags set in CMakeLists.txt).
#define QMM_ISA avx512vnni
#define QMM_VNNI 2
#include "qmm_kernel.inc"
