// AVX-512F kernels (see isa_avx2.cpp for why the ISA is confined to one translation unit).
#include "kernels/simd.h"
#if ZK_X86
#include <cstdint>
#include <cstring>
#include <immintrin.h>

#include "kernels/sr_hash.h"  // baseline code: dispatch.cpp calls the same inline functions

ZK_TARGET_PUSH_AVX512
#include "kernels/simd_avx512.h"
#include "kernels/adagrad.h"
#include "kernels/adam.h"
#include "kernels/isa_table.h"
#include "kernels/lion.h"
#include "kernels/norm.h"

ZK_DEFINE_ISA_TABLE(avx512, Avx512)
ZK_TARGET_POP
#endif
