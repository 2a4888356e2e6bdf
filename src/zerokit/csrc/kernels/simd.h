// The one SIMD vocabulary of the host optimizer kernels.
//
// Every ISA is a struct with the same static members; kernels are templates over it, so the math
// of each optimizer is written once (adam.h, adagrad.h, lion.h, norm.h) and instantiated per ISA
// in isa_<name>.cpp, each compiled under its own target pragma. dispatch.cpp picks one table at
// run time from the CPU's features, so one binary runs on AVX-512, AVX2 and plain x86-64.
//
//   type / member            meaning
//   F, W                     a vector of W floats
//   D                        a vector of doubles, for norm accumulation (holds W/2 lanes)
//   set1, load, store        broadcast, unaligned load/store of W floats
//   add sub mul div sqrt     lane-wise, IEEE-rounded
//   fmadd(a, b, c)           a * b + c, fused (the scalar ISA emulates the single rounding)
//   sign(x)                  -1, 0 or +1; NaN stays NaN (torch.sign)
//   load_bf16, load_f16      W 16-bit values widened to float, exactly
//   store_bf16, store_f16    round-to-nearest-even narrowing, bit-identical to torch's .to()
//   store_*16_nt, fence      non-temporal narrowing stores (W*2-byte aligned), and the sfence
//                            that orders them before the range is reported done
//   dzero, sq_acc(lo, hi, x) lo/hi += x*x in double (low and high half of the lanes)
//   dsum(D)                  horizontal sum of a double vector
//
// Tails shorter than W go through the same vector code on a zero-padded stack copy, so an
// element's result never depends on its position or on how the range was split across threads.
#pragma once

// Brackets a region compiled for one instruction set (GCC and clang spellings).
#if defined(__clang__)
#define ZK_TARGET_PUSH_AVX512 \
  _Pragma("clang attribute push(__attribute__((target(\"avx512f,fma,f16c,avx2\"))), apply_to = function)")
#define ZK_TARGET_PUSH_AVX2 \
  _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,f16c\"))), apply_to = function)")
#define ZK_TARGET_POP _Pragma("clang attribute pop")
#else
#define ZK_TARGET_PUSH_AVX512 \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,fma,f16c,avx2\")")
#define ZK_TARGET_PUSH_AVX2 _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c\")")
#define ZK_TARGET_POP _Pragma("GCC pop_options")
#endif

#if defined(__x86_64__) || defined(_M_X64)
#define ZK_X86 1
#else
#define ZK_X86 0
#endif
