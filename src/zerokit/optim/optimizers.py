"""torch.optim.Optimizer front ends over the host kernels, for fp32 CPU parameters.

HostAdam is a drop-in for torch.optim.Adam (adamw_mode=False) and torch.optim.AdamW
(adamw_mode=True, the default, as in DeepSpeedCPUAdam); HostAdagrad for torch.optim.Adagrad;
HostLion for the reference Lion. State keys and the float32 `step` tensor follow torch's, so
state dicts move between these and torch's optimizers. Hyper-parameters are read from the param
groups at every step, so torch.optim.lr_scheduler works unchanged.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch.optim import Optimizer

from zerokit.optim import host
from zerokit.optim.backend import resolve


def _check_range(name: str, value: float, low: float, high: float | None = None) -> None:
    ok = value >= low and (high is None or value < high)
    if not ok:
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name}={value!r} must be {bound}")


class _HostOptimizer(Optimizer):
    """Shared step loop: per parameter, create state once, count the step, call one kernel."""

    def __init__(self, params: Iterable, defaults: dict, impl: str | None, threads: int | None):
        resolve(impl, threads)  # fail at construction on a bad impl / threads, not at step 1
        self.impl, self.threads = impl, threads
        super().__init__(params, defaults)

    def _init_state(self, p: torch.Tensor, state: dict, group: dict) -> None:
        raise NotImplementedError

    def _update(self, master: torch.Tensor, grad: torch.Tensor, state: dict, group: dict,
                step: int) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            # Groups loaded from another optimizer's state dict (torch's) lack our own keys.
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                where = f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)})"
                if p.device.type != "cpu" or p.dtype not in (torch.float32, torch.bfloat16):
                    raise ValueError(f"{type(self).__name__} steps fp32 or bf16 CPU parameters; "
                                     f"{where} is {p.dtype} on {p.device}")
                if p.grad.is_sparse:
                    raise ValueError(f"{type(self).__name__} does not take sparse gradients; {where}")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    self._init_state(p, state, group)
                state["step"] += 1
                # Kernels need contiguous buffers; a strided parameter is stepped in a copy.
                master = p if p.is_contiguous() else p.contiguous()
                self._update(master.view(-1), p.grad.contiguous().view(-1), state, group,
                             int(state["step"].item()))
                if master is not p:
                    p.copy_(master)
        return loss


def _zeros(p: torch.Tensor, group: dict, fill: float = 0.0) -> torch.Tensor:
    """A state buffer: fp32, or the parameter's dtype where the group says
    fp32_optimizer_states=False (DeepSpeedCPUAdam's meaning: bf16 moments for bf16 parameters)."""
    dtype = torch.float32 if group.get("fp32_optimizer_states", True) else p.dtype
    return torch.full(p.shape, fill, dtype=dtype)


class HostAdam(_HostOptimizer):
    """Adam / AdamW on CPU with the native kernels.

    adamw_mode=True: decoupled weight decay (torch.optim.AdamW); False: L2 decay added to the
    gradient (torch.optim.Adam). Note torch.optim.AdamW's default weight_decay is 1e-2; this
    class, like DeepSpeedCPUAdam, defaults to 0. amsgrad is not implemented.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, adamw_mode: bool = True,
                 bias_correction: bool = True, amsgrad: bool = False, *, maximize: bool = False,
                 impl: str | None = None, threads: int | None = None):
        if amsgrad:
            raise ValueError("HostAdam: amsgrad=True is not implemented; use torch.optim.Adam(amsgrad=True)")
        _check_range("lr", lr, 0.0)
        _check_range("eps", eps, 0.0)
        _check_range("betas[0]", betas[0], 0.0, 1.0)
        _check_range("betas[1]", betas[1], 0.0, 1.0)
        _check_range("weight_decay", weight_decay, 0.0)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        adamw_mode=adamw_mode, bias_correction=bias_correction, maximize=maximize)
        super().__init__(params, defaults, impl, threads)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        # torch.optim.Adam/AdamW record the decay mode as decoupled_weight_decay.
        for group in self.param_groups:
            if "adamw_mode" not in group and "decoupled_weight_decay" in group:
                group["adamw_mode"] = bool(group["decoupled_weight_decay"])

    def _init_state(self, p, state, group):
        state["exp_avg"] = _zeros(p, group)
        state["exp_avg_sq"] = _zeros(p, group)

    def _update(self, master, grad, state, group, step):
        beta1, beta2 = group["betas"]
        host.adam_step(master, grad, state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1),
                       lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                       weight_decay=group["weight_decay"], step=step, adamw=group["adamw_mode"],
                       bias_correction=group["bias_correction"],
                       grad_scale=-1.0 if group["maximize"] else 1.0,
                       impl=self.impl, threads=self.threads)


class HostAdagrad(_HostOptimizer):
    """Adagrad on CPU with the native kernels (torch.optim.Adagrad semantics and defaults)."""

    def __init__(self, params: Iterable, lr: float = 1e-2, lr_decay: float = 0.0,
                 weight_decay: float = 0.0, initial_accumulator_value: float = 0.0,
                 eps: float = 1e-10, *, maximize: bool = False, impl: str | None = None,
                 threads: int | None = None):
        _check_range("lr", lr, 0.0)
        _check_range("lr_decay", lr_decay, 0.0)
        _check_range("weight_decay", weight_decay, 0.0)
        _check_range("initial_accumulator_value", initial_accumulator_value, 0.0)
        _check_range("eps", eps, 0.0)
        defaults = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps,
                        initial_accumulator_value=initial_accumulator_value, maximize=maximize)
        super().__init__(params, defaults, impl, threads)

    def _init_state(self, p, state, group):
        state["sum"] = _zeros(p, group, group["initial_accumulator_value"])

    def _update(self, master, grad, state, group, step):
        host.adagrad_step(master, grad, state["sum"].view(-1), lr=group["lr"],
                          lr_decay=group["lr_decay"], eps=group["eps"],
                          weight_decay=group["weight_decay"], step=step,
                          grad_scale=-1.0 if group["maximize"] else 1.0,
                          impl=self.impl, threads=self.threads)


class HostLion(_HostOptimizer):
    """Lion (Chen et al. 2023) on CPU with the native kernels: decoupled weight decay, one state."""

    def __init__(self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, maximize: bool = False, impl: str | None = None,
                 threads: int | None = None):
        _check_range("lr", lr, 0.0)
        _check_range("betas[0]", betas[0], 0.0, 1.0)
        _check_range("betas[1]", betas[1], 0.0, 1.0)
        _check_range("weight_decay", weight_decay, 0.0)
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, impl, threads)

    def _init_state(self, p, state, group):
        state["exp_avg"] = _zeros(p, group)

    def _update(self, master, grad, state, group, step):
        beta1, beta2 = group["betas"]
        host.lion_step(master, grad, state["exp_avg"].view(-1), lr=group["lr"], beta1=beta1,
                       beta2=beta2, weight_decay=group["weight_decay"],
                       grad_scale=-1.0 if group["maximize"] else 1.0,
                       impl=self.impl, threads=self.threads)
