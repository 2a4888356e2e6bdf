// Adagrad on one contiguous range, one pass over memory. Templates only (see simd.h).
#pragma once
#include "kernels/stream.h"

namespace zk {

template <class S>
struct AdagradOp {
  using F = typename S::F;
  F grad_scale, l2_decay, eps, neg_clr;
  bool l2;

  explicit AdagradOp(const AdagradScalars& s)
      : grad_scale(S::set1(s.grad_scale)), l2_decay(S::set1(s.l2_decay)), eps(S::set1(s.eps)),
        neg_clr(S::set1(s.neg_clr)), l2(s.l2) {}

  // Same order as torch.optim.Adagrad: sum += g*g; std = sqrt(sum) + eps; p += (-clr * g) / std.
  template <DType G, DType O, bool NT>
  void apply(const StepBuffers& b, int64_t i) const {
    F g = S::mul(load_grad<S, G>(b.grad, i), grad_scale);
    F p = S::load(b.param + i);
    if (l2) g = S::fmadd(p, l2_decay, g);
    const F sum = S::add(S::load(b.state0 + i), S::mul(g, g));
    const F std_ = S::add(S::sqrt(sum), eps);
    p = S::add(p, S::div(S::mul(neg_clr, g), std_));
    S::store(b.state0 + i, sum);
    S::store(b.param + i, p);
    store_out16<S, O, NT>(b.out16, i, p);
  }
};

template <class S>
void adagrad_range(const AdagradScalars& s, const StepBuffers& b, int64_t begin, int64_t end) {
  stream_dispatch<S>(AdagradOp<S>(s), b, begin, end);
}

}  // namespace zk
