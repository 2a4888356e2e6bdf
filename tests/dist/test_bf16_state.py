"""bf16 master weights and optimizer states (bf16.bf16_master_weights_and_grads,
bf16.bf16_optimizer_states, DeepSpeedCPUAdam(fp32_optimizer_states=False), bf16.stochastic_rounding)
through the host parts (offload_optimizer cpu), stages 1-3, one process.

- against a plain torch reference of what the keys mean: a bf16 model is its own master; each
  step torch's AdamW runs in fp32 on the widened master (and widened state), and the results are
  rounded once to bf16 (the state too, with bf16_optimizer_states);
- stochastic rounding where scale matters: at an lr whose updates are below half a bf16 ulp, the
  fp32-master run moves the weights, round-to-nearest barely does, stochastic rounding moves them
  by the fp32 run's amount on average (regression slope ~1);
- an optimizer without a bf16 kernel (SGD, amsgrad) is torch's on the device part, bit for bit
  a bf16 model under that torch optimizer; the host refuses it, naming it; the plan names the dtypes; the ledger counts
  2-byte master, gradient and (bf16) state on the host.
The other tiers (nvme parts, the device part: no offload, Twin-Flow) give the host parts' bits:
test_bf16_state_tiers.py.
"""
from __future__ import annotations

import pytest
import torch

from reference import engine_train, global_batches, tiny_gpt

STEPS, MICRO, LR = 4, 4, 1e-3


def _config(stage: int, states: bool = True, sr: bool = False, lr: float = LR, ratio: float = 1.0,
            master: bool = True, device: str = "cpu") -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 2000,
            "offload_optimizer": {"device": device, "ratio": ratio}}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0)
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0,
            "bf16": {"enabled": True, "bf16_master_weights_and_grads": master,
                     "bf16_optimizer_states": states, "stochastic_rounding": sr},
            "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.1}}}


def _engine_run(cfg: dict, steps: int = STEPS):
    import zerokit

    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(), config=cfg)
    losses = engine_train(engine, global_batches(steps, MICRO), 0, 1)
    host = [p for u in engine.units for p in u.parts if p.tier.value == "host"]
    dtypes = {(p.master.dtype, p.grad.dtype, next(iter(p.state.values())).dtype) for p in host}
    weights = {k: v.float() for k, v in engine.consolidated_fp32_state_dict().items()}
    ledger = {k: engine.ledger.bytes(tier="host", kind=k) for k in ("master", "grads", "optimizer_state")}
    numel = sum(p.numel for p in host)
    engine.destroy()
    return losses, weights, dtypes, ledger, numel


def _reference(bf16_states: bool, steps: int = STEPS, lr: float = LR):
    """bf16 model = master; fp32 math per step (torch's AdamW on widened copies), rounded once."""
    model = tiny_gpt().to(torch.bfloat16)
    shadow = [torch.nn.Parameter(p.detach().float()) for p in model.parameters()]
    opt = torch.optim.AdamW(shadow, lr=lr, weight_decay=0.1, foreach=False)
    losses = []
    for x, y in global_batches(steps, MICRO):
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for p, s in zip(model.parameters(), shadow):
                s.copy_(p)              # the bf16 master, widened
                s.grad = p.grad.float()  # the bf16 gradient, widened
                p.grad = None
            opt.step()
            for p, s in zip(model.parameters(), shadow):
                p.copy_(s)               # rounded once to the bf16 master (nearest even)
                if bf16_states:
                    for t in opt.state[s].values():
                        if t.is_floating_point() and t.dim():
                            t.copy_(t.to(torch.bfloat16))
    return losses, {k: v.detach().float() for k, v in model.named_parameters()}


@pytest.mark.parametrize("stage, states", [(1, True), (2, False), (3, True)])
def test_matches_a_torch_reference_of_the_keys(stage, states):
    losses, weights, dtypes, ledger, numel = _engine_run(_config(stage, states))
    ref_losses, ref_weights = _reference(states)
    bf16, f32 = torch.bfloat16, torch.float32
    assert dtypes == {(bf16, bf16, bf16 if states else f32)}, dtypes
    assert ledger == {"master": 2 * numel, "grads": 2 * numel,
                      "optimizer_state": (4 if states else 8) * numel}, (ledger, numel)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-3, atol=0)
    differ = total = 0
    for name, w in ref_weights.items():
        # fp32 math in another order (torch's AdamW vs the kernel) moves a result by an fp32 ulp,
        # which changes its bf16 rounding only next to a rounding boundary: a bf16 ulp, rarely.
        ulp = (w.abs() * 2 ** -7).clamp_min(2 ** -126)
        assert bool(((weights[name] - w).abs() <= 2 * ulp).all()), name
        differ += int((weights[name] != w).sum())
        total += w.numel()
    assert differ <= total * 2e-3, f"{differ} of {total} elements differ from the reference"


def _slope(delta: torch.Tensor, ref: torch.Tensor) -> float:
    return float((delta * ref).sum() / (ref * ref).sum())


def test_stochastic_rounding_keeps_what_round_to_nearest_loses():
    steps, lr = 12, 2e-5  # Adam moves each weight by ~lr: far below half an ulp of most weights
    w0 = {k: v.detach().float() for k, v in tiny_gpt().to(torch.bfloat16).named_parameters()}
    cfg32 = _config(2, lr=lr, master=False, states=False)
    runs = {"fp32": _engine_run(cfg32, steps)[1],
            "nearest": _engine_run(_config(2, lr=lr), steps)[1],
            "stochastic": _engine_run(_config(2, lr=lr, sr=True), steps)[1]}
    flat = {k: torch.cat([(w[n] - w0[n]).flatten() for n in w0]) for k, w in runs.items()}
    near, sr = _slope(flat["nearest"], flat["fp32"]), _slope(flat["stochastic"], flat["fp32"])
    assert near < 0.5, f"round-to-nearest kept {near:.2f} of the fp32 run's movement"
    assert 0.8 < sr < 1.2, f"stochastic rounding kept {sr:.2f} of the fp32 run's movement"


def test_stochastic_rounding_is_reproducible():
    a = _engine_run(_config(3, sr=True), 2)[1]
    b = _engine_run(_config(3, sr=True), 2)[1]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_an_optimizer_without_a_host_kernel_raises_naming_it():
    import zerokit

    cfg = _config(2, device="cpu")
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    with pytest.raises(TypeError, match="SGD has no host kernel"):
        zerokit.initialize(model=tiny_gpt(), config=cfg)


# Without offload, an optimizer with no bf16 kernel is torch's, stepping the bf16 master in bf16
# (DeepSpeed's device path: its client optimizer over bf16 partitions). The reference is that
# literally: a bf16 model and the same torch optimizer, so every bit must agree.
NO_KERNEL = {
    "sgd": ({"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
            lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
    "sgd-plain": ({"type": "SGD", "params": {"lr": 0.05}},       # scale-sensitive: no momentum
                  lambda ps: torch.optim.SGD(ps, lr=0.05)),
    "adamw-amsgrad": ({"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1, "amsgrad": True}},
                      lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.1, amsgrad=True)),
}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(NO_KERNEL))
def test_an_optimizer_without_a_bf16_kernel_steps_the_bf16_master_as_torch_does(stage, name):
    import zerokit

    spec, make = NO_KERNEL[name]
    cfg = _config(stage, device="none")
    cfg["optimizer"] = spec
    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(), config=cfg)
    losses = engine_train(engine, global_batches(STEPS, MICRO), 0, 1)
    weights = engine.consolidated_fp32_state_dict()
    states = {t.dtype for s in engine.optimizer.state.values() for t in s.values()
              if torch.is_tensor(t) and t.dim()}
    engine.destroy()

    model = tiny_gpt().to(torch.bfloat16)
    opt = make(model.parameters())
    ref_losses = []
    for x, y in global_batches(STEPS, MICRO):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    assert losses == ref_losses
    for k, w in model.named_parameters():
        assert torch.equal(weights[k].to(torch.bfloat16), w.detach()), k
    assert states <= {torch.bfloat16}, states


@pytest.mark.parametrize("change, match", [
    ({"bf16_optimizer_states": False}, "bf16_optimizer_states must be true"),
    ({"stochastic_rounding": True}, "torch's optimizer rounds to nearest"),
])
def test_an_optimizer_without_a_bf16_kernel_refuses_what_torch_cannot_do(change, match):
    import zerokit

    cfg = _config(2, device="none")
    cfg["bf16"].update(change)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
    with pytest.raises(NotImplementedError, match=match):
        zerokit.initialize(model=tiny_gpt(), config=cfg)


def test_deepspeed_cpu_adam_fp32_optimizer_states_false_gives_bf16_moments():
    import zerokit
    from zerokit.compat.deepspeed.ops.adam import DeepSpeedCPUAdam

    model = tiny_gpt()
    cfg = _config(2, states=False)
    del cfg["optimizer"]
    opt = DeepSpeedCPUAdam(model.parameters(), lr=LR, fp32_optimizer_states=False)
    engine, _, _, _ = zerokit.initialize(model=model, optimizer=opt, config=cfg)
    engine_train(engine, global_batches(1, MICRO), 0, 1)
    states = {t.dtype for u in engine.units for p in u.parts if p.tier.value == "host" for t in p.state.values()}
    assert states == {torch.bfloat16}
    engine.destroy()
    # with bf16_optimizer_states, a client DeepSpeedCPUAdam must say fp32_optimizer_states=False
    model = tiny_gpt()
    with pytest.raises(ValueError, match="fp32_optimizer_states=False"):
        zerokit.initialize(model=model, optimizer=DeepSpeedCPUAdam(model.parameters()),
                           config={**cfg, "bf16": {**cfg["bf16"], "bf16_optimizer_states": True}})


def test_plan_names_the_dtypes(caplog):
    import logging

    import zerokit
    from zerokit.config.plan import explain

    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(), config=_config(2, sr=True))
    text = explain(engine)
    engine.destroy()
    assert "master bf16, optimizer state bf16 (bf16.stochastic_rounding)" in text, text
    assert logging  # the plan is logged at initialize by report_startup; explain is its text
