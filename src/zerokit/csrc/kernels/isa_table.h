// One function table per instruction set; dispatch.cpp chooses among them at run time.
#pragma once
#include <cstdint>

#include "kernels/step_args.h"

namespace zk {

struct IsaTable {
  const char* name;
  void (*adam)(const AdamScalars&, const StepBuffers&, int64_t begin, int64_t end);
  void (*adagrad)(const AdagradScalars&, const StepBuffers&, int64_t begin, int64_t end);
  void (*lion)(const LionScalars&, const StepBuffers&, int64_t begin, int64_t end);
  double (*sq_norm)(const void* grad, DType dtype, int64_t begin, int64_t end);
};

// Defined in isa_<name>.cpp; the x86 ones only on x86 builds.
namespace scalar { extern const IsaTable table; }
namespace avx2 { extern const IsaTable table; }
namespace avx512 { extern const IsaTable table; }

}  // namespace zk

// Body of an isa_<name>.cpp: instantiates every kernel for vocabulary struct `S` under the
// translation unit's target pragma.
#define ZK_DEFINE_ISA_TABLE(ns, S)                                                       \
  namespace zk {                                                                         \
  namespace ns {                                                                         \
  extern const IsaTable table = {#ns, &adam_range<S>, &adagrad_range<S>, &lion_range<S>, \
                                 &sq_norm_range<S>};                                     \
  }                                                                                      \
  }
