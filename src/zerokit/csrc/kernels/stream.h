// The loop every element-wise optimizer kernel shares: whole vectors, then the tail through the
// same vector code on a zero-padded stack copy (see simd.h for why), and the loads and stores of
// each buffer in its dtype (the `Io` policy below). Templates only.
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

// A master or state buffer in dtype D (f32 or bf16): loads widen exactly, bf16 stores round to
// nearest even or stochastically (Rounding in step_args.h) with the random bits of element `at`.
template <class S, DType D>
inline typename S::F load_stored(const void* p, int64_t i) {
  if constexpr (D == DType::bf16) return S::load_bf16(static_cast<const uint16_t*>(p) + i);
  else return S::load(static_cast<const float*>(p) + i);
}

template <class S, DType D>
inline void store_stored(void* p, int64_t i, typename S::F x, const Rounding& r, uint32_t key,
                         int64_t at) {
  if constexpr (D == DType::bf16) {
    uint16_t* q = static_cast<uint16_t*>(p) + i;
    if (r.stochastic) S::store_bf16_sr(q, x, key, static_cast<uint32_t>(r.index_base + at));
    else S::store_bf16(q, x);
  } else {
    S::store(static_cast<float*>(p) + i, x);
  }
}

// Everything an op needs to know about the dtypes of one call, as one type: G gradient, O 16-bit
// output (none: no output), NT non-temporal output stores, P master, St states.
template <class S, DType G, DType O, bool NT, DType P, DType St>
struct Io {
  using F = typename S::F;
  // All-fp32 storage is the original mixed kernel, which fuses multiply-adds. With any bf16
  // storage each multiply and add rounds separately, in the order of the torch fallback
  // (zerokit/optim/fallback_bf16.py), so every ISA and the fallback give the same bits: an FMA has
  // no torch counterpart that rounds once on every CPU.
  static constexpr bool kFused = P == DType::f32 && St == DType::f32;
  static F madd(F a, F b, F c) {
    if constexpr (kFused) return S::fmadd(a, b, c);
    else return S::add(S::mul(a, b), c);
  }
  static F grad(const StepBuffers& b, int64_t i) { return load_grad<S, G>(b.grad, i); }
  static F param(const StepBuffers& b, int64_t i) { return load_stored<S, P>(b.param, i); }
  static F state0(const StepBuffers& b, int64_t i) { return load_stored<S, St>(b.state0, i); }
  static F state1(const StepBuffers& b, int64_t i) { return load_stored<S, St>(b.state1, i); }
  static void put_state0(const StepBuffers& b, int64_t i, int64_t at, F x) {
    store_stored<S, St>(b.state0, i, x, b.round, b.round.key_state0, at);
  }
  static void put_state1(const StepBuffers& b, int64_t i, int64_t at, F x) {
    store_stored<S, St>(b.state1, i, x, b.round, b.round.key_state1, at);
  }
  // The new master, and its 16-bit copy: for a bf16 master the copy is made from the stored
  // (rounded) master, so the weights the model computes with are the master's bits.
  static void put_param(const StepBuffers& b, int64_t i, int64_t at, F x) {
    store_stored<S, P>(b.param, i, x, b.round, b.round.key_param, at);
    if constexpr (O != DType::none) {
      if constexpr (P == DType::bf16) x = param(b, i);
      store_out16<S, O, NT>(b.out16, i, x);
    }
  }
};

constexpr int dtype_size(DType d) { return d == DType::f32 ? 4 : 2; }

// Calls op.template apply<Io>(buffers, i, at) for each vector of [begin, end); `at` is the
// element's index in the caller's buffers (it differs from i only for the tail's stack copy).
template <class S, DType G, DType O, bool NT, DType P, DType St, class Op>
inline void stream_range(const Op& op, const StepBuffers& b, int64_t begin, int64_t end) {
  using IO = Io<S, G, O, NT, P, St>;
  int64_t i = begin;
  for (; i + S::W <= end; i += S::W) op.template apply<IO>(b, i, i);
  if constexpr (NT) S::fence();
  const int64_t rest = end - i;
  if (rest <= 0) return;

  alignas(64) float param[S::W] = {};  // each large enough for W elements of any dtype
  alignas(64) float state0[S::W] = {};
  alignas(64) float state1[S::W] = {};
  alignas(64) float grad[S::W] = {};
  alignas(64) uint16_t out[S::W] = {};
  const size_t np = static_cast<size_t>(rest) * dtype_size(P);
  const size_t ns = static_cast<size_t>(rest) * dtype_size(St);
  const int psize = dtype_size(P), ssize = dtype_size(St), gsize = dtype_size(G);

  std::memcpy(param, static_cast<const char*>(b.param) + i * psize, np);
  std::memcpy(grad, static_cast<const char*>(b.grad) + i * gsize, static_cast<size_t>(rest) * gsize);
  if (b.state0) std::memcpy(state0, static_cast<const char*>(b.state0) + i * ssize, ns);
  if (b.state1) std::memcpy(state1, static_cast<const char*>(b.state1) + i * ssize, ns);
  StepBuffers t = b;
  t.param = param;
  t.grad = grad;
  t.state0 = b.state0 ? state0 : nullptr;
  t.state1 = b.state1 ? state1 : nullptr;
  t.out16 = b.out16 ? out : nullptr;
  op.template apply<Io<S, G, O, false, P, St>>(t, 0, i);
  std::memcpy(static_cast<char*>(b.param) + i * psize, param, np);
  if (b.state0) std::memcpy(static_cast<char*>(b.state0) + i * ssize, state0, ns);
  if (b.state1) std::memcpy(static_cast<char*>(b.state1) + i * ssize, state1, ns);
  if (b.out16) std::memcpy(static_cast<uint16_t*>(b.out16) + i, out, static_cast<size_t>(rest) * 2);
}

// Instantiates stream_range for the runtime (gradient, output) dtype pair and output alignment.
template <class S, DType P, DType St, class Op>
inline void stream_dispatch_io(const Op& op, const StepBuffers& b, int64_t begin, int64_t end) {
  // Every vector store lands at begin + k*W, so one check covers the whole range.
  const bool nt = b.out16 && reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(b.out16) + begin) % (2 * S::W) == 0;
#define ZK_STREAM_OUT(G)                                                                      \
  switch (b.out_dtype) {                                                                      \
    case DType::bf16:                                                                         \
      return nt ? stream_range<S, G, DType::bf16, true, P, St>(op, b, begin, end)             \
                : stream_range<S, G, DType::bf16, false, P, St>(op, b, begin, end);           \
    case DType::f16:                                                                          \
      return nt ? stream_range<S, G, DType::f16, true, P, St>(op, b, begin, end)              \
                : stream_range<S, G, DType::f16, false, P, St>(op, b, begin, end);            \
    default: return stream_range<S, G, DType::none, false, P, St>(op, b, begin, end);         \
  }
  switch (b.grad_dtype) {
    case DType::bf16: ZK_STREAM_OUT(DType::bf16)
    case DType::f16: ZK_STREAM_OUT(DType::f16)
    default: ZK_STREAM_OUT(DType::f32)
  }
#undef ZK_STREAM_OUT
}

// ... and for the (master, state) storage pair.
template <class S, class Op>
inline void stream_dispatch(const Op& op, const StepBuffers& b, int64_t begin, int64_t end) {
  const bool p16 = b.param_dtype == DType::bf16, s16 = b.state_dtype == DType::bf16;
  if (!p16 && !s16) return stream_dispatch_io<S, DType::f32, DType::f32>(op, b, begin, end);
  if (p16 && !s16) return stream_dispatch_io<S, DType::bf16, DType::f32>(op, b, begin, end);
  if (!p16 && s16) return stream_dispatch_io<S, DType::f32, DType::bf16>(op, b, begin, end);
  return stream_dispatch_io<S, DType::bf16, DType::bf16>(op, b, begin, end);
}

}  // namespace zk
