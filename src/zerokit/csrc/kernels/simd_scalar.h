// Portable one-lane implementation of the vocabulary in simd.h, for CPUs without AVX2 (and for
// non-x86 builds). The 16-bit conversions are the bit tricks c10 uses (c10/util/Half.h,
// BFloat16.h), so results match torch's .to() exactly, subnormals and NaN included.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/sr_hash.h"

namespace zk {

struct Scalar {
  using F = float;
  using D = double;
  static constexpr int W = 1;

  static uint32_t bits(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
  static float from_bits(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }

  static F set1(float x) { return x; }
  static F load(const float* p) { return *p; }
  static void store(float* p, F x) { *p = x; }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return std::sqrt(a); }
  // A float product is exact in double, so this rounds once except in the rare double-rounding
  // case; it keeps the scalar path within an ulp of the FMA paths without a slow libm fma.
  static F fmadd(F a, F b, F c) {
    return static_cast<float>(static_cast<double>(a) * static_cast<double>(b) + static_cast<double>(c));
  }
  static F sign(F x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (x == 0.0f ? 0.0f : x)); }

  static F load_bf16(const uint16_t* p) { return from_bits(static_cast<uint32_t>(*p) << 16); }
  static void store_bf16(uint16_t* p, F x) {
    if (x != x) { *p = 0x7FC0; return; }
    const uint32_t u = bits(x);
    *p = static_cast<uint16_t>((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16);
  }
  // Stochastic rounding (step_args.h, Rounding): add 16 random bits below the kept ones, truncate.
  static void store_bf16_sr(uint16_t* p, F x, uint32_t key, uint32_t index0) {
    if (x != x) { *p = 0x7FC0; return; }
    *p = static_cast<uint16_t>((bits(x) + sr_bits(key, index0)) >> 16);
  }
  static F load_f16(const uint16_t* p) {
    const uint32_t w = static_cast<uint32_t>(*p) << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normalized = from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t r = sign | (two_w < (1u << 27) ? bits(denormalized) : bits(normalized));
    return from_bits(r);
  }
  static void store_f16(uint16_t* p, F x) {
    float base = (std::fabs(x) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = bits(x);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = from_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t b = bits(base);
    const uint32_t nonsign = ((b >> 13) & 0x00007C00u) + (b & 0x00000FFFu);
    *p = static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
  }

  static void store_bf16_nt(uint16_t* p, F x) { store_bf16(p, x); }
  static void store_f16_nt(uint16_t* p, F x) { store_f16(p, x); }
  static void fence() {}

  static D dzero() { return 0.0; }
  static void sq_acc(D& lo, D& /*hi*/, F x) { lo += static_cast<double>(x) * static_cast<double>(x); }
  static D dadd(D a, D b) { return a + b; }
  static double dsum(D x) { return x; }
};

}  // namespace zk
