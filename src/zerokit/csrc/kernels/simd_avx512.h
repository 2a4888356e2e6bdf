// AVX-512F implementation of the vocabulary in simd.h. Include only inside ZK_TARGET_PUSH_AVX512.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "kernels/sr_hash.h"

namespace zk {

struct Avx512 {
  using F = __m512;
  using D = __m512d;
  static constexpr int W = 16;

  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }

  static F sign(F x) {
    const F zero = _mm512_setzero_ps();
    F r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, zero, _CMP_GT_OQ), zero, set1(1.0f));
    r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ), r, set1(-1.0f));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, x);
  }

  static F load_bf16(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static F load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // c10::round_to_nearest_even in integer arithmetic (keeps subnormals, unlike VCVTNEPS2BF16,
  // which flushes them): add 0x7FFF plus the lowest kept bit, truncate; any NaN becomes 0x7FC0.
  static __m256i narrow_bf16(F x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    r = _mm512_srli_epi32(r, 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
  }
  // sr_bits (sr_hash.h) for lanes index0 .. index0 + 15.
  static __m512i sr_random(uint32_t key, uint32_t index0) {
    __m512i x = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(index0)),
                                 _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    x = _mm512_xor_si512(_mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(kIndexMul))),
                         _mm512_set1_epi32(static_cast<int>(key)));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846CA68Bu)));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    return _mm512_srli_epi32(x, 16);
  }
  // Stochastic rounding (step_args.h, Rounding): add the random bits, truncate; NaN -> 0x7FC0.
  static void store_bf16_sr(uint16_t* p, F x, uint32_t key, uint32_t index0) {
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), sr_random(key, index0)), 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static __m256i narrow_f16(F x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static void store_bf16(uint16_t* p, F x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow_bf16(x)); }
  static void store_f16(uint16_t* p, F x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow_f16(x)); }
  // Non-temporal variants for the 16-bit output, which nothing reads soon: they skip the read for
  // ownership of each line (2 of the ~30 bytes a mixed-precision step moves). p: 32-byte aligned.
  static void store_bf16_nt(uint16_t* p, F x) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), narrow_bf16(x)); }
  static void store_f16_nt(uint16_t* p, F x) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), narrow_f16(x)); }
  static void fence() { _mm_sfence(); }

  static D dzero() { return _mm512_setzero_pd(); }
  static void sq_acc(D& lo, D& hi, F x) {
    const __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d b = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    lo = _mm512_fmadd_pd(a, a, lo);
    hi = _mm512_fmadd_pd(b, b, hi);
  }
  static D dadd(D a, D b) { return _mm512_add_pd(a, b); }
  static double dsum(D x) { return _mm512_reduce_add_pd(x); }
};

}  // namespace zk
