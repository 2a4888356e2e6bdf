// Sum of squares of a gradient range, accumulated in double: squares of finite fp32/bf16 values
// cannot overflow a double (max ~1.2e77 each), so the sum is finite exactly when every element
// is, and one pass gives both the norm for clipping and the overflow flag. Templates only.
#pragma once
#include <cstdint>
#include <cstring>

#include "kernels/stream.h"

namespace zk {

template <class S, DType G>
double sq_norm_typed(const void* g, int64_t begin, int64_t end) {
  using D = typename S::D;
  D a0 = S::dzero(), a1 = S::dzero(), a2 = S::dzero(), a3 = S::dzero();
  int64_t i = begin;
  // Two vectors per iteration, four accumulators: hides the FMA latency.
  for (; i + 2 * S::W <= end; i += 2 * S::W) {
    S::sq_acc(a0, a1, load_grad<S, G>(g, i));
    S::sq_acc(a2, a3, load_grad<S, G>(g, i + S::W));
  }
  for (; i + S::W <= end; i += S::W) S::sq_acc(a0, a1, load_grad<S, G>(g, i));
  if (i < end) {
    alignas(64) float tail[S::W] = {};  // zeros add nothing
    const int gsize = G == DType::f32 ? 4 : 2;
    std::memcpy(tail, static_cast<const char*>(g) + i * gsize, static_cast<size_t>(end - i) * gsize);
    S::sq_acc(a2, a3, load_grad<S, G>(tail, 0));
  }
  return S::dsum(S::dadd(S::dadd(a0, a1), S::dadd(a2, a3)));
}

template <class S>
double sq_norm_range(const void* g, DType dtype, int64_t begin, int64_t end) {
  switch (dtype) {
    case DType::bf16: return sq_norm_typed<S, DType::bf16>(g, begin, end);
    case DType::f16: return sq_norm_typed<S, DType::f16>(g, begin, end);
    default: return sq_norm_typed<S, DType::f32>(g, begin, end);
  }
}

}  // namespace zk
