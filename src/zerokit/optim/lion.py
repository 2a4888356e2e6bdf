"""Lion in torch, for any device: what steps the device part of a Lion run (and every part when
nothing is offloaded). The host part is stepped by the native kernel (kernels/lion.h); both do
the same arithmetic, operation for operation, so a Twin-Flow split changes no result:

    p = p * (1 - lr*wd)                      decoupled weight decay, before the update (wd != 0)
    c = round(b1*m) + (1-b1)*g               the interpolation whose sign is the update
    p = p - lr * sign(c)
    m = round(b2*m) + (1-b2)*g               the momentum, after it was used

(Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2.) Each blend is
m.mul(beta).add(g, alpha=1-beta), as the kernel's fused multiply-add computes it: a last-bit
difference where c is near zero would flip the sign and move the parameter by 2*lr. Scalars are
formed in double and rounded to the parameter's dtype, as the kernel's dispatcher does.
State keys follow HostLion's (`exp_avg`, a float32 `step` tensor), so checkpoints and state
dicts move between the two.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch.optim import Optimizer


def _check(name: str, value: float, low: float, high: float | None = None) -> None:
    if not (value >= low and (high is None or value < high)):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"Lion: {name}={value!r} must be {bound}")


class Lion(Optimizer):
    """Lion on tensors of any device, with foreach (multi-tensor) ops."""

    def __init__(self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, maximize: bool = False):
        _check("lr", lr, 0.0)
        _check("betas[0]", betas[0], 0.0, 1.0)
        _check("betas[1]", betas[1], 0.0, 1.0)
        _check("weight_decay", weight_decay, 0.0)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay,
                                      maximize=maximize))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            params, grads, exp_avgs = [], [], []
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError(f"Lion does not take sparse gradients; param_groups[{gi}]['params'][{pi}] "
                                     f"(shape {tuple(p.shape)}) has one")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
            if params:
                beta1, beta2 = group["betas"]
                lion_update(params, grads, exp_avgs, lr=group["lr"], beta1=beta1, beta2=beta2,
                            weight_decay=group["weight_decay"], maximize=group.get("maximize", False))
        return loss


def lion_update(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor], *,
                lr: float, beta1: float, beta2: float, weight_decay: float, maximize: bool = False) -> None:
    """One Lion update of every tensor in `params`, in place (see the module's docstring)."""
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    update = torch._foreach_mul(exp_avgs, beta1)
    torch._foreach_add_(update, grads, alpha=1.0 - beta1)
    torch._foreach_sign_(update)
    torch._foreach_add_(params, update, alpha=-lr)
    torch._foreach_mul_(exp_avgs, beta2)
    torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta2)
