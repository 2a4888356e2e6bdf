// The loop every element-wise optimizer kernel shares: whole vectors, then the tail through the
// same vector code on a zero-padded stack copy (see simd.h for why). Templates only.
#pragma once
#include <cstdint>
#include <cstring>

#include "kernels/step_args.h"

namespace zk {

template <class S, DType G>
inline typename S::F load_grad(const void* g, int64_t i) {
  if constexpr (G == DType::f32) {
    return S::load(static_cast<const float*>(g) + i);
  } else if constexpr (G == DType::bf16) {
    return S::load_bf16(static_cast<const uint16_t*>(g) + i);
  } else {
    return S::load_f16(static_cast<const uint16_t*>(g) + i);
  }
}

template <class S, DType O, bool NT>
inline void store_out16(void* out, int64_t i, typename S::F x) {
  uint16_t* p = static_cast<uint16_t*>(out) + i;
  if constexpr (O == DType::bf16) {
    if constexpr (NT) S::store_bf16_nt(p, x); else S::store_bf16(p, x);
  } else if constexpr (O == DType::f16) {
    if constexpr (NT) S::store_f16_nt(p, x); else S::store_f16(p, x);
  }
}

// Calls op.template apply<G, O, NT>(buffers, i) for each vector of [begin, end). NT: stream the
// 16-bit output past the caches (only when it is aligned for that; see stream_dispatch).
template <class S, DType G, DType O, bool NT, class Op>
inline void stream_range(const Op& op, const StepBuffers& b, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + S::W <= end; i += S::W) op.template apply<G, O, NT>(b, i);
  if constexpr (NT) S::fence();
  const int64_t rest = end - i;
  if (rest <= 0) return;

  alignas(64) float param[S::W] = {};
  alignas(64) float state0[S::W] = {};
  alignas(64) float state1[S::W] = {};
  alignas(64) float grad[S::W] = {};  // large enough for W elements of any gradient dtype
  alignas(64) uint16_t out[S::W] = {};
  const int gsize = G == DType::f32 ? 4 : 2;
  const size_t nf = static_cast<size_t>(rest) * sizeof(float);

  std::memcpy(param, b.param + i, nf);
  std::memcpy(grad, static_cast<const char*>(b.grad) + i * gsize, static_cast<size_t>(rest) * gsize);
  if (b.state0) std::memcpy(state0, b.state0 + i, nf);
  if (b.state1) std::memcpy(state1, b.state1 + i, nf);
  const StepBuffers t{param, grad, b.grad_dtype, b.state0 ? state0 : nullptr,
                      b.state1 ? state1 : nullptr, b.out16 ? out : nullptr, b.out_dtype};
  op.template apply<G, O, false>(t, 0);
  std::memcpy(b.param + i, param, nf);
  if (b.state0) std::memcpy(b.state0 + i, state0, nf);
  if (b.state1) std::memcpy(b.state1 + i, state1, nf);
  if (b.out16) std::memcpy(static_cast<uint16_t*>(b.out16) + i, out, static_cast<size_t>(rest) * 2);
}

// Instantiates stream_range for the runtime (gradient, output) dtype pair and output alignment.
template <class S, class Op>
inline void stream_dispatch(const Op& op, const StepBuffers& b, int64_t begin, int64_t end) {
  // Every vector store lands at begin + k*W, so one check covers the whole range.
  const bool nt = b.out16 && reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(b.out16) + begin) % (2 * S::W) == 0;
#define ZK_STREAM_OUT(G)                                                                      \
  switch (b.out_dtype) {                                                                      \
    case DType::bf16:                                                                         \
      return nt ? stream_range<S, G, DType::bf16, true>(op, b, begin, end)                    \
                : stream_range<S, G, DType::bf16, false>(op, b, begin, end);                  \
    case DType::f16:                                                                          \
      return nt ? stream_range<S, G, DType::f16, true>(op, b, begin, end)                     \
                : stream_range<S, G, DType::f16, false>(op, b, begin, end);                   \
    default: return stream_range<S, G, DType::none, false>(op, b, begin, end);                \
  }
  switch (b.grad_dtype) {
    case DType::bf16: ZK_STREAM_OUT(DType::bf16)
    case DType::f16: ZK_STREAM_OUT(DType::f16)
    default: ZK_STREAM_OUT(DType::f32)
  }
#undef ZK_STREAM_OUT
}

}  // namespace zk
