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

template <class S, DType O>
inline void store_out16(void* out, int64_t i, typename S::F x) {
  if constexpr (O == DType::bf16) {
    S::store_bf16(static_cast<uint16_t*>(out) + i, x);
  } else if constexpr (O == DType::f16) {
    S::store_f16(static_cast<uint16_t*>(out) + i, x);
  }
}

// Calls op.template apply<G, O>(buffers, i) for each vector of [begin, end).
template <class S, DType G, DType O, class Op>
inline void stream_range(const Op& op, const StepBuffers& b, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + S::W <= end; i += S::W) op.template apply<G, O>(b, i);
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
  op.template apply<G, O>(t, 0);
  std::memcpy(b.param + i, param, nf);
  if (b.state0) std::memcpy(b.state0 + i, state0, nf);
  if (b.state1) std::memcpy(b.state1 + i, state1, nf);
  if (b.out16) std::memcpy(static_cast<uint16_t*>(b.out16) + i, out, static_cast<size_t>(rest) * 2);
}

// Instantiates stream_range for the runtime (gradient, output) dtype pair.
template <class S, class Op>
inline void stream_dispatch(const Op& op, const StepBuffers& b, int64_t begin, int64_t end) {
#define ZK_STREAM_OUT(G)                                                     \
  switch (b.out_dtype) {                                                     \
    case DType::bf16: return stream_range<S, G, DType::bf16>(op, b, begin, end); \
    case DType::f16: return stream_range<S, G, DType::f16>(op, b, begin, end);   \
    default: return stream_range<S, G, DType::none>(op, b, begin, end);          \
  }
  switch (b.grad_dtype) {
    case DType::bf16: ZK_STREAM_OUT(DType::bf16)
    case DType::f16: ZK_STREAM_OUT(DType::f16)
    default: ZK_STREAM_OUT(DType::f32)
  }
#undef ZK_STREAM_OUT
}

}  // namespace zk
