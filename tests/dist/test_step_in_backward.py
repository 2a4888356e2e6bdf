"""offload_optimizer.step_in_backward: each unit's offloaded parts step as soon as backward has
reduced its gradient, on the host worker while backward goes on (parts/executors.py).

- parity: the weights after each step equal, bit for bit, those of the same run stepping in
  step() (host memory and NVMe, stages 1-3, fp32 and bf16, world 1 and 2, AdamW and an SGD-like,
  scale-sensitive update), and an independent torch reference within float noise; the parts
  really were stepped in backward (before step() was called), and with NVMe no gradient went to
  disk: 12 bytes per NVMe element each way (master and two moments), not 16, in two file slots
  (the speculative step's, parts/speculation.py).
- "auto" (the default) is on for offloaded optimizers and off with the delayed update; true with
  the delayed update is refused, naming both.
- a non-finite gradient is skipped ('skip') or stops the step ('stop') as stepping in step()
  does: the update applied in backward is rolled back (tests/dist/test_speculative_step.py has the
  grid with clipping, fp16 and accumulation); a second backward before step() raises naming the
  unit.
"""
from __future__ import annotations

import pytest
import torch

from harness import run_world
from reference import engine_train, global_batches, reference_train, tiny_gpt
from fast_tier import slow_except

STEPS, MICRO = 3, 2
LR = 1e-3


def _config(stage, dtype, device, path, *, step_in_backward=True, opt="AdamW", extra=None, lr=LR):
    zero = {"stage": stage, "reduce_bucket_size": 2000, "sub_group_size": 1000}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0)
    off = {"device": device, "step_in_backward": step_in_backward}
    if device == "nvme":
        off.update(nvme_path=path, buffer_count=3, pipeline_read=True, pipeline_write=True)
    zero["offload_optimizer"] = off
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "bf16": {"enabled": dtype == "bf16"},
           "zero_optimization": zero, "aio": {"block_size": 65536, "queue_depth": 4, "thread_count": 2}}
    # SGD's scale-sensitive step from Adam (the host kernels have no SGD): no moments and eps far
    # above |g|, so the step is ~ lr * g / eps, linear in the gradient.
    cfg["optimizer"] = ({"type": "Adam", "params": {"lr": lr, "betas": [0.0, 0.0], "eps": 1e3}}
                        if opt == "SGD" else
                        {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}})
    cfg.update(extra or {})
    return cfg


def _train(rank, world, cfg):
    import zerokit

    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(), config=cfg)
    in_backward = []  # per step: parts stepped before step() was called

    def before_step(_i=None):
        in_backward.append(sum(len(e._in_backward) for e in engine.kernel_executors))

    original = engine.step

    def step():
        before_step()
        original()

    engine.step = step
    losses = engine_train(engine, global_batches(STEPS, MICRO * world), rank, world)
    out = {"losses": losses, "weights": engine.consolidated_fp32_state_dict(), "io": engine.nvme_io(),
           "in_backward": in_backward, "nvme_bytes": engine.ledger.bytes(tier="nvme"),
           "nvme_numel": sum(u.layout.nvme_numel for u in engine.units),
           "offloaded_parts": sum(1 for u in engine.units for p in u.parts if p.tier != "device")}
    engine.destroy()
    return out


def _exact(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), (k, (a[k] - b[k]).abs().max().item())


# Every stage, precision, world size and update with each device, not every combination (the
# suite's time): the scale-sensitive update at every stage with NVMe, world 2 at stage 3 both ways.
GRID = [("cpu", 1, "fp32", 2, "SGD"), ("cpu", 2, "bf16", 1, "AdamW"), ("cpu", 3, "bf16", 2, "AdamW"),
        ("cpu", 3, "fp32", 1, "SGD"),
        ("nvme", 1, "bf16", 1, "SGD"), ("nvme", 2, "fp32", 2, "SGD"), ("nvme", 3, "bf16", 2, "SGD"),
        ("nvme", 3, "fp32", 2, "AdamW"), ("nvme", 2, "bf16", 1, "AdamW")]


@pytest.mark.slow
@pytest.mark.parametrize("device,stage,dtype,world,opt", GRID)
def test_step_in_backward_equals_the_step(tmp_path, device, stage, dtype, world, opt):
    base = run_world(_train, world, _config(stage, dtype, device, str(tmp_path), opt=opt,
                                            step_in_backward=False))
    sib = run_world(_train, world, _config(stage, dtype, device, str(tmp_path), opt=opt))
    for r in range(world):
        assert base[r]["in_backward"] == [0] * STEPS
        # every offloaded part (all of this rank's: each unit's backward reaches every rank)
        assert sib[r]["in_backward"] == [sib[r]["offloaded_parts"]] * STEPS
        assert sib[r]["losses"] == base[r]["losses"]
        _exact(sib[r]["weights"], base[r]["weights"])
        if device == "nvme":  # master and two moments, each read and written once; no gradient
            n = sib[r]["nvme_numel"]
            assert n > 0 and sib[r]["nvme_bytes"] == 24 * n  # master and moments, two slots
            assert sib[r]["io"]["bytes_read"] == sib[r]["io"]["bytes_written"] == 12 * n
            # stepped in step(): the gradient file too, bf16 at one rank ([Note: 16-bit
            # offloaded gradients] in engine/precision.py)
            grad = 2 if dtype == "bf16" and world == 1 else 4
            assert base[r]["io"]["bytes_read"] == (12 + grad) * n


@pytest.mark.parametrize("device", slow_except(["cpu", "nvme"], fast=["nvme"]))
def test_step_in_backward_matches_torch(tmp_path, device):
    """Independent of zerokit's own step: torch's AdamW over the same batches (fp32, world 2)."""
    ref_losses, ref = reference_train(tiny_gpt, lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.1),
                                      global_batches(STEPS, MICRO * 2))
    for r in run_world(_train, 2, _config(2, "fp32", device, str(tmp_path))):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-6, atol=1e-6)
        for name, w in ref.items():
            torch.testing.assert_close(r["weights"][name], w, rtol=1e-5, atol=LR * 1e-3, msg=name)


@pytest.mark.parametrize("device", slow_except(["cpu", "nvme"], fast=["cpu"]))
def test_step_in_backward_gradient_scale_matches_torch(tmp_path, device):
    """Adam hides a gradient's scale; the SGD-like update (no moments, eps >> |g|) moves each
    weight by ~lr * g / eps, so the updates themselves, compared with torch's relatively, catch a
    gradient summed instead of averaged over ranks or landed twice."""
    start = {k: v.detach().clone() for k, v in tiny_gpt().named_parameters()}
    lr = 10.0  # updates ~1e-2 * g: well above the weights' fp32 resolution
    _, ref = reference_train(tiny_gpt, lambda ps: torch.optim.Adam(ps, lr=lr, betas=(0.0, 0.0), eps=1e3),
                             global_batches(STEPS, MICRO * 2))
    cfg = _config(2, "fp32", device, str(tmp_path), opt="SGD", lr=lr)
    # zerokit's config "Adam" is torch's AdamW, whose default weight_decay is 0.01 (DeepSpeed's
    # FusedAdam: 0): set it, so the update is the gradient's alone
    cfg["optimizer"]["params"]["weight_decay"] = 0.0
    for r in run_world(_train, 2, cfg):
        for name, w in ref.items():
            moved, want = r["weights"][name] - start[name], w - start[name]
            assert want.abs().max() > 0, name
            torch.testing.assert_close(moved, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()),
                                       msg=lambda m, name=name: f"{name}: {m}")


def test_auto_is_on_for_offloaded_optimizers_and_off_with_the_delayed_update():
    from zerokit.config import load_config
    from zerokit.policy import PlacementPolicy

    def placement(off):
        cfg = load_config({"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
                           "fp16": {"enabled": True}, "gradient_accumulation_steps": 4,
                           "zero_optimization": {"stage": 2, "offload_optimizer": off}})
        return PlacementPolicy.from_config(cfg.zero_optimization)

    assert placement({"device": "cpu"}).step_in_backward
    assert not placement({"device": "cpu", "step_in_backward": False}).step_in_backward
    assert not placement({"device": "cpu", "delayed_update": {"enabled": True}}).step_in_backward
    assert not placement({"device": "none"}).step_in_backward


def test_refused_with_the_delayed_update_or_no_offload():
    from zerokit.config import load_config

    for off, words in (({"device": "cpu", "delayed_update": {"enabled": True}}, "delayed_update off"),
                       ({"device": "none"}, "'cpu' or 'nvme' (got 'none')")):
        cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
            "stage": 2, "offload_optimizer": {**off, "step_in_backward": True}}}
        with pytest.raises(Exception) as err:
            load_config(cfg)
        assert "step_in_backward" in str(err.value) and words in str(err.value), str(err.value)


def _nonfinite(rank, world, cfg):
    import zerokit

    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(), config=cfg)
    errors = []
    for i, (x, y) in enumerate(global_batches(3, MICRO)):
        loss = engine(x, y)
        engine.backward(loss * float("nan") if i == 1 else loss)
        try:
            engine.step()
        except Exception as e:  # noqa: BLE001 - the message is the test
            errors.append(type(e).__name__)
    out = (errors, engine.skipped_steps, engine.consolidated_fp32_state_dict(), dict(vars(engine.speculation)),
           engine.memory_report())
    engine.destroy()
    return out


@pytest.mark.parametrize("device,action", slow_except(
    [("cpu", "skip"), ("cpu", "stop"), ("nvme", "skip"), ("nvme", "stop")], fast=[("nvme", "stop")]))
def test_nonfinite_gradient_as_stepping_in_step(tmp_path, device, action):
    """The update applied in backward is rolled back: 'skip' skips the step and 'stop' raises
    NonFiniteError and trains on, as with step_in_backward false, to the same weights."""
    runs = [run_world(_nonfinite, 1, _config(2, "bf16", device, str(tmp_path), step_in_backward=sib,
                                             extra={"nonfinite": action}))[0] for sib in (True, False)]
    (errors, skipped, weights, counts, report), (base_errors, base_skipped, base_weights, _, _) = runs
    assert errors == base_errors == ([] if action == "skip" else ["NonFiniteError"]), (errors, base_errors)
    assert skipped == base_skipped == (1 if action == "skip" else 0)
    assert (counts["committed"], counts["skipped"]) == (2, 1), counts
    assert "speculative steps: committed 2, redone 0" in report and "skipped 1" in report, report
    _exact(weights, base_weights)


def test_off_where_the_host_cannot_hold_the_restores(monkeypatch, caplog):
    """initialize says so in one line, naming the bytes, and steps in step() instead (no OOM)."""
    import logging

    import zerokit
    from zerokit.engine import host_budget

    monkeypatch.setattr(host_budget, "speculation_need", lambda layouts, kind, *dtypes: (0, 1 << 50, 0))
    with caplog.at_level(logging.WARNING, logger="zerokit"):
        engine, _, _, _ = zerokit.initialize(model=tiny_gpt(), config=_config(2, "bf16", "cpu", None))
    try:
        assert not engine._steps_in_backward and not engine.placement.step_in_backward
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "step_in_backward off" in text and "1048576.00 GiB of restores" in text, text
        (x, y), = global_batches(1, MICRO)
        engine.backward(engine(x, y))
        assert not engine.stepped_in_backward
        engine.step()
    finally:
        engine.destroy()


def _two_backwards(rank, world, cfg):
    import zerokit

    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(), config=cfg)
    (x, y), = global_batches(1, MICRO)
    engine.backward(engine(x, y))
    try:
        engine.backward(engine(x, y))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_second_backward_before_step_names_the_unit(tmp_path):
    text = run_world(_two_backwards, 1, _config(2, "fp32", "nvme", str(tmp_path)))[0]
    assert "finished a second backward before engine.step()" in text and "unit '" in text, text


def _read_between(rank, world, cfg):
    """A state dict read between backward and step() (after a step-in-backward backward)."""
    import zerokit

    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(), config=cfg)
    between = []
    for i, (x, y) in enumerate(global_batches(STEPS, MICRO)):
        engine.backward(engine(x, y))
        if i == 1:
            between.append(engine.consolidated_fp32_state_dict())
        engine.step()
    out = engine.consolidated_fp32_state_dict()
    engine.destroy()
    return between[0], out


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_reading_the_state_between_backward_and_step(tmp_path, device):
    """Reading a part's state while its worker may still step ends that worker instead of waiting
    for step() (which this thread would call): no hang, the masters read are those before the step (the update applied in backward is not decided:
    an nvme part's live slot, a host part's restore), and training goes on to the same weights
    as stepping in step()."""
    base = run_world(_read_between, 1, _config(2, "fp32", device, str(tmp_path), step_in_backward=False),
                     timeout=120)[0]
    sib = run_world(_read_between, 1, _config(2, "fp32", device, str(tmp_path)), timeout=120)[0]
    _exact(sib[1], base[1])
    _exact(sib[0], base[0])
