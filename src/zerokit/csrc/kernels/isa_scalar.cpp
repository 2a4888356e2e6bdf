// Portable kernels: baseline flags only, used where the CPU has no AVX2 (or is not x86).
#include "kernels/simd_scalar.h"
#include "kernels/adagrad.h"
#include "kernels/adam.h"
#include "kernels/isa_table.h"
#include "kernels/lion.h"
#include "kernels/norm.h"

ZK_DEFINE_ISA_TABLE(scalar, Scalar)
