// The quantized matmul kernels for avxvnni (flags set in CMakeLists.txt).
#define QMM_ISA avxvnni
#define QMM_VNNI 1
#include "qmm_kernel.inc"
