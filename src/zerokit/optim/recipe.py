"""Building the optimizer that steps the fp32 master shards.

The user's choice (a torch.optim instance, a class or factory, or the config's `optimizer`
section) is reproduced over the units' master tensors: one param group per user param group, same
hyperparameters, so the update of each element is what it would have been on the full model.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from zerokit.config.schema import OptimizerConfig

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


@dataclass
class OptimizerRecipe:
    """Param groups of the user's model and how to build the same optimizer over other tensors."""

    hyper: list[dict[str, Any]]  # per group, everything but "params"
    group_of: dict[int, int]  # id(param) -> group index
    build: OptimizerFactory
    kind: str | None = None  # the optimizer's class name where known before it is built


def _normalize_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    items = list(params)
    if not items:
        return []
    if isinstance(items[0], dict):
        return [dict(g, params=list(g["params"])) for g in items]
    return [{"params": items}]


def _config_optimizer(cfg: OptimizerConfig) -> OptimizerFactory:
    params = dict(cfg.params)
    kind = cfg.type
    if kind in ("Adam", "AdamW"):
        # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false (its FusedAdam default); its
        # "AdamW" is AdamW whatever adam_w_mode says.
        adam_w_mode = params.pop("adam_w_mode", True)
        kind = "AdamW" if kind == "AdamW" or adam_w_mode else "Adam"
        if not params.pop("torch_adam", False):
            # A config written for DeepSpeed gets its default decay: FusedAdam's and
            # DeepSpeedCPUAdam's is 0, torch.optim.AdamW's 0.01 (DeepSpeed passes torch's own
            # default through only with torch_adam).
            params.setdefault("weight_decay", 0.0)
    if kind == "Lion":
        # torch's ops on any device; offloaded parts are stepped by the native host kernel, which
        # does the same arithmetic (parts/executors.py kernel_for).
        from zerokit.optim import Lion as cls
    else:
        cls = getattr(torch.optim, kind)
    return lambda groups: cls(groups, **params)


def recipe_from(model: nn.Module, optimizer: Any, model_parameters: Iterable[Any] | None,
                config_optimizer: OptimizerConfig | None) -> OptimizerRecipe:
    if optimizer is not None and config_optimizer is not None:
        # As DeepSpeed: the client's optimizer wins and the section is not used (DeepSpeed's own
        # tests and the HF Trainer with a client optimizer pass both).
        logging.getLogger("zerokit").warning(
            "an optimizer was passed to initialize() (%s) and the config has an 'optimizer' section "
            "(type %s): using the client optimizer, as DeepSpeed does; the section is not used",
            getattr(optimizer, "__name__", type(optimizer).__name__), config_optimizer.type)
        config_optimizer = None
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = [dict(g) for g in optimizer.param_groups]
        cls = type(optimizer)
        # defaults may hold keys the constructor does not take (AdamW's decoupled_weight_decay);
        # every group carries all of them anyway, so pass only what the signature accepts.
        accepted = inspect.signature(cls.__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        build: OptimizerFactory = lambda gs: cls(gs, **defaults)  # noqa: E731
        kind = cls.__name__
    else:
        groups = _normalize_groups(model_parameters if model_parameters is not None
                                   else model.parameters())
        if model_parameters is not None and not any(g["params"] for g in groups):
            raise ValueError(
                "initialize(model_parameters=...) is empty (no parameters in it, or in any of its "
                "param groups): pass model.parameters(), a list of parameters or of param-group "
                "dicts {'params': [...], ...}, or leave it None to train every parameter of the "
                "model")
        if optimizer is None:
            if config_optimizer is None:
                raise ValueError("no optimizer: pass optimizer= to initialize() or set the config's "
                                 "'optimizer' section (type Adam, AdamW, SGD, Adagrad or Lion)")
            build = _config_optimizer(config_optimizer)
            kind = config_optimizer.type
        elif callable(optimizer):
            build = optimizer  # a torch.optim class or a factory taking param groups
            kind = optimizer.__name__ if isinstance(optimizer, type) else None
        else:
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, a class or a callable "
                            f"(got {type(optimizer).__name__})")
    group_of: dict[int, int] = {}
    hyper: list[dict[str, Any]] = []
    for i, g in enumerate(groups):
        for p in g["params"]:
            if id(p) in group_of:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is in param groups "
                                 f"{group_of[id(p)]} and {i}")
            group_of[id(p)] = i
        hyper.append({k: v for k, v in g.items() if k != "params"})
    return OptimizerRecipe(hyper, group_of, build, kind)


def build_optimizer(recipe: OptimizerRecipe, masters_by_group: list[list[torch.Tensor]]
                    ) -> torch.optim.Optimizer:
    groups = [dict(h, params=m) for h, m in zip(recipe.hyper, masters_by_group) if m]
    if not groups:
        raise ValueError("no trainable parameters: every parameter is frozen or in no param group")
    return recipe.build(groups)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for st in optimizer.state.values()
               for v in st.values() if torch.is_tensor(v))

