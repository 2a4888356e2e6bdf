// Thin pybind11 binding of the host optimizer kernels (kernels/dispatch.h). Buffers arrive as raw
// addresses (tensor.data_ptr()) plus one length; zerokit/optim/host.py checks dtypes, devices,
// contiguity and lengths before calling, so this layer only converts and releases the GIL.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "kernels/dispatch.h"

namespace py = pybind11;

namespace {

// Master/state dtypes and the rounding of bf16 stores, the same for every kernel.
struct Storage {
  int param_dtype, state_dtype;
  bool stochastic;
  uint64_t seed;
  int64_t index_base;
};

zk::StepBuffers buffers(uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t state0,
                        uintptr_t state1, uintptr_t out16, int out_dtype, const Storage& st,
                        int64_t step) {
  zk::StepBuffers b{reinterpret_cast<void*>(param), reinterpret_cast<const void*>(grad),
                    static_cast<zk::DType>(grad_dtype), reinterpret_cast<void*>(state0),
                    reinterpret_cast<void*>(state1), reinterpret_cast<void*>(out16),
                    static_cast<zk::DType>(out_dtype)};
  b.param_dtype = static_cast<zk::DType>(st.param_dtype);
  b.state_dtype = static_cast<zk::DType>(st.state_dtype);
  b.round = zk::rounding(st.stochastic, st.seed, step, st.index_base);
  return b;
}

#define ZK_STORAGE_ARGS                                                                      \
  py::arg("param_dtype") = 0, py::arg("state_dtype") = 0, py::arg("stochastic") = false,     \
      py::arg("seed") = 0, py::arg("index_base") = 0

zk::Isa to_isa(int isa) {
  if (isa < 0 || isa > 2) throw py::value_error("isa code " + std::to_string(isa) + " is not 0 (scalar), 1 (avx2) or 2 (avx512)");
  return static_cast<zk::Isa>(isa);
}

}  // namespace

PYBIND11_MODULE(_host_kernels, m) {
  m.doc() = "zerokit host optimizer kernels (torch-free; use zerokit.optim.host)";
  using release = py::call_guard<py::gil_scoped_release>;

  m.def("isa_supported", [](int isa) { return zk::isa_supported(to_isa(isa)); });
  m.def("best_isa", [] { return static_cast<int>(zk::best_isa()); });
  m.def("has_openmp", &zk::has_openmp);
  m.def("stochastic_key", &zk::stochastic_key, py::arg("seed"), py::arg("step"), py::arg("buffer"));
  m.def("bias_correction", &zk::bias_correction, py::arg("beta"), py::arg("step"));
  m.def("adam_scalars",
        [](double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
           bool adamw, bool bias_correction, double grad_scale) {
          const auto s = zk::adam_scalars({lr, beta1, beta2, eps, weight_decay, step, adamw, bias_correction, grad_scale});
          py::dict d;
          d["grad_scale"] = s.grad_scale; d["l2_decay"] = s.l2_decay; d["param_decay"] = s.param_decay;
          d["one_minus_beta1"] = s.one_minus_beta1; d["beta2"] = s.beta2;
          d["one_minus_beta2"] = s.one_minus_beta2; d["eps"] = s.eps;
          d["inv_bias_correction2_sqrt"] = s.inv_bias_correction2_sqrt;
          d["neg_step_size"] = s.neg_step_size; d["l2"] = s.l2; d["decoupled"] = s.decoupled;
          return d;
        },
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("step"), py::arg("adamw"), py::arg("bias_correction"), py::arg("grad_scale"));

  m.def("adam",
        [](uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg, uintptr_t exp_avg_sq,
           uintptr_t out16, int out_dtype, int64_t n, double lr, double beta1, double beta2,
           double eps, double weight_decay, int64_t step, bool adamw, bool bias_correction,
           double grad_scale, int isa, int threads, int param_dtype, int state_dtype, bool stochastic,
           uint64_t seed, int64_t index_base) {
          const Storage st{param_dtype, state_dtype, stochastic, seed, index_base};
          zk::adam_step(buffers(param, grad, grad_dtype, exp_avg, exp_avg_sq, out16, out_dtype, st, step), n,
                        {lr, beta1, beta2, eps, weight_decay, step, adamw, bias_correction, grad_scale},
                        to_isa(isa), threads);
        },
        release(), py::arg("param"), py::arg("grad"), py::arg("grad_dtype"), py::arg("exp_avg"),
        py::arg("exp_avg_sq"), py::arg("out16"), py::arg("out_dtype"), py::arg("n"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("step"),
        py::arg("adamw"), py::arg("bias_correction"), py::arg("grad_scale"), py::arg("isa"),
        py::arg("threads"), ZK_STORAGE_ARGS);

  m.def("adagrad",
        [](uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t state_sum, uintptr_t out16,
           int out_dtype, int64_t n, double lr, double lr_decay, double eps, double weight_decay,
           int64_t step, double grad_scale, int isa, int threads, int param_dtype, int state_dtype,
           bool stochastic, uint64_t seed, int64_t index_base) {
          const Storage st{param_dtype, state_dtype, stochastic, seed, index_base};
          zk::adagrad_step(buffers(param, grad, grad_dtype, state_sum, 0, out16, out_dtype, st, step), n,
                           {lr, lr_decay, eps, weight_decay, step, grad_scale}, to_isa(isa), threads);
        },
        release(), py::arg("param"), py::arg("grad"), py::arg("grad_dtype"), py::arg("state_sum"),
        py::arg("out16"), py::arg("out_dtype"), py::arg("n"), py::arg("lr"), py::arg("lr_decay"),
        py::arg("eps"), py::arg("weight_decay"), py::arg("step"), py::arg("grad_scale"),
        py::arg("isa"), py::arg("threads"), ZK_STORAGE_ARGS);

  m.def("lion",
        [](uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg, uintptr_t out16,
           int out_dtype, int64_t n, double lr, double beta1, double beta2, double weight_decay,
           double grad_scale, int isa, int threads, int param_dtype, int state_dtype, bool stochastic,
           uint64_t seed, int64_t index_base, int64_t step) {
          // Lion has no bias correction; `step` only keys the stochastic rounding.
          const Storage st{param_dtype, state_dtype, stochastic, seed, index_base};
          zk::lion_step(buffers(param, grad, grad_dtype, exp_avg, 0, out16, out_dtype, st, step), n,
                        {lr, beta1, beta2, weight_decay, grad_scale}, to_isa(isa), threads);
        },
        release(), py::arg("param"), py::arg("grad"), py::arg("grad_dtype"), py::arg("exp_avg"),
        py::arg("out16"), py::arg("out_dtype"), py::arg("n"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("weight_decay"), py::arg("grad_scale"), py::arg("isa"),
        py::arg("threads"), ZK_STORAGE_ARGS, py::arg("step") = 1);

  m.def("grad_sq_norm",
        [](uintptr_t grad, int grad_dtype, int64_t n, int isa, int threads) {
          return zk::grad_sq_norm(reinterpret_cast<const void*>(grad), static_cast<zk::DType>(grad_dtype), n,
                                  to_isa(isa), threads);
        },
        release(), py::arg("grad"), py::arg("grad_dtype"), py::arg("n"), py::arg("isa"),
        py::arg("threads"));
}
