"""The `optimizer` and `scheduler` sections: DeepSpeed's type names, and their `params`, which pass
through to torch untyped, checked here with the schema's strictness (names, value kinds, ranges)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from zerokit.config.section import Section

OptimizerType = Literal["Adam", "AdamW", "SGD", "Adagrad", "Lion"]
SchedulerType = Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
# DeepSpeed's own optimizer names (runtime/config.py DEEPSPEED_OPTIMIZERS), lower case -> ours.
_DEEPSPEED_OPTIMIZER_NAMES = {"adam": "Adam", "adamw": "AdamW", "adagrad": "Adagrad", "lion": "Lion"}

# Hyperparameters each optimizer type accepts (torch's names; DeepSpeed passes them through).
OPTIMIZER_PARAMS: dict[str, set[str]] = {
    "Adam": {"lr", "betas", "eps", "weight_decay", "amsgrad", "adam_w_mode", "torch_adam", "fused"},
    "AdamW": {"lr", "betas", "eps", "weight_decay", "amsgrad", "adam_w_mode", "torch_adam", "fused"},
    "SGD": {"lr", "momentum", "dampening", "weight_decay", "nesterov"},
    "Adagrad": {"lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps"},
    "Lion": {"lr", "betas", "weight_decay"},
}

SCHEDULER_PARAMS: dict[str, set[str]] = {
    "WarmupLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"},
    "WarmupDecayLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                      "total_num_steps", "last_batch_iteration"},
    "WarmupCosineLR": {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio",
                       "warmup_type", "last_batch_iteration"},
}


# The params that are flags or names; every other param is a number (or, as betas, a list of them).
FLAG_PARAMS = {"amsgrad", "adam_w_mode", "torch_adam", "fused", "nesterov"}
NAME_PARAMS = {"warmup_type"}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_params(kind: str, type_: str, params: dict[str, Any], table: dict[str, set[str]]) -> None:
    import difflib

    allowed = table[type_]
    for key, value in params.items():
        if key not in allowed:
            near = difflib.get_close_matches(key, sorted(allowed), n=1, cutoff=0.5)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ValueError(
                f"unknown {kind} param '{key}' for type {type_}{hint} "
                f"(valid: {', '.join(sorted(allowed))})"
            )
        _check_param_value(f"{kind}.params.{key}", key, value)


def _check_param_value(where: str, key: str, value: Any) -> None:
    """The params pass through to torch untyped, so they get the schema's strictness here."""
    if key in FLAG_PARAMS:
        ok, allowed = isinstance(value, bool), "true or false"
    elif key in NAME_PARAMS:
        ok, allowed = isinstance(value, str), "a string"
    else:
        ok = _is_number(value) or (isinstance(value, (list, tuple)) and all(map(_is_number, value)))
        allowed = "a number (or a list of numbers)"
    if not ok:
        raise ValueError(f"{where} must be {allowed} (got {value!r})")
    _check_param_range(where, key, value)


def _check_param_range(where: str, key: str, value: Any) -> None:
    """The ranges torch would refuse later, without naming the key (or with a bare TypeError)."""
    if key == "betas":
        if not (isinstance(value, (list, tuple)) and len(value) == 2):
            raise ValueError(f"{where} must be a list of two numbers [beta1, beta2], each in "
                             f"[0, 1) (got {value!r})")
        for i, b in enumerate(value):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"{where}[{i}] must be in [0, 1) (got {b!r} in {value!r})")
    elif key in ("eps", "weight_decay", "momentum", "lr_decay", "initial_accumulator_value"):
        if isinstance(value, (list, tuple)) or value < 0:
            raise ValueError(f"{where} must be a number >= 0 (got {value!r})")


class OptimizerConfig(Section):
    type: OptimizerType = Field(description="Optimizer class, DeepSpeed's names.")
    params: dict[str, Any] = Field(default_factory=dict, description="Passed to the optimizer.")

    @field_validator("type", mode="before")
    @classmethod
    def _deepspeed_names_any_case(cls, value: Any) -> Any:
        """DeepSpeed matches its own optimizer names in any case ("adamw", "ADAM"); other names
        are torch.optim class names, matched exactly ("SGD"), as in DeepSpeed."""
        if isinstance(value, str):
            return _DEEPSPEED_OPTIMIZER_NAMES.get(value.lower(), value)
        return value

    @model_validator(mode="after")
    def _known_params(self) -> "OptimizerConfig":
        _check_params("optimizer", self.type, self.params, OPTIMIZER_PARAMS)
        lr = self.params.get("lr", 1e-3)
        if not _is_number(lr) or lr < 0:
            raise ValueError(f"optimizer.params.lr must be a number >= 0 (got {lr!r})")
        return self


class SchedulerConfig(Section):
    type: SchedulerType
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _known_params(self) -> "SchedulerConfig":
        _check_params("scheduler", self.type, self.params, SCHEDULER_PARAMS)
        if self.type in ("WarmupDecayLR", "WarmupCosineLR") and "total_num_steps" not in self.params:
            raise ValueError(f"scheduler type {self.type} needs params.total_num_steps")
        return self
