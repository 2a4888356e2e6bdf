"""`checkpoint(function, *args)`: run `function` without keeping its activations, and run it
again inside backward to get them back (DeepSpeed's reentrant CheckpointFunction, smaller).

The inputs are kept as the options say (see [Note: kept activations] in store.py); the random
number generators' states are saved at the forward and restored for the recomputation, so
dropout draws the same mask and the gradients equal those of an uncheckpointed run bit for bit.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable

import torch

from zerokit.activations.options import SETTINGS
from zerokit.activations.store import STORE, Kept

log = logging.getLogger("zerokit")


def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """function(*args, **kwargs), its activations recomputed in backward. Tensors passed by
    keyword take part in autograd as positional ones do (DeepSpeed's rule)."""
    if kwargs:
        keys, count, run = tuple(kwargs), len(args), function

        def function(*all_args: Any) -> Any:
            return run(*all_args[:count], **dict(zip(keys, all_args[count:])))
        args = args + tuple(kwargs.values())
    box: list[Any] = []  # the function's whole output, non-tensors included
    CheckpointFunction.apply(function, box, *args)
    return box[0]


class CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: Callable, box: list, *args: Any) -> Any:
        with _boundary("forward"):
            ctx.run = run
            ctx.rng = _rng_state(args)
            ctx.input_needs_grad = [torch.is_tensor(a) and a.requires_grad for a in args]
            with torch.no_grad():
                outputs = run(*args)
            # Only a forward that a backward can follow keeps its inputs (autograd connects a
            # Function's outputs only to inputs that require grad; eval forwards would pile up
            # kept inputs nobody restores).
            ctx.kept = STORE.keep(args) if any(ctx.input_needs_grad) else None
        box.append(outputs)
        tensors = _tensors(outputs)
        ctx.mark_non_differentiable(*[t for t in tensors if not t.is_floating_point()])
        return tuple(tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple:
        if ctx.kept is None:
            raise RuntimeError("zerokit.activations: a second backward through the same "
                               "checkpoint (its inputs were restored and freed by the first); "
                               "run the forward again")
        with _boundary("backward"):
            kept: Kept = ctx.kept
            args = STORE.restore(kept)
            inputs = [a.detach().requires_grad_(r) if torch.is_tensor(a) else a
                      for a, r in zip(args, ctx.input_needs_grad)]
            with _restored_rng(ctx.rng), torch.enable_grad():
                outputs = _tensors(ctx.run(*inputs))
            pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            STORE.done(kept)
            ctx.kept = None
        return (None, None) + tuple(a.grad if torch.is_tensor(a) and r else None
                                    for a, r in zip(inputs, ctx.input_needs_grad))


def _tensors(outputs: Any) -> list[torch.Tensor]:
    if torch.is_tensor(outputs):
        return [outputs]
    if isinstance(outputs, (tuple, list)):
        return [o for o in outputs if torch.is_tensor(o)]
    raise TypeError(f"zerokit.activations.checkpoint: the function must return a tensor or a "
                    f"tuple/list (got {type(outputs).__name__})")


# ---- random number generators ------------------------------------------------------------------
def _devices(args: tuple) -> list[torch.device]:
    return sorted({a.device for a in args if torch.is_tensor(a) and a.is_cuda}, key=str)


def _rng_state(args: tuple) -> tuple:
    devices = _devices(args)
    return (torch.get_rng_state(), devices,
            [torch.cuda.get_rng_state(d) for d in devices])


@contextlib.contextmanager
def _restored_rng(state: tuple):
    cpu, devices, cuda = state
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(cpu)
        for d, s in zip(devices, cuda):
            torch.cuda.set_rng_state(s, d)
        yield


# ---- synchronize_checkpoint_boundary and profile -----------------------------------------------
@contextlib.contextmanager
def _boundary(phase: str):
    opts = SETTINGS.options
    sync = opts.synchronize_checkpoint_boundary and torch.cuda.is_available() \
        and torch.cuda.is_initialized()
    if sync:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if sync:
            torch.cuda.synchronize()
        if opts.profile:
            elapsed = time.perf_counter() - t0
            SETTINGS.timings[phase] += elapsed
            log.debug("zerokit checkpoint %s: %.3f ms", phase, elapsed * 1e3)
