"""DeepSpeed spellings zerokit reads: old names, "auto" values, steps_per_print infinity."""
from __future__ import annotations

import types

import pytest
import torch.nn as nn

from zerokit.config import ConfigError, load_config, resolve_auto
from zerokit.engine.deepspeed_api import DeepSpeedEngineAPI

BASE = {"train_micro_batch_size_per_gpu": 2}


def test_steps_per_print_infinity_means_never() -> None:
    """Accelerate passes float('inf')."""
    assert load_config({**BASE, "steps_per_print": float("inf")}).steps_per_print == float("inf")
    assert load_config({**BASE, "steps_per_print": 2e3}).steps_per_print == 2000
    with pytest.raises(ConfigError, match="steps_per_print must be a whole number or infinity"):
        load_config({**BASE, "steps_per_print": 2.5})


def test_legacy_names_are_read_as_the_current_keys() -> None:
    cfg = load_config({**BASE, "bfloat16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "cpu_offload": True, "cpu_offload_param": True,
        "stage3_gather_fp16_weights_on_model_save": True}})
    assert cfg.bf16.enabled
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.zero_optimization.offload_param.device == "cpu"
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save
    assert len(cfg.renamed) == 4 and "zero_optimization.cpu_offload -> zero_optimization.offload_optimizer" \
        in cfg.renamed
    engine = types.SimpleNamespace(config=cfg)
    assert DeepSpeedEngineAPI.zero_gather_16bit_weights_on_model_save(engine) is True
    assert DeepSpeedEngineAPI.zero_gather_16bit_weights_on_model_save(
        types.SimpleNamespace(config=load_config(BASE))) is False
    with pytest.raises(ConfigError, match="old name for bf16"):
        load_config({**BASE, "bfloat16": {"enabled": True}, "bf16": {"enabled": False}})


class _WithHidden(nn.Linear):
    def __init__(self):
        super().__init__(4, 4)
        self.config = types.SimpleNamespace(hidden_size=64)


def test_auto_bucket_and_batch_sizes_are_resolved_as_hf_does() -> None:
    cfg = load_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
                       "gradient_accumulation_steps": "auto", "zero_optimization": {
                           "stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                           "stage3_param_persistence_threshold": "auto"}})
    assert cfg.resolve_batch(2) == (4, 2, 1)
    zero = resolve_auto(cfg, _WithHidden()).zero_optimization
    assert (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size,
            zero.stage3_param_persistence_threshold) == (64 * 64, int(0.9 * 64 * 64), 640)
    with pytest.raises(ConfigError, match="Linear has none"):
        resolve_auto(cfg, nn.Linear(2, 2))


@pytest.mark.parametrize("raw, fragment", [
    ({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
     'optimizer.params.lr="auto": zerokit cannot resolve it; the HF Trainer fills it from '
     'TrainingArguments.learning_rate'),
    ({**BASE, "fp16": {"enabled": "auto"}}, "TrainingArguments.fp16"),
    ({**BASE, "zero_optimization": {"stage3_max_live_parameters": "auto"}},
     'zero_optimization.stage3_max_live_parameters="auto": neither zerokit nor the HF Trainer'),
    ({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1},
     "TrainingArguments.per_device_train_batch_size"),
])
def test_other_auto_values_name_the_key_and_who_fills_it(raw, fragment) -> None:
    cfg = load_config(raw)  # zero.Init reads the HF Trainer's config before it fills them all
    with pytest.raises(ConfigError) as info:
        resolve_auto(cfg, _WithHidden())  # initialize needs every value
    assert fragment in str(info.value), str(info.value)
