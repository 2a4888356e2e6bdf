"""ZeRO-Infinity's optimizer on NVMe (offload_optimizer device 'nvme', parts/nvme_executor.py).

- parity: the optimizer streamed from NVMe in sub-groups gives the weights of the same run with
  the optimizer in host memory (device 'cpu'), bit for bit, at stages 1-3, fp32 and bf16, world
  1 and 2, with AdamW (clipped) and an SGD-like, scale-sensitive update (Adam without moments
  and with eps >> |g|, unclipped); and with a host budget (max_in_cpu) splitting the optimizer
  between host memory and NVMe.
- the start-up plan names the bytes on NVMe and the expected traffic; memory_report() the I/O.
- faults: a deleted or truncated swap file fails the step naming the file; a missing, non-directory,
  read-only or too-small nvme_path and an impossible host budget are refused at initialize.
"""
from __future__ import annotations

import os

import pytest
import torch

from harness import run_world
from reference import engine_train, global_batches, reference_train, resume_train, tiny_gpt
from fast_tier import slow_except

from zerokit.parts.nvme import GRAD_CHUNK_BYTES

STEPS, MICRO = 3, 2


def _config(stage, dtype, opt, device, path, *, sub_group=1000, extra=None, clip=1.0):
    zero = {"stage": stage, "reduce_bucket_size": 2000, "sub_group_size": sub_group}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0)
    # The stream in step() (gradients in files); stepping in backward, the default for offloaded
    # optimizers, has its own tests (test_step_in_backward.py, test_speculative_step.py).
    off = {"device": device, "step_in_backward": False}
    if device == "nvme":
        off.update(nvme_path=path, buffer_count=3, pipeline_read=True, pipeline_write=True)
    off.update(extra or {})
    zero["offload_optimizer"] = off
    params = {"AdamW": {"lr": 1e-3, "weight_decay": 0.1}, "SGD": {"lr": 0.5},
              "Adagrad": {"lr": 1e-2}}[opt]
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": clip,
           "bf16": {"enabled": dtype == "bf16"}, "zero_optimization": zero,
           "aio": {"block_size": 65536, "queue_depth": 4, "thread_count": 2}}
    if opt == "SGD":
        # The host kernels are Adam, Adagrad and Lion (torch's SGD has none, offload refuses it).
        # SGD's scale-sensitive step from Adam: no moments (betas 0) and eps far above |g|, so
        # the step is lr * g / (|g| + eps) ~ lr * g / eps, linear in the gradient.
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.0, 0.0], "eps": 1e3}}
    else:
        cfg["optimizer"] = {"type": opt, "params": params}
    return cfg


def _train(rank, world, cfg, fail=None):
    import zerokit

    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(), config=cfg)
    batches = global_batches(STEPS, MICRO * world)
    if fail is not None:
        engine_train(engine, batches[:1], rank, world)
        _break_files(engine, fail)
        try:
            engine_train(engine, batches[1:2], rank, world)
        except Exception as e:  # noqa: BLE001 - the message is the test
            return repr(e)
        return "no error"
    losses = engine_train(engine, batches, rank, world)
    out = {"losses": losses, "weights": engine.consolidated_fp32_state_dict(),
           "report": engine.memory_report(), "io": engine.nvme_io(),
           "nvme_bytes": engine.ledger.bytes(tier="nvme"),
           "nvme_numel": sum(u.layout.nvme_numel for u in engine.units),
           "held_numel": sum(u.layout.held_nvme_numel for u in engine.units),
           "host_numel": sum(u.host_numel for u in engine.units)}
    engine.destroy()
    return out


def _break_files(engine, how):
    part = next(p for u in engine.units for p in u.parts if p.tier == "nvme")
    if how == "delete":
        os.unlink(part.state["exp_avg"].path)
    else:
        os.truncate(part.master.path, 8)


def _exact(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), (k, (a[k] - b[k]).abs().max().item())


GRID = [(stage, dtype, world) for stage in (1, 2, 3) for dtype in ("fp32", "bf16") for world in (1, 2)]


@pytest.mark.parametrize("stage,dtype,world", slow_except(GRID, fast=[(1, "fp32", 1)]))
@pytest.mark.parametrize("opt", slow_except(["AdamW", "SGD"], fast=["SGD"]))
def test_nvme_equals_cpu_offload(tmp_path, stage, dtype, world, opt):
    clip = 0.0 if opt == "SGD" else 1.0  # SGD: nothing rescales the gradient but the kernel
    cpu = run_world(_train, world, _config(stage, dtype, opt, "cpu", None, clip=clip))
    nvme = run_world(_train, world, _config(stage, dtype, opt, "nvme", str(tmp_path), clip=clip))
    for r in range(world):
        assert nvme[r]["nvme_numel"] > 0 and nvme[r]["host_numel"] == 0
        assert nvme[r]["losses"] == cpu[r]["losses"]
        _exact(nvme[r]["weights"], cpu[r]["weights"])
        io = nvme[r]["io"]  # the disk's idle time over the last step, reported
        assert 0 <= io["idle_s"] <= min(io["read_idle_s"], io["write_idle_s"]) <= io["window_s"]
        assert "disk idle" in nvme[r]["report"]
    assert not os.listdir(tmp_path), "the swap directory is removed when the engine is destroyed"


@pytest.mark.slow
def test_host_budget_splits_and_reports(tmp_path):
    """max_in_cpu keeps the first units' elements in host memory: same weights, fewer on NVMe;
    the I/O report counts exactly the master, gradient and Adam state of the NVMe elements, each
    written and read once (the gradient written by backward, read by the step)."""
    cpu = run_world(_train, 1, _config(2, "bf16", "AdamW", "cpu", None))[0]
    full = run_world(_train, 1, _config(2, "bf16", "AdamW", "nvme", str(tmp_path)))[0]
    half = run_world(_train, 1, _config(2, "bf16", "AdamW", "nvme", str(tmp_path),
                                        extra={"max_in_cpu": 5000}))[0]
    _exact(half["weights"], cpu["weights"])
    _exact(full["weights"], cpu["weights"])
    assert half["host_numel"] == 5000 - 5000 % 64 or half["host_numel"] <= 5000
    assert half["host_numel"] > 0
    assert half["host_numel"] + half["nvme_numel"] == full["nvme_numel"]
    # fp32 master, two fp32 Adam moments, and the gradient in bf16 (one rank, one micro-step:
    # [Note: 16-bit offloaded gradients])
    per_element = 4 + 8 + 2
    for run in (full, half):
        assert run["nvme_bytes"] == per_element * run["nvme_numel"]
        assert run["io"]["bytes_read"] == run["io"]["bytes_written"] == per_element * run["nvme_numel"]
        assert "nvme I/O, last step" in run["report"] and "GB/s" in run["report"]
        assert run["io"]["io_s"] > 0 and run["io"]["gb_per_s"] > 0 and run["io"]["wait_s"] >= 0


def test_startup_plan_names_nvme(tmp_path, caplog):
    import logging

    import zerokit

    caplog.set_level(logging.INFO, logger="zerokit")
    run_world(_startup, 1, _config(1, "fp32", "AdamW", "nvme", str(tmp_path)))


def _startup(rank, world, cfg):
    import logging

    import zerokit
    from zerokit.config.plan import explain

    engine, *_ = zerokit.initialize(model=tiny_gpt(), config=cfg)
    text = explain(engine)
    assert "optimizer elements on NVMe" in text and "expected NVMe traffic per step" in text, text
    assert "nvme" in engine.memory_report()
    engine.destroy()


@pytest.mark.parametrize("how,what", slow_except([("delete", "exp_avg.swp"), ("truncate", "nvme_master.swp")],
                                              fast=[("delete", "exp_avg.swp")]))
def test_broken_swap_file_names_it(tmp_path, how, what):
    msg = run_world(_train, 1, _config(2, "fp32", "AdamW", "nvme", str(tmp_path)), fail=how)[0]
    assert what in msg and ("short file" in msg or "No such file" in msg), msg


def _init_error(rank, world, cfg):
    import zerokit

    try:
        zerokit.initialize(model=tiny_gpt(), config=cfg)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_bad_nvme_path_refused(tmp_path):
    missing = str(tmp_path / "nope")
    afile = tmp_path / "afile"
    afile.write_text("x")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        # root writes into a mode-0500 directory: there, /proc stands for a read-only one
        unwritable = str(ro) if os.geteuid() != 0 else "/proc"
        cases = [(missing, "does not exist"), (str(afile), "is not a directory"),
                 (unwritable, "is not writable")]
        for path, text in cases:
            msg = run_world(_init_error, 1, _config(2, "fp32", "AdamW", "nvme", path))[0]
            assert text in msg and path in msg, msg
    finally:
        ro.chmod(0o700)


def test_too_small_path_and_impossible_budget_refused(tmp_path, monkeypatch):
    from zerokit.engine import host_budget, nvme_plan

    with pytest.raises(nvme_plan.NvmePathError, match=r"has 1\.0 MiB free.*per rank"):
        nvme_plan.check_nvme_path(str(tmp_path), 3 << 20, ranks=1, free=1 << 20)
    msg = run_world(_init_error, 1, _config(2, "fp32", "AdamW", "nvme", str(tmp_path),
                                            extra={"max_in_cpu": 10**12}),
                    )[0]
    assert "no error" in msg  # a budget above the model is the whole model in RAM: fine here
    from zerokit.policy import PlacementPolicy

    need = host_budget.HostNeed(master=4 << 30)
    with pytest.raises(host_budget.HostMemoryError, match="max_in_cpu"):
        host_budget.check_host_memory(need, PlacementPolicy(1.0, nvme=True, ram_numel=1 << 30),
                                      ranks=1, available=(1 << 30, "test"))


# ---- checkpoints: NVMe-resident state streamed file to file ([Note: nvme parts in checkpoints]) ----
@pytest.mark.parametrize("stage,dtype,world", slow_except([(2, "bf16", 2), (3, "fp32", 1), (1, "fp32", 2)],
                                                      fast=[(3, "fp32", 1)]))
def test_nvme_checkpoint_resume_is_exact(tmp_path, stage, dtype, world):
    nvme = _config(stage, dtype, "AdamW", "nvme", str(tmp_path / "swap"))
    (tmp_path / "swap").mkdir()
    cpu = _config(stage, dtype, "AdamW", "cpu", None)
    for i, (save, load) in enumerate([(nvme, nvme), (nvme, cpu), (cpu, nvme)]):
        for a, b in run_world(resume_train, world, save, load, str(tmp_path / f"ckpt{i}"),
                              async_save=i == 0):
            _exact(a, b)


def _train_edit(rank, world, cfg):
    """Two steps, an edit of one weight under GatheredParameters (modifier rank 0), two steps."""
    import zerokit
    from zerokit.zero import GatheredParameters

    engine, *_ = zerokit.initialize(model=tiny_gpt(), config=cfg)
    batches = global_batches(4, MICRO * world)
    engine_train(engine, batches[:2], rank, world)
    weight = engine.module.transformer.h[0].mlp.c_fc.weight
    with GatheredParameters([weight], modifier_rank=0):
        if rank == 0:
            weight.data.mul_(0.5)
    engine_train(engine, batches[2:], rank, world)
    out = engine.consolidated_fp32_state_dict()
    engine.destroy()
    return out


@pytest.mark.parametrize("opt,stream", [
    ("Adagrad", {"buffer_count": 2, "pipeline_read": False, "pipeline_write": False}),
    ("Lion", {"buffer_count": 2, "pipeline_read": True, "pipeline_write": False}),
    ("AdamW", {"buffer_count": 5, "pipeline_read": False, "pipeline_write": True}),
])
@pytest.mark.slow
def test_other_kernels_and_stream_settings(tmp_path, opt, stream):
    """Adagrad (a non-zero initial accumulator written into its state file), Lion, and every
    pipeline setting give cpu offload's weights; so does an edit under GatheredParameters."""
    params = {"Adagrad": {"lr": 1e-2, "initial_accumulator_value": 0.1},
              "Lion": {"lr": 1e-4, "weight_decay": 0.1}, "AdamW": {"lr": 1e-3}}[opt]
    configs = []
    for device in ("cpu", "nvme"):
        cfg = _config(3, "bf16", "AdamW", device, str(tmp_path), sub_group=777,
                      extra=stream if device == "nvme" else None)
        cfg["optimizer"] = {"type": opt, "params": params}
        configs.append(cfg)
    cpu, nvme = (run_world(_train_edit, 2, cfg) for cfg in configs)
    for r in range(2):
        _exact(nvme[r], cpu[r])


def _train_accumulating(rank, world, cfg, gas):
    import zerokit

    cfg = dict(cfg, gradient_accumulation_steps=gas)
    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(), config=cfg)
    losses = engine_train(engine, global_batches(STEPS, MICRO * world * gas), rank, world, gas)
    out = {"losses": losses, "weights": engine.consolidated_fp32_state_dict(),
           "host_grads": engine.ledger.bytes(tier="host", kind="grads"),
           "nvme_grads": engine.ledger.bytes(tier="nvme", kind="grads"),
           "nvme_numel": sum(u.layout.nvme_numel for u in engine.units),
           "held_numel": sum(u.layout.held_nvme_numel for u in engine.units),
           "read_ahead": dict(engine.nvme_tier.read_ahead.stats) if engine.nvme_tier else None,
           "read_ahead_limit": engine.nvme_tier.read_ahead.limit if engine.nvme_tier else None,
           "io": engine.nvme_io(), "report": engine.memory_report()}
    engine.destroy()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stage,dtype,gas", [(1, "fp32", 2), (2, "bf16", 2), (3, "fp32", 3)])
def test_gradients_on_nvme_accumulate_like_cpu_offload(tmp_path, stage, dtype, gas):
    """The nvme part's gradient lives in its file ([Note: gradients on NVMe]): none in host
    memory, and accumulated over micro-steps (read, add, write) to cpu offload's weights; from
    the second step on, the earlier sums are read ahead at stages 2 and 3 ([Note: gradient
    read-ahead]; stage 1 sums the micro-steps on the device)."""
    cpu = run_world(_train_accumulating, 2, _config(stage, dtype, "SGD", "cpu", None, clip=0.0), gas)
    nvme = run_world(_train_accumulating, 2, _config(stage, dtype, "SGD", "nvme", str(tmp_path), clip=0.0), gas)
    for r in range(2):
        assert nvme[r]["host_grads"] == 0 and nvme[r]["nvme_grads"] == 4 * nvme[r]["nvme_numel"] > 0
        assert nvme[r]["losses"] == cpu[r]["losses"]
        _exact(nvme[r]["weights"], cpu[r]["weights"])
        if stage == 1:  # the micro-steps sum on the device; the boundary's reduction writes once
            assert nvme[r]["read_ahead"] == {"ahead": 0, "now": 0}
            assert nvme[r]["read_ahead_limit"] == 0
            assert nvme[r]["io"]["sums_read_ahead"] == nvme[r]["io"]["sums_read_when_asked"] == 0
            assert "gradient sums read ahead" not in nvme[r]["report"]
        else:
            assert nvme[r]["read_ahead_limit"] == GRAD_CHUNK_BYTES  # initialize sized it: one chunk here
            assert nvme[r]["read_ahead"]["ahead"] > nvme[r]["read_ahead"]["now"] > 0, nvme[r]["read_ahead"]
            # the last step's share, in its I/O report and memory_report()
            io = nvme[r]["io"]
            ahead, now = io["sums_read_ahead"], io["sums_read_when_asked"]
            assert 0 < ahead < nvme[r]["read_ahead"]["ahead"] and now < nvme[r]["read_ahead"]["now"], io
            assert f"gradient sums read ahead {ahead} of {ahead + now} ({now} read when asked)" \
                in nvme[r]["report"], nvme[r]["report"]


@pytest.mark.slow
@pytest.mark.parametrize("stage,dtype,gas,clip,held", [
    (2, "fp32", 1, 0.0, None), (3, "bf16", 3, 1.0, None), (1, "fp32", 2, 0.0, None),
    (3, "fp32", 3, 1.0, 4000), (2, "bf16", 2, 0.0, 4000)])
def test_nvme_gradients_held_in_host_memory_step_like_cpu_offload(tmp_path, stage, dtype, gas, clip,
                                                                  held):
    """offload_optimizer.nvme_gradients 'host': the nvme part's gradients wait for the step in
    host memory (counted as host grads, 4 B per nvme element), no gradient file, nothing read
    back; the weights equal cpu offload's bit for bit, with accumulation and with clipping that
    applies (the scale-sensitive update). With nvme_gradients_max_in_cpu (`held`) the first
    parts that fit hold theirs and the others have files, in one stream: the same bits."""
    extra = {"nvme_gradients": "host"}
    if held is not None:
        extra["nvme_gradients_max_in_cpu"] = held
    cpu = run_world(_train_accumulating, 2, _config(stage, dtype, "SGD", "cpu", None, clip=clip), gas)
    nvme = run_world(_train_accumulating, 2, _config(stage, dtype, "SGD", "nvme", str(tmp_path), clip=clip,
                                                     extra=extra), gas)
    for r in range(2):
        if held is None:
            assert nvme[r]["nvme_grads"] == 0
            assert nvme[r]["host_grads"] == 4 * nvme[r]["nvme_numel"] > 0
            assert nvme[r]["read_ahead"] == {"ahead": 0, "now": 0} and nvme[r]["read_ahead_limit"] == 0
        else:  # some parts each way, counted where they are
            assert 0 < nvme[r]["held_numel"] <= held
            assert nvme[r]["host_grads"] == 4 * nvme[r]["held_numel"]
            assert nvme[r]["nvme_grads"] == 4 * (nvme[r]["nvme_numel"] - nvme[r]["held_numel"]) > 0
        assert nvme[r]["losses"] == cpu[r]["losses"]
        _exact(nvme[r]["weights"], cpu[r]["weights"])
    if dtype == "fp32":  # and an independent reference: torch's Adam, linear in the gradient here
        _, ref = reference_train(tiny_gpt, lambda ps: torch.optim.Adam(ps, lr=1e-3, betas=(0.0, 0.0), eps=1e3),
                                 global_batches(STEPS, MICRO * 2 * gas), clip=clip)
        start = tiny_gpt().state_dict()
        for name, w in ref.items():  # the updates (1e-7 of weights ~1e-2): within 1% of the largest
            want = w - start[name]
            torch.testing.assert_close(nvme[0]["weights"][name] - start[name], want, rtol=0,
                                       atol=1e-2 * float(want.abs().max()), msg=lambda m: f"{name}: {m}")


def _train_ledger(rank, world, cfg):
    import zerokit

    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(), config=cfg)
    losses = engine_train(engine, global_batches(STEPS, MICRO * world), rank, world)
    out = {"losses": losses, "weights": engine.consolidated_fp32_state_dict(),
           "host_buffers": engine.ledger.bytes(tier="host", kind="buffers"),
           "host_weights": engine.ledger.bytes(tier="host", kind="weights")}
    engine.destroy()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_with_offload_param_the_stream_writes_the_host_shard_in_place(tmp_path, dtype):
    """offload_param cpu + the optimizer on NVMe: the new weights land in the host shard itself
    (no second 16-bit copy of the nvme part in RAM), with cpu offload's weights bit for bit."""
    configs = []
    for device in ("cpu", "nvme"):
        cfg = _config(3, dtype, "AdamW", device, str(tmp_path))
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
        configs.append(cfg)
    cpu, nvme = (run_world(_train_ledger, 2, cfg) for cfg in configs)
    for r in range(2):
        assert nvme[r]["losses"] == cpu[r]["losses"]
        _exact(nvme[r]["weights"], cpu[r]["weights"])
        # host buffers: only the stream's 3 sets x (master, gradient, 2 moments) x 1000 fp32
        assert nvme[r]["host_weights"] > 0 and nvme[r]["host_buffers"] == 3 * 4 * 1000 * 4, nvme[r]


def _delayed(stage, dtype, device, path, max_in_cpu=0):
    cfg = _config(stage, dtype, "AdamW", device, path,
                  extra={"delayed_update": {"enabled": True, "warmup_steps": 1},
                         **({"max_in_cpu": max_in_cpu} if device == "nvme" else {})})
    return cfg


def _train_delayed(rank, world, cfg, steps, save_at=None, ckpt=None):
    """`steps` steps; with save_at, save after that many (a delayed update in flight), load the
    checkpoint into a fresh engine and finish there."""
    import time

    import zerokit
    from zerokit.parts.nvme_executor import NvmeExecutor

    # The stream starts late, so it surely runs while the next backward writes gradients.
    stream = NvmeExecutor._stream
    NvmeExecutor._stream = lambda self, *a: (time.sleep(0.2), stream(self, *a))[1]
    batches = global_batches(steps, MICRO * world)
    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(), config=cfg)
    stop = steps if save_at is None else save_at
    losses = engine_train(engine, batches[:stop], rank, world)
    if save_at is not None:
        assert any(e.pending_write_back for e in engine.kernel_executors)
        engine.save_checkpoint(ckpt, tag="t")
        engine.destroy()
        engine, _, _, _ = zerokit.initialize(model=tiny_gpt(seed=5), config=cfg)
        engine.load_checkpoint(ckpt, tag="t")
        losses += engine_train(engine, batches[stop:], rank, world)
    nvme = next((e for e in engine.kernel_executors if e.tier == "nvme"), None)
    if nvme is not None:
        assert nvme._worker is not None, "the delayed NVMe stream was joined inside step()"
    out = {"losses": losses, "weights": engine.consolidated_fp32_state_dict()}
    engine.destroy()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stage,dtype,max_in_cpu", [(2, "bf16", 0), (3, "fp32", 5000)])
def test_delayed_update_on_nvme_equals_cpu_offloads(tmp_path, stage, dtype, max_in_cpu):
    """ZeRO-Offload's one-step delayed update with the optimizer on NVMe: the stream of step t
    runs on the executor's worker into step t + 1 (not joined inside step()), reading one
    gradient file while backward writes the other; the weights are the delayed cpu-offload
    run's bit for bit, also across a checkpoint taken with an update in flight."""
    cpu = run_world(_train_delayed, 2, _delayed(stage, dtype, "cpu", None), 4)
    nvme = run_world(_train_delayed, 2, _delayed(stage, dtype, "nvme", str(tmp_path), max_in_cpu), 4)
    resumed = run_world(_train_delayed, 2, _delayed(stage, dtype, "nvme", str(tmp_path), max_in_cpu),
                        4, save_at=2, ckpt=str(tmp_path / "ckpt"))
    for r in range(2):
        assert nvme[r]["losses"] == cpu[r]["losses"] == resumed[r]["losses"]
        _exact(nvme[r]["weights"], cpu[r]["weights"])
        _exact(resumed[r]["weights"], cpu[r]["weights"])


def _stream_blocks(rank, world, cfg):
    """The I/O engine's blocks by path over the last step (weights not on NVMe: the stream's
    and the gradient files' I/O), the units' reduction buckets, and the weights."""
    import zerokit

    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(), config=cfg)
    batches = global_batches(STEPS, MICRO * world)
    engine_train(engine, batches[:-1], rank, world)
    before = engine.nvme_tier.aio.block_counts()
    engine_train(engine, batches[-1:], rank, world)
    after = engine.nvme_tier.aio.block_counts()
    parts = sum(1 for u in engine.units for p in u.parts if p.tier == "nvme")
    out = {"blocks": {k: after[k] - before[k] for k in after}, "parts": parts,
           "buckets": {u.bucket_numel for u in engine.units},
           "weights": engine.consolidated_fp32_state_dict(), "backend": engine.nvme_tier.aio.backend}
    engine.destroy()
    return out


def test_gradient_pieces_start_on_a_sector(tmp_path):
    """[Note: buckets on sectors] (units/reduction.py): with gradients in files, the reduction's
    buckets (reduce_bucket_size 2000, which would cut 2016-element pieces) are rounded to
    2048-element pieces, so each piece's write starts on a 4 KiB sector of its part's gradient
    file; with 2016 nearly every piece was staged through the engine's bounce buffers. The
    buckets as the units got them, and the weights are cpu offload's, bit for bit."""
    from zerokit.io import SECTOR_ELEMENTS
    from zerokit.policy import PlacementPolicy
    from zerokit.units.reduction import bucket_numel

    on_nvme = PlacementPolicy(nvme=True)
    assert bucket_numel(2000, 1, on_nvme) == 2048 and bucket_numel(2000, 4, on_nvme) == 4 * 2048
    assert bucket_numel(5 * SECTOR_ELEMENTS, 1, on_nvme) == 5 * SECTOR_ELEMENTS  # a multiple: as asked
    assert bucket_numel(2000, 2, PlacementPolicy()) == 2000  # no NVMe optimizer: as asked
    assert bucket_numel(2000, 2, PlacementPolicy(nvme=True, nvme_grads_held=True)) == 2000  # no files
    cfg = _config(2, "fp32", "AdamW", "nvme", str(tmp_path), sub_group=2048)  # gradients in files
    cfg["aio"]["block_size"] = 8192  # one 2048-element fp32 piece or sub-group: one block
    run = run_world(_stream_blocks, 1, cfg)[0]
    cpu = run_world(_train, 1, _config(2, "fp32", "AdamW", "cpu", None))[0]
    _exact(run["weights"], cpu["weights"])
    assert run["buckets"] == {2048}, run["buckets"]
    if run["backend"] != "linux-aio":
        pytest.skip(f"the I/O engine runs {run['backend']} here (no kernel AIO): every block is on "
                    f"its threads, so the staged ones cannot be told apart")
    # per part, the last sub-group of each of its 4 files (master, two moments, gradient), read
    # and written (the gradient's last piece written, its last sub-group read)
    staged, direct = run["blocks"]["threads"], run["blocks"]["kernel"]
    assert direct > 0 and staged <= run["parts"] * 4 * 2, run


def test_sub_groups_start_on_a_sector(tmp_path):
    """[Note: sector-aligned sub-groups]: sub_group_size 2500 is streamed as 2048-element
    sub-groups, whose reads and writes start on 4 KiB sectors of every file, so O_DIRECT moves
    them without staging: only each part's last sub-group (its length not whole sectors) goes
    through the engine's bounce buffers. The weights are cpu offload's, bit for bit."""
    from zerokit.io import SECTOR_ELEMENTS
    from zerokit.parts.nvme_executor import StreamSettings

    for size in (2048, 2500, 10_000_000, 1_000_000_000):  # every sub-group at a sector of 2- and 4-byte files
        n = StreamSettings(size, 4).group_numel
        assert size - SECTOR_ELEMENTS < n <= size and all((n * j * e) % 4096 == 0 for j in range(9) for e in (2, 4))
    assert StreamSettings(1000, 4).group_numel == 1000  # below a sector's worth: as given
    cfg = _config(2, "fp32", "AdamW", "nvme", str(tmp_path), sub_group=2500,
                  extra={"nvme_gradients": "host"})
    cfg["aio"]["block_size"] = 8192  # one 2048-element fp32 sub-group: one block per file range
    run = run_world(_stream_blocks, 1, cfg)[0]
    cpu = run_world(_train, 1, _config(2, "fp32", "AdamW", "cpu", None))[0]
    _exact(run["weights"], cpu["weights"])
    if run["backend"] != "linux-aio":
        pytest.skip(f"the I/O engine runs {run['backend']} here (no kernel AIO): every block is on "
                    f"its threads, so the staged ones cannot be told apart")
    # per part, the last sub-group of each of its 3 files (master, two moments), read and written
    staged, direct = run["blocks"]["threads"], run["blocks"]["kernel"]
    assert direct > 0 and staged <= run["parts"] * 3 * 2, run
