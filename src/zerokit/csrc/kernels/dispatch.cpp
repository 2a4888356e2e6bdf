// Run-time ISA choice and threading for the host optimizer kernels; compiled with baseline flags.
#include "kernels/dispatch.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "kernels/isa_table.h"
#include "kernels/simd.h"
#include "kernels/sr_hash.h"

namespace zk {
namespace {

const IsaTable& table_for(Isa isa) {
  if (!isa_supported(isa)) {
    throw std::invalid_argument(std::string("isa '") + isa_name(isa) +
                                "' is not supported by this CPU or build; best available is '" +
                                isa_name(best_isa()) + "'");
  }
#if ZK_X86
  if (isa == Isa::avx512) return avx512::table;
  if (isa == Isa::avx2) return avx2::table;
#endif
  return scalar::table;
}

void check_dtypes(const StepBuffers& b) {
  const int g = static_cast<int>(b.grad_dtype), o = static_cast<int>(b.out_dtype);
  if (g < 0 || g > 2) throw std::invalid_argument("grad dtype code " + std::to_string(g) + " is not f32/bf16/f16 (0/1/2)");
  if (b.out16 ? (o < 1 || o > 2) : o != -1)
    throw std::invalid_argument("out16 dtype code " + std::to_string(o) + " is not bf16/f16 (1/2), or -1 without out16");
  for (const DType d : {b.param_dtype, b.state_dtype}) {
    if (d != DType::f32 && d != DType::bf16)
      throw std::invalid_argument("master/state dtype code " + std::to_string(static_cast<int>(d)) + " is not f32/bf16 (0/1)");
  }
  if (b.round.stochastic && b.param_dtype != DType::bf16 && b.state_dtype != DType::bf16)
    throw std::invalid_argument("stochastic rounding needs a bf16 master or bf16 states; every buffer here is f32");
}

// Element ranges are split in multiples of 64 so every thread starts on a cache line of every
// buffer (fp32 and 16-bit) when the buffers do: no two threads write the same line.
constexpr int64_t kAlign = 64;
// Below this many elements per thread, waking threads costs more than the work.
constexpr int64_t kMinPerThread = 1 << 15;

int threads_for(int64_t n, int threads) {
  const int64_t useful = std::max<int64_t>(1, n / kMinPerThread);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, useful)));
}

template <class Fn>
void parallel_ranges(int64_t n, int nt, Fn&& fn) {
  if (nt <= 1) {
    fn(0, 1, int64_t{0}, n);
    return;
  }
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num(), got = omp_get_num_threads();
    const int64_t chunk = ((n + got - 1) / got + kAlign - 1) / kAlign * kAlign;
    const int64_t begin = std::min<int64_t>(n, t * chunk), end = std::min<int64_t>(n, begin + chunk);
    fn(t, got, begin, end);
  }
#else
  fn(0, 1, int64_t{0}, n);
#endif
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    case Isa::scalar: return "scalar";
  }
  return "unknown";
}

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::scalar: return true;
#if ZK_X86 && defined(__GNUC__)
    case Isa::avx2:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case Isa::avx512:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx512f") && isa_supported(Isa::avx2);
#endif
    default: return false;
  }
}

Isa best_isa() {
  if (isa_supported(Isa::avx512)) return Isa::avx512;
  if (isa_supported(Isa::avx2)) return Isa::avx2;
  return Isa::scalar;
}

bool has_openmp() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

Rounding rounding(bool stochastic, uint64_t seed, int64_t step, int64_t index_base) {
  if (!stochastic) return Rounding{false, 0, 0, 0, index_base};
  return Rounding{true, sr_key(seed, step, 0), sr_key(seed, step, 1), sr_key(seed, step, 2), index_base};
}

uint32_t stochastic_key(uint64_t seed, int64_t step, uint32_t buffer) { return sr_key(seed, step, buffer); }

double bias_correction(double beta, int64_t step) {
  return 1.0 - std::pow(beta, static_cast<double>(step));
}

AdamScalars adam_scalars(const AdamHyper& h) {
  const double bc1 = h.bias_correction ? bias_correction(h.beta1, h.step) : 1.0;
  const double bc2 = h.bias_correction ? bias_correction(h.beta2, h.step) : 1.0;
  AdamScalars s{};
  s.grad_scale = static_cast<float>(h.grad_scale);
  s.l2 = !h.adamw && h.weight_decay != 0.0;
  s.decoupled = h.adamw && h.weight_decay != 0.0;
  s.l2_decay = static_cast<float>(h.weight_decay);
  s.param_decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  s.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  s.eps = static_cast<float>(h.eps);
  s.inv_bias_correction2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  s.neg_step_size = static_cast<float>(-(h.lr / bc1));
  return s;
}

AdagradScalars adagrad_scalars(const AdagradHyper& h) {
  AdagradScalars s{};
  s.grad_scale = static_cast<float>(h.grad_scale);
  s.l2 = h.weight_decay != 0.0;
  s.l2_decay = static_cast<float>(h.weight_decay);
  s.eps = static_cast<float>(h.eps);
  s.neg_clr = static_cast<float>(-(h.lr / (1.0 + static_cast<double>(h.step - 1) * h.lr_decay)));
  return s;
}

LionScalars lion_scalars(const LionHyper& h) {
  LionScalars s{};
  s.grad_scale = static_cast<float>(h.grad_scale);
  s.decoupled = h.weight_decay != 0.0;
  s.param_decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  s.beta1 = static_cast<float>(h.beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  s.neg_lr = static_cast<float>(-h.lr);
  return s;
}

void adam_step(const StepBuffers& b, int64_t n, const AdamHyper& h, Isa isa, int threads) {
  check_dtypes(b);
  const auto& t = table_for(isa);
  const AdamScalars s = adam_scalars(h);
  parallel_ranges(n, threads_for(n, threads), [&](int, int, int64_t lo, int64_t hi) { t.adam(s, b, lo, hi); });
}

void adagrad_step(const StepBuffers& b, int64_t n, const AdagradHyper& h, Isa isa, int threads) {
  check_dtypes(b);
  const auto& t = table_for(isa);
  const AdagradScalars s = adagrad_scalars(h);
  parallel_ranges(n, threads_for(n, threads), [&](int, int, int64_t lo, int64_t hi) { t.adagrad(s, b, lo, hi); });
}

void lion_step(const StepBuffers& b, int64_t n, const LionHyper& h, Isa isa, int threads) {
  check_dtypes(b);
  const auto& t = table_for(isa);
  const LionScalars s = lion_scalars(h);
  parallel_ranges(n, threads_for(n, threads), [&](int, int, int64_t lo, int64_t hi) { t.lion(s, b, lo, hi); });
}

double grad_sq_norm(const void* grad, DType dtype, int64_t n, Isa isa, int threads) {
  const int d = static_cast<int>(dtype);
  if (d < 0 || d > 2) throw std::invalid_argument("grad dtype code " + std::to_string(d) + " is not f32/bf16/f16 (0/1/2)");
  const auto& t = table_for(isa);
  const int nt = threads_for(n, threads);
  // Per-thread partials summed in thread order: the result depends on the ISA and thread count,
  // never on scheduling.
  std::vector<double> partial(static_cast<size_t>(nt), 0.0);
  parallel_ranges(n, nt, [&](int i, int, int64_t lo, int64_t hi) { partial[i] = t.sq_norm(grad, dtype, lo, hi); });
  double sum = 0.0;
  for (double p : partial) sum += p;
  return sum;
}

}  // namespace zk
