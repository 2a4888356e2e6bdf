// Adam / AdamW on one contiguous range, one pass over memory: each of param, grad, exp_avg,
// exp_avg_sq is loaded once and stored once (grad only loaded), the 16-bit copy of the new param
// is written from registers. Templates only; instantiated per ISA (see simd.h).
#pragma once
#include "kernels/stream.h"

namespace zk {

template <class S>
struct AdamOp {
  using F = typename S::F;
  F grad_scale, l2_decay, param_decay, one_minus_beta1, beta2, one_minus_beta2, eps, inv_bc2_sqrt,
      neg_step_size;
  bool l2, decoupled;

  explicit AdamOp(const AdamScalars& s)
      : grad_scale(S::set1(s.grad_scale)), l2_decay(S::set1(s.l2_decay)),
        param_decay(S::set1(s.param_decay)), one_minus_beta1(S::set1(s.one_minus_beta1)),
        beta2(S::set1(s.beta2)), one_minus_beta2(S::set1(s.one_minus_beta2)), eps(S::set1(s.eps)),
        inv_bc2_sqrt(S::set1(s.inv_bias_correction2_sqrt)), neg_step_size(S::set1(s.neg_step_size)),
        l2(s.l2), decoupled(s.decoupled) {}

  // The order of operations follows torch.optim.Adam's single-tensor path (lerp_ for exp_avg,
  // mul_/addcmul_ for exp_avg_sq, addcdiv_ for the param) so the two agree to an ulp or so.
  // IO::madd is fused for fp32 storage only (see Io in stream.h).
  template <class IO>
  void apply(const StepBuffers& b, int64_t i, int64_t at) const {
    F g = S::mul(IO::grad(b, i), grad_scale);
    F p = IO::param(b, i);
    if (l2) g = IO::madd(p, l2_decay, g);
    if (decoupled) p = S::mul(p, param_decay);
    F m = IO::state0(b, i);
    m = IO::madd(one_minus_beta1, S::sub(g, m), m);
    F v = IO::state1(b, i);
    v = IO::madd(S::mul(one_minus_beta2, g), g, S::mul(v, beta2));
    // Multiplying by 1/sqrt(bias_correction2) instead of dividing saves a division per element;
    // it moves denom by at most an ulp.
    const F denom = IO::madd(S::sqrt(v), inv_bc2_sqrt, eps);
    p = S::add(p, S::div(S::mul(neg_step_size, m), denom));
    IO::put_state0(b, i, at, m);
    IO::put_state1(b, i, at, v);
    IO::put_param(b, i, at, p);
  }
};

template <class S>
void adam_range(const AdamScalars& s, const StepBuffers& b, int64_t begin, int64_t end) {
  stream_dispatch<S>(AdamOp<S>(s), b, begin, end);
}

}  // namespace zk
