"""offload_optimizer.step_in_backward: each unit's offloaded parts step as soon as backward has
reduced its gradient, on the host worker while backward goes on (parts/executors.py).

- parity: the weights after each step equal, bit for bit, those of the same run stepping in
  step() (host memory and NVMe, stages 1-3, fp32 and bf16, world 1 and 2, AdamW and an SGD-like,
  scale-sensitive update), and an independent torch reference within float noise; the parts
  really were stepped in backward (before step() was called), and with NVMe no gradient went to
  disk: 12 bytes per NVMe element each way (master and two moments), not 16.
- refusals: each setting that needs every gradient before any update is refused, naming it.
- a non-finite gradient stops the engine (the update is applied already, it cannot be skipped);
  a second backward before step() raises naming the unit.
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
            assert n > 0 and sib[r]["nvme_bytes"] == 12 * n
            assert sib[r]["io"]["bytes_read"] == sib[r]["io"]["bytes_written"] == 12 * n
            assert base[r]["io"]["bytes_read"] == 16 * n


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


@pytest.mark.parametrize("extra,words", [
    ({"gradient_clipping": 1.0}, "gradient_clipping 0 (got 1.0)"),
    ({"bf16": {"enabled": False}, "fp16": {"enabled": True}}, "no fp16"),
    ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps 2"),
])
def test_refused_where_every_gradient_is_needed_first(tmp_path, extra, words):
    import zerokit

    cfg = _config(2, "bf16", "cpu", None, extra=extra)
    with pytest.raises((ValueError, NotImplementedError)) as err:
        zerokit.initialize(model=tiny_gpt(), config=cfg)
    assert "step_in_backward" in str(err.value) and words in str(err.value), str(err.value)


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
    (x, y), = global_batches(1, MICRO)
    engine.backward(engine(x, y))
    engine.step()
    loss = engine(x, y)
    loss = loss * float("nan")
    engine.backward(loss)
    errors = []
    try:
        engine.step()
    except Exception as e:  # noqa: BLE001 - the message is the test
        errors.append(f"{type(e).__name__}: {e}")
    try:
        engine(x, y)
    except Exception as e:  # noqa: BLE001
        errors.append(f"{type(e).__name__}: {e}")
    return errors


@pytest.mark.parametrize("device", slow_except(["cpu", "nvme"], fast=["cpu"]))
def test_nonfinite_gradient_stops_the_engine(tmp_path, device):
    """nonfinite 'skip' (the default) cannot skip an update applied in backward: step() raises
    and the engine refuses to train on."""
    errors = run_world(_nonfinite, 1, _config(2, "bf16", device, str(tmp_path)))[0]
    assert len(errors) == 2, errors
    assert errors[0].startswith("NonFiniteError") and "step_in_backward" in errors[0], errors[0]
    assert errors[1].startswith("EngineFailedError") and "load the last checkpoint" in errors[1], errors[1]


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


def _resident_after_steps(rank, world, cfg, layers, width):
    import psutil

    import zerokit
    from zerokit.models import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=layers, n_embd=width, n_head=4, block_size=16, vocab_size=64))
    engine, _, _, _ = zerokit.initialize(model=model, config=cfg)
    del model
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        tokens = torch.randint(0, 64, (MICRO, 17), generator=g)
        engine.backward(engine(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
        engine.step()
    rss = psutil.Process().memory_info().rss
    numel = sum(u.numel for u in engine.units if u.trainable)
    engine.destroy()
    return rss, numel


@pytest.mark.slow
def test_no_gradient_buffer_is_kept_between_steps(tmp_path):
    """Measured, not from the ledger: the process's resident memory after three steps with host
    offload is lower stepping in backward by about the fp32 gradient of every element (4 B each),
    less the held gradients' pool (3 buffers of the largest unit's part)."""
    layers, width = 12, 384
    base = _config(2, "fp32", "cpu", None, step_in_backward=False)
    rss_base, numel = run_world(_resident_after_steps, 1, base, layers, width)[0]
    rss_sib, _ = run_world(_resident_after_steps, 1, _config(2, "fp32", "cpu", None), layers, width)[0]
    block = 12 * width * width + 13 * width
    expected = 4 * numel - 3 * 4 * block  # the root unit (embeddings, vocab 64) is smaller than a block
    saved = rss_base - rss_sib
    assert saved > 0.6 * expected, (saved / 2**20, expected / 2**20)


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
    for step() (which this thread would call): no hang, the masters read are the updated ones,
    and training goes on to the same weights as stepping in step()."""
    base = run_world(_read_between, 1, _config(2, "fp32", device, str(tmp_path), step_in_backward=False),
                     timeout=120)[0]
    sib = run_world(_read_between, 1, _config(2, "fp32", device, str(tmp_path)), timeout=120)[0]
    _exact(sib[1], base[1])
    # between: the in-backward run has applied step 2's update already, the other not yet
    assert any(not torch.equal(sib[0][k], base[0][k]) for k in base[0])
