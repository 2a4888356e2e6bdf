// Plain data passed from the dispatcher to the per-ISA kernels. Torch-free, no functions: every
// kernel translation unit includes this under its own target pragma, so anything non-template
// defined here could be merged by the linker into an AVX-512 copy and run on a CPU without it.
#pragma once
#include <cstdint>

namespace zk {

// Element type of a gradient or of the optional 16-bit weight output. The integer values are the
// binding's ABI (zerokit/optim/backend.py holds the same table).
enum class DType : int { none = -1, f32 = 0, bf16 = 1, f16 = 2 };

// The buffers one step touches, all flat, contiguous and `n` elements long. `state0`/`state1` are
// exp_avg/exp_avg_sq for Adam, state_sum for Adagrad, exp_avg for Lion (unused ones are null).
struct StepBuffers {
  float* param;
  const void* grad;
  DType grad_dtype;
  float* state0;
  float* state1;
  void* out16;  // null, or bf16/f16 copy of the updated param
  DType out_dtype;
};

// Scalars are computed once per call in double by the dispatcher (see dispatch.cpp), then rounded
// to float, which is what torch does with Python-float hyper-parameters on fp32 tensors.
struct AdamScalars {
  float grad_scale;
  float l2_decay;         // weight_decay when the decay is added to the gradient (Adam), else 0
  float param_decay;      // 1 - lr * weight_decay when decoupled (AdamW), else 1
  float one_minus_beta1;  // lerp weight of exp_avg towards the gradient
  float beta2;
  float one_minus_beta2;
  float eps;
  float inv_bias_correction2_sqrt;
  float neg_step_size;    // -lr / bias_correction1
  bool l2;
  bool decoupled;
};

struct AdagradScalars {
  float grad_scale;
  float l2_decay;
  float eps;
  float neg_clr;  // -lr / (1 + (step - 1) * lr_decay)
  bool l2;
};

struct LionScalars {
  float grad_scale;
  float param_decay;  // 1 - lr * weight_decay
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float neg_lr;
  bool decoupled;
};

}  // namespace zk
