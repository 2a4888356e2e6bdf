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
  template <class IO>
  void apply(const StepBuffers& b, int64_t i, int64_t at) const {
    F g = S::mul(IO::grad(b, i), grad_scale);
    F p = IO::param(b, i);
    if (l2) g = IO::madd(p, l2_decay, g);
    const F sum = S::add(IO::state0(b, i), S::mul(g, g));
    const F std_ = S::add(S::sqrt(sum), eps);
    p = S::add(p, S::div(S::mul(neg_clr, g), std_));
    IO::put_state0(b, i, at, sum);
    IO::put_param(b, i, at, p);
  }
};

template <class S>
void adagrad_range(const AdagradScalars& s, const StepBuffers& b, int64_t begin, int64_t end) {
  stream_dispatch<S>(AdagradOp<S>(s), b, begin, end);
}

}  // namespace zk
