// AVX2 + FMA + F16C implementation of the vocabulary in simd.h. Include only inside
// ZK_TARGET_PUSH_AVX2.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "kernels/sr_hash.h"

namespace zk {

struct Avx2 {
  using F = __m256;
  using D = __m256d;
  static constexpr int W = 8;

  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }

  static F sign(F x) {
    const F zero = _mm256_setzero_ps();
    F r = _mm256_and_ps(_mm256_cmp_ps(x, zero, _CMP_GT_OQ), set1(1.0f));
    r = _mm256_blendv_ps(r, set1(-1.0f), _mm256_cmp_ps(x, zero, _CMP_LT_OQ));
    return _mm256_blendv_ps(r, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }

  static F load_bf16(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static F load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // Same rounding as Avx512::narrow_bf16; see there.
  static __m128i narrow_bf16(F x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    // packus works within 128-bit lanes; the permute brings the two halves together.
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8));
  }
  // sr_bits (sr_hash.h) for lanes index0 .. index0 + 7.
  static __m256i sr_random(uint32_t key, uint32_t index0) {
    __m256i x = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(index0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    x = _mm256_xor_si256(_mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(kIndexMul))),
                         _mm256_set1_epi32(static_cast<int>(key)));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB352D));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846CA68Bu)));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    return _mm256_srli_epi32(x, 16);
  }
  // Stochastic rounding (step_args.h, Rounding): add the random bits, truncate; NaN -> 0x7FC0.
  static void store_bf16_sr(uint16_t* p, F x, uint32_t key, uint32_t index0) {
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), sr_random(key, index0)), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8)));
  }
  static __m128i narrow_f16(F x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT); }
  static void store_bf16(uint16_t* p, F x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow_bf16(x)); }
  static void store_f16(uint16_t* p, F x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow_f16(x)); }
  // See Avx512::store_bf16_nt. p: 16-byte aligned.
  static void store_bf16_nt(uint16_t* p, F x) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), narrow_bf16(x)); }
  static void store_f16_nt(uint16_t* p, F x) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), narrow_f16(x)); }
  static void fence() { _mm_sfence(); }

  static D dzero() { return _mm256_setzero_pd(); }
  static void sq_acc(D& lo, D& hi, F x) {
    const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d b = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    lo = _mm256_fmadd_pd(a, a, lo);
    hi = _mm256_fmadd_pd(b, b, hi);
  }
  static D dadd(D a, D b) { return _mm256_add_pd(a, b); }
  static double dsum(D x) {
    const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(x), _mm256_extractf128_pd(x, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
  }
};

}  // namespace zk
