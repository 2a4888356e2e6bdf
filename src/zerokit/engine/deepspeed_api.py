"""The DeepSpeedEngine methods that DeepSpeed-style scripts, the HF Trainer and Accelerate call.

A mixin of `Engine`, kept apart so the engine's own file stays the training step. Every method
here reads the engine's state (its config, units, loss scaler, counters); none moves bytes.
What each caller uses is listed in docs/deepspeed.md.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from zerokit.engine.deepspeed_optimizer import DeepSpeedOptimizerView  # noqa: F401  (public here)
from zerokit.states import TrainingState
from zerokit.units.unit import WeightState


class DeepSpeedConfigDict(dict):
    """`engine.config`: the DeepSpeed JSON as a dict, as DeepSpeed's engine.config is (the HF
    Trainer reads `engine.config.get("zero_optimization", {})`). Attribute access reads the
    validated ZeroKitConfig (`engine.config.gradient_clipping`), which zerokit's code uses."""

    def __init__(self, raw: dict, typed: Any):
        super().__init__(raw)
        self._typed = typed

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_typed":
            raise AttributeError(name)
        return getattr(self._typed, name)

    def __reduce__(self):  # pickles as the plain dict it shows
        return dict, (dict(self),)


def config_dict(raw: Any, typed: Any) -> DeepSpeedConfigDict:
    """The user's config as a dict: a dict as given, a JSON path as loaded, a ZeroKitConfig as
    the keys that were set in it."""
    if isinstance(raw, dict):
        return DeepSpeedConfigDict(raw, typed)
    if isinstance(raw, (str, os.PathLike)):
        import json

        with open(raw) as f:
            return DeepSpeedConfigDict(json.load(f), typed)
    return DeepSpeedConfigDict(typed.model_dump(by_alias=True, exclude_unset=True), typed)


class DeepSpeedEngineAPI:
    """DeepSpeedEngine's public surface over zerokit's Engine (see docs/deepspeed.md)."""

    # ---- batch and precision getters (DeepSpeed exposes them as methods) ----------------------
    def train_batch_size(self) -> int:
        return self._train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self._gradient_accumulation_steps

    def bfloat16_enabled(self) -> bool:
        return self.config.compute_dtype_name == "bf16"

    def fp16_enabled(self) -> bool:
        return self.config.compute_dtype_name == "fp16"

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    # ---- process placement --------------------------------------------------------------------
    @property
    def local_rank(self) -> int:
        """LOCAL_RANK from the launcher; without one, the global rank (one node)."""
        return int(os.environ.get("LOCAL_RANK", self.comm.rank))

    @property
    def global_rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def dp_world_size(self) -> int:
        return self.comm.world_size  # zerokit is data parallel only

    @property
    def device(self) -> torch.device:
        return self.comm.device

    # ---- accumulation and step results --------------------------------------------------------
    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Declare whether the coming backward/step ends an accumulation window (Accelerate calls
        this before every backward). Once set, the engine's own micro-step count no longer decides."""
        self._boundary_override = bool(is_boundary)

    def get_global_grad_norm(self) -> float | None:
        """The 2-norm of the gradients (unscaled, before clipping) that the last optimizer step
        used, as DeepSpeed caches it until the next step. None before the first step, and after a
        step that computed none: without gradient_clipping and dynamic fp16 loss scaling, zerokit
        skips that pass over the gradients."""
        return self._last_grad_norm

    @property
    def overflow(self) -> bool:
        """The last boundary's update was skipped: its gradients overflowed (fp16, static or
        dynamic loss scale) or were not finite (nonfinite 'skip'). Accelerate's
        step_was_skipped reads it through the optimizer."""
        return self._last_step_skipped

    def was_step_applied(self) -> bool:
        """As DeepSpeed: True only if the last step() call updated the weights (False after a
        step() inside an accumulation window, and after a skipped update)."""
        return self._step_applied

    # ---- checkpoints --------------------------------------------------------------------------
    def deepspeed_load_result(self, path: str, client: dict) -> tuple[str, dict]:
        """load_checkpoint's answer under DeepSpeed's API. The first value is a file in the tag
        directory, as DeepSpeed's (`<tag>/mp_rank_00_model_states.pt`): zerokit's counterpart,
        the file with the counters, buffers and client state (`<tag>/common.pt`). The client
        state carries, beside the caller's keys, the keys DeepSpeed's adds from its own model
        states file (ds_config, ds_version, global_samples, param_shapes, buffer_names, ...);
        the caller's keys win where they share a name, as in DeepSpeed's saved dict."""
        from collections import OrderedDict

        from zerokit.checkpoint.metadata import COMMON
        from zerokit.checkpoint.save import persistent_buffers
        from zerokit.compat.deepspeed.version import __version__

        names = {id(p): n for n, p in self.module.named_parameters()}
        shapes = [OrderedDict((s.fqn, torch.Size(s.shape)) for s in self._slots_of(group))
                  for group in self.optimizer.param_groups]
        tied = {n: names[id(p)] for n, p in self.module.named_parameters(remove_duplicate=False)
                if names[id(p)] != n}
        ours = {"buffer_names": [n for n, _ in persistent_buffers(self.module)],
                "param_shapes": shapes, "frozen_param_shapes": None, "shared_params": tied,
                "frozen_param_fragments": None, "global_samples": self.global_samples,
                "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
                "ds_config": dict(self.config), "ds_version": __version__}
        return os.path.join(path, COMMON), {**ours, **client}

    def _slots_of(self, group: dict) -> list:
        """The user's parameters (unit slots) behind one of the optimizer's param groups, which
        steps the units' fp32 masters."""
        masters = {id(p) for p in group["params"]}
        return [s for u in self.units if id(u.master) in masters for s in u.slots]

    def empty_partition_cache(self) -> None:
        """Release every gathered stage-3 parameter, persistent ones too, as DeepSpeed's (to free
        device memory between training and inference); each is gathered again at its next use.
        Below stage 3 nothing is partitioned and this does nothing, as in DeepSpeed; at every
        stage the idle scratch buffers kept for the next step are freed (tiers/scratch.py)."""
        self.ledger.scratch.drop_idle()
        if not self.policy.shard_weights:
            return
        if self.training_state is not TrainingState.IDLE:
            raise RuntimeError(f"engine.empty_partition_cache() during {self.training_state.name.lower()}: "
                               f"call it between steps")
        self.wait_for_weights()
        for u in self.units:
            u.release(persistent_too=True)

    # ---- consolidated weights -----------------------------------------------------------------
    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The config's zero_optimization.stage3_gather_16bit_weights_on_model_save (or its old name
        stage3_gather_fp16_weights_on_model_save; default false). Accelerate consults it before
        calling _zero3_consolidated_16bit_state_dict at stage 3, and the HF Trainer otherwise saves
        a DeepSpeed checkpoint instead of the weights."""
        return self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                             ) -> dict[str, torch.Tensor]:
        """Collective: the full compute-dtype state dict on rank 0 (on the host), {} elsewhere,
        gathered one unit at a time. Tied parameters appear under every name, buffers included."""
        self.wait_for_weights()
        rank0 = self.comm.rank == 0
        out: dict[str, torch.Tensor] = {}
        for u in self.units:
            if exclude_frozen_parameters and not u.trainable:
                continue
            gathered_here = u.state is WeightState.SHARDED
            u.gather()
            u.wait_weights()
            if rank0:
                out.update({k: v.detach().cpu().clone() for k, v in u.split(u.flat).items()})
            if gathered_here:
                u.release()
        if not rank0:
            return {}
        canonical = {id(p): n for n, p in self.module.named_parameters()}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if name not in out and canonical[id(p)] in out:
                out[name] = out[canonical[id(p)]]
        from zerokit.checkpoint.save import persistent_buffers

        for name, buf in persistent_buffers(self.module):
            out[name] = buf.detach().cpu().clone()
        return out

    # ---- the wrapped module's attributes ------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        """What the engine lacks, the wrapped module answers (engine.generate, engine.config of a
        model is shadowed by the engine's own, as in DeepSpeed)."""
        try:
            return super().__getattr__(name)  # nn.Module: parameters, buffers, submodules
        except AttributeError:
            pass
        modules = self.__dict__.get("_modules", {})
        module = modules.get("module")
        if module is None or name.startswith("__"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(f"'{type(self).__name__}' object and its module "
                                 f"'{type(module).__name__}' have no attribute '{name}'") from None
