// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") on one contiguous
// range, one pass over memory. Templates only (see simd.h).
#pragma once
#include "kernels/stream.h"

namespace zk {

template <class S>
struct LionOp {
  using F = typename S::F;
  F grad_scale, param_decay, beta1, one_minus_beta1, beta2, one_minus_beta2, neg_lr;
  bool decoupled;

  explicit LionOp(const LionScalars& s)
      : grad_scale(S::set1(s.grad_scale)), param_decay(S::set1(s.param_decay)),
        beta1(S::set1(s.beta1)), one_minus_beta1(S::set1(s.one_minus_beta1)),
        beta2(S::set1(s.beta2)), one_minus_beta2(S::set1(s.one_minus_beta2)),
        neg_lr(S::set1(s.neg_lr)), decoupled(s.decoupled) {}

  // update = sign(beta1*m + (1-beta1)*g); p = p*(1 - lr*wd) - lr*update; m = beta2*m + (1-beta2)*g.
  // Each blend is round(m*beta) then fused with g*(1-beta), which is what torch's
  // m.mul(beta).add(g, alpha=1-beta) computes; matching it matters because a last-bit difference
  // near zero flips the sign and moves the param by 2*lr.
  template <class IO>
  void apply(const StepBuffers& b, int64_t i, int64_t at) const {
    const F g = S::mul(IO::grad(b, i), grad_scale);
    F p = IO::param(b, i);
    F m = IO::state0(b, i);
    if (decoupled) p = S::mul(p, param_decay);
    const F c = IO::madd(g, one_minus_beta1, S::mul(m, beta1));
    p = IO::madd(S::sign(c), neg_lr, p);
    m = IO::madd(g, one_minus_beta2, S::mul(m, beta2));
    IO::put_state0(b, i, at, m);
    IO::put_param(b, i, at, p);
  }
};

template <class S>
void lion_range(const LionScalars& s, const StepBuffers& b, int64_t begin, int64_t end) {
  stream_dispatch<S>(LionOp<S>(s), b, begin, end);
}

}  // namespace zk
