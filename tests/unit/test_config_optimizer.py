"""The config's optimizer section builds what DeepSpeed builds from it, defaults included."""
from __future__ import annotations

import pytest
import torch

from zerokit.config import load_config
from zerokit.optim.recipe import build_optimizer, recipe_from

# DeepSpeed's FusedAdam and DeepSpeedCPUAdam (what it builds for "Adam"/"AdamW" without
# torch_adam) default to no weight decay; torch.optim.AdamW defaults to 0.01.
DEEPSPEED_ADAM_WEIGHT_DECAY = 0.0


def _built(opt_section: dict) -> torch.optim.Optimizer:
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": opt_section})
    model = torch.nn.Linear(3, 2)
    recipe = recipe_from(model, None, None, cfg.optimizer)
    return build_optimizer(recipe, [[p.detach().clone().requires_grad_() for p in model.parameters()]])


@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
def test_deepspeed_adam_types_default_to_no_weight_decay(kind: str) -> None:
    opt = _built({"type": kind, "params": {"lr": 0.1}})
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.param_groups[0]["weight_decay"] == DEEPSPEED_ADAM_WEIGHT_DECAY
    # scale-sensitive: with a zero gradient the only change AdamW makes is the decay
    params = opt.param_groups[0]["params"]
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for b, p in zip(before, params):
        assert torch.equal(b, p)


def test_explicit_weight_decay_and_torch_adam_keep_theirs() -> None:
    assert _built({"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.2}}
                  ).param_groups[0]["weight_decay"] == 0.2
    # torch_adam: DeepSpeed builds torch.optim.AdamW with torch's own default
    assert _built({"type": "AdamW", "params": {"lr": 0.1, "torch_adam": True}}
                  ).param_groups[0]["weight_decay"] == torch.optim.AdamW([torch.zeros(1)]).defaults["weight_decay"]


def test_adam_w_mode_false_is_l2_adam_and_adamw_ignores_it() -> None:
    assert type(_built({"type": "Adam", "params": {"adam_w_mode": False}})) is torch.optim.Adam
    assert type(_built({"type": "AdamW", "params": {"adam_w_mode": False}})) is torch.optim.AdamW


def test_deepspeed_default_is_what_its_fused_adam_says() -> None:
    fused_adam = pytest.importorskip("deepspeed.ops.adam.fused_adam")  # the bench extra; CI has it
    import inspect
    default = inspect.signature(fused_adam.FusedAdam.__init__).parameters["weight_decay"].default
    assert default == DEEPSPEED_ADAM_WEIGHT_DECAY
