// The quantized matmul kernels for avx2 (flags set in CMakeLists.txt).
#define QMM_ISA avx2
#define QMM_VNNI 0
#include "qmm_kernel.inc"
