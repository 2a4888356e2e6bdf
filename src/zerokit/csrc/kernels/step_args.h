// Plain data passed from the dispatcher to the per-ISA kernels. Torch-free, no functions: every
// kernel translation unit includes this under its own target pragma, so anything non-template
// defined here could be merged by the linker into an AVX-512 copy and run on a CPU without it.
#pragma once
#include <cstdint>

namespace zk {

// Element type of a gradient or of the optional 16-bit weight output. The integer values are the
// binding's ABI (zerokit/optim/backend.py holds the same table).
enum class DType : int { none = -1, f32 = 0, bf16 = 1, f16 = 2 };

// How the kernel narrows an fp32 result into a bf16 master or state buffer. Round-to-nearest-even
// is the default; stochastic rounding adds 16 random bits below the kept ones before truncating,
// so a value rounds up with probability equal to its distance from the lower bf16 neighbour and
// small updates survive on average. The random bits are a counter-based hash (see sr_hash.h) of
// a key per buffer (from seed, step, buffer) and the element's index (index_base + position),
// never a stateful generator: every ISA, the fallback, any thread split and a resumed run agree.
struct Rounding {
  bool stochastic;
  uint32_t key_param, key_state0, key_state1;  // sr_key(seed, step, 0/1/2), see dispatch.h
  int64_t index_base;                          // index of element 0 in the rounding stream
};

// The buffers one step touches, all flat, contiguous and `n` elements long. `state0`/`state1` are
// exp_avg/exp_avg_sq for Adam, state_sum for Adagrad, exp_avg for Lion (unused ones are null).
// The master (`param`) and the states are fp32 or bf16 (param_dtype, state_dtype); math is fp32
// either way: bf16 loads widen exactly, bf16 stores round as `round` says.
struct StepBuffers {
  void* param;
  const void* grad;
  DType grad_dtype;
  void* state0;
  void* state1;
  void* out16;  // null, or bf16/f16 copy of the updated param
  DType out_dtype;
  DType param_dtype = DType::f32;
  DType state_dtype = DType::f32;
  Rounding round = {false, 0, 0, 0, 0};
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
