"""DeepSpeed configs written for the Hugging Face Trainer say "auto" where the Trainer fills a value.

The Trainer (and Accelerate) replace every "auto" before calling deepspeed.initialize, so through
them zerokit never sees one. Called directly, zerokit resolves what it can as they would:
- the batch-size triple: an "auto" member is derived from the other two (resolve_batch);
- bucket sizes, from the model's hidden size h as transformers does: reduce_bucket_size = h*h,
  stage3_prefetch_bucket_size = int(0.9*h*h), stage3_param_persistence_threshold = 10*h;
and refuses every other "auto", naming the key and what fills it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zerokit.config.errors import ConfigError, without_key

if TYPE_CHECKING:
    import torch.nn as nn

    from zerokit.config.schema import ZeroKitConfig

AUTO = "auto"
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
HIDDEN_SIZE_KEYS = {  # zero_optimization key -> its value from the hidden size h (transformers' rule)
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}
# zerokit's own "auto" values (not DeepSpeed's): left to the schema.
NATIVE_AUTO = {"zero_optimization.offload_optimizer.ratio", "memory.host",
               "zero_optimization.offload_optimizer.device", "zero_optimization.offload_param.device",
               "zero_optimization.offload_optimizer.step_in_backward",
               "zero_optimization.offload_optimizer.nvme_gradients",
               "zero_optimization.offload_optimizer.gradient_dtype"}
# What the HF Trainer fills each other "auto" from (transformers/integrations/deepspeed.py).
FILLED_BY_HF = {
    "gradient_clipping": "TrainingArguments.max_grad_norm",
    "optimizer.params.lr": "TrainingArguments.learning_rate",
    "optimizer.params.betas": "TrainingArguments.adam_beta1 and adam_beta2",
    "optimizer.params.eps": "TrainingArguments.adam_epsilon",
    "optimizer.params.weight_decay": "TrainingArguments.weight_decay",
    "scheduler.params.warmup_min_lr": "0",
    "scheduler.params.warmup_max_lr": "TrainingArguments.learning_rate",
    "scheduler.params.warmup_num_steps": "TrainingArguments.warmup_steps",
    "scheduler.params.total_num_steps": "the number of training steps it computes",
    "fp16.enabled": "TrainingArguments.fp16",
    "bf16.enabled": "TrainingArguments.bf16",
}


def _auto_paths(raw: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(raw, dict):
        return [p for k, v in raw.items() for p in _auto_paths(v, prefix + (str(k),))]
    return [prefix] if isinstance(raw, str) and raw == AUTO else []


def _unresolvable(path: str) -> str:
    filler = FILLED_BY_HF.get(path)
    if filler is None:
        return (f'{path}="auto": neither zerokit nor the HF Trainer resolves this key; give a value')
    return (f'{path}="auto": zerokit cannot resolve it; the HF Trainer fills it from {filler} '
            f'(Accelerate from its own arguments). Calling zerokit directly, give a value')


def split_auto(raw: dict[str, Any]) -> tuple[dict[str, Any], set[str], list[str]]:
    """(raw without any "auto" value, the paths of those zerokit resolves, a message per other
    one: resolve_auto raises them, so that only initialize needs every value).

    The caller's dict is not changed."""
    resolvable, problems, out = set(), [], raw
    for parts in _auto_paths(raw):
        path = ".".join(parts)
        if path in NATIVE_AUTO:
            continue
        if path in BATCH_KEYS or (parts[0] == "zero_optimization" and len(parts) == 2
                                  and parts[1] in HIDDEN_SIZE_KEYS):
            resolvable.add(path)
            out = without_key(out, parts)
        else:
            problems.append(_unresolvable(path))
            out = without_key(out, parts)
    given = [k for k in ("train_batch_size", "train_micro_batch_size_per_gpu") if raw.get(k) not in (None, AUTO)]
    if not given and any(k in resolvable for k in BATCH_KEYS):
        problems.append(
            'train_batch_size and train_micro_batch_size_per_gpu are "auto" or unset: zerokit derives '
            'an "auto" batch size from the two others; the HF Trainer fills them from '
            'TrainingArguments.per_device_train_batch_size and gradient_accumulation_steps. Calling '
            'zerokit directly, give train_micro_batch_size_per_gpu (or train_batch_size)')
    return out, resolvable, problems


def hidden_size_of(model: "nn.Module") -> int | None:
    """The model's hidden size as transformers reads it for "auto" bucket sizes."""
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        if isinstance(getattr(cfg, "hidden_size", None), int):
            return cfg.hidden_size
        sizes = getattr(cfg, "hidden_sizes", None)
        if sizes:
            return max(sizes)
    return None


def resolve_auto(cfg: "ZeroKitConfig", model: "nn.Module") -> "ZeroKitConfig":
    """cfg with its "auto" bucket sizes set from the model's hidden size (batch sizes stay unset:
    resolve_batch derives them); any other "auto" is an error naming it and what fills it."""
    if cfg._unresolved_auto:
        raise ConfigError("invalid zerokit config:\n  " + "\n  ".join(cfg._unresolved_auto))
    keys = sorted(p.split(".", 1)[1] for p in cfg.auto_keys if p.startswith("zero_optimization."))
    if not keys:
        return cfg
    h = hidden_size_of(model)
    if h is None:
        raise ConfigError(
            "invalid zerokit config:\n  " + ", ".join(f"zero_optimization.{k}" for k in keys)
            + ' = "auto": zerokit (as the HF Trainer) sets these from the model\'s hidden size '
            f"(model.config.hidden_size or hidden_sizes), and {type(model).__name__} has none; "
            "give numbers")
    zero = cfg.zero_optimization.model_copy(update={k: HIDDEN_SIZE_KEYS[k](h) for k in keys})
    out = cfg.model_copy(update={"zero_optimization": zero})
    out._auto_keys = cfg.auto_keys
    return out
