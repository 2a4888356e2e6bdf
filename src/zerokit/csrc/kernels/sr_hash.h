// The counter-based hash behind stochastic rounding (see Rounding in step_args.h). Plain uint32
// arithmetic, so the SIMD versions in simd_<isa>.h and the torch fallback
// (zerokit/optim/rounding.py) compute the same bits lane by lane. The functions have internal
// linkage (static), so no copy compiled under an ISA's target pragma can stand in for the
// baseline one at link time.
#pragma once
#include <cstdint>

namespace zk {

// Chris Wellons' "lowbias32": a bijection of uint32 with good avalanche in two multiplies.
static inline uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

constexpr uint32_t kIndexMul = 0x9E3779B9u;  // odd, so index -> index * kIndexMul is a bijection

// The per-buffer key of one step: buffer 0 = master, 1 = state0, 2 = state1.
static inline uint32_t sr_key(uint64_t seed, int64_t step, uint32_t buffer) {
  const uint64_t st = static_cast<uint64_t>(step);
  uint32_t k = lowbias32(static_cast<uint32_t>(seed) ^ 0x5BD1E995u);
  k = lowbias32(k ^ static_cast<uint32_t>(seed >> 32));
  k = lowbias32(k ^ static_cast<uint32_t>(st));
  k = lowbias32(k ^ static_cast<uint32_t>(st >> 32));
  return lowbias32(k + buffer);
}

// 16 random bits for element `index` (taken mod 2^32: elements 2^32 apart in one buffer share a
// stream, which keeps every rounding unbiased). Distinct indices get distinct 32-bit hashes.
static inline uint32_t sr_bits(uint32_t key, uint32_t index) {
  return lowbias32((index * kIndexMul) ^ key) >> 16;
}

}  // namespace zk
