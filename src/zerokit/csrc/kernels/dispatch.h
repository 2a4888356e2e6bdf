// Entry points of the host optimizer kernels: pick the instruction set, turn hyper-parameters into
// the float scalars the kernels use, split the range across threads. Torch-free: callers pass raw
// pointers into flat, contiguous buffers of `n` elements each.
#pragma once
#include <cstdint>

#include "kernels/step_args.h"

namespace zk {

enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2 };

const char* isa_name(Isa isa);
// Compiled into this build and supported by this CPU (and its OS, for the AVX register state).
bool isa_supported(Isa isa);
Isa best_isa();
bool has_openmp();

// [Note: bias correction] 1 - beta**step, evaluated as 1.0 - pow(beta, step) in double, which is
// what Python's `1 - beta ** step` computes for a float beta and an integer step. The fallback in
// zerokit/optim/fallback.py uses the same expression, so native and fallback paths (and a resumed
// run on either) see bit-identical corrections.
double bias_correction(double beta, int64_t step);

struct AdamHyper {
  double lr, beta1, beta2, eps, weight_decay;
  int64_t step;          // 1 on the first step
  bool adamw;            // true: decoupled decay (AdamW); false: L2 added to the gradient (Adam)
  bool bias_correction;
  double grad_scale;     // multiplies the gradient first: 1/loss_scale times the clip coefficient
};
struct AdagradHyper {
  double lr, lr_decay, eps, weight_decay;
  int64_t step;
  double grad_scale;
};
struct LionHyper {
  double lr, beta1, beta2, weight_decay;
  double grad_scale;
};

// The Rounding of one call (keys of master, state0, state1 for this seed and step).
Rounding rounding(bool stochastic, uint64_t seed, int64_t step, int64_t index_base);
uint32_t stochastic_key(uint64_t seed, int64_t step, uint32_t buffer);

// Scalars exactly as the kernels see them (exposed so the fallback and tests can check them).
AdamScalars adam_scalars(const AdamHyper& h);
AdagradScalars adagrad_scalars(const AdagradHyper& h);
LionScalars lion_scalars(const LionHyper& h);

// Buffers as in StepBuffers (master and states f32 or bf16, see there): Adam uses state0 = exp_avg, state1 = exp_avg_sq; Adagrad state0 =
// state_sum; Lion state0 = exp_avg. Throw std::invalid_argument on an unsupported isa or dtype.
void adam_step(const StepBuffers& b, int64_t n, const AdamHyper& h, Isa isa, int threads);
void adagrad_step(const StepBuffers& b, int64_t n, const AdagradHyper& h, Isa isa, int threads);
void lion_step(const StepBuffers& b, int64_t n, const LionHyper& h, Isa isa, int threads);
// Sum of squares in double; not finite exactly when some element is not (see norm.h).
double grad_sq_norm(const void* grad, DType dtype, int64_t n, Isa isa, int threads);

}  // namespace zk
