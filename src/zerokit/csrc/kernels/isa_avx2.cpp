// AVX2 + FMA + F16C kernels. Only this translation unit is compiled for them; everything else
// stays baseline, so the module loads on any x86-64 and dispatch.cpp decides what runs.
#include "kernels/simd.h"
#if ZK_X86
// Standard headers go before the pragma so their inline functions keep baseline code.
#include <cstdint>
#include <cstring>
#include <immintrin.h>

#include "kernels/sr_hash.h"  // baseline code: dispatch.cpp calls the same inline functions

ZK_TARGET_PUSH_AVX2
#include "kernels/simd_avx2.h"
#include "kernels/adagrad.h"
#include "kernels/adam.h"
#include "kernels/isa_table.h"
#include "kernels/lion.h"
#include "kernels/norm.h"

ZK_DEFINE_ISA_TABLE(avx2, Avx2)
ZK_TARGET_POP
#endif
