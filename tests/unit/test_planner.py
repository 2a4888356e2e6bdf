"""The placement planner's decisions (engine/planner.py, [Note: the placement planner]) on the
engine's own units of a small GPT, with injected bandwidths and memory outside the model states:
RAM that holds everything puts nothing on NVMe, a tight budget moves the coldest state to NVMe
and keeps in RAM what fits, an impossible budget is refused naming the smallest that works;
hand-set keys are kept; the step-time model is the stated sum; the bandwidths are cached."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from reference import tiny_gpt
from zerokit.config import load_config
from zerokit.engine import bandwidths, planner
from zerokit.engine.bandwidths import Bandwidths
from zerokit.engine.byte_plan import planned_bytes
from zerokit.engine.planner import PlacementBudgetError, PlanInputs, choose
from zerokit.models import GPTConfig
from zerokit.optim.recipe import recipe_from
from zerokit.policy import PartitionPolicy
from zerokit.sizes import mib
from zerokit.tier_names import TierName
from zerokit.units.wrap import group_parameters, select_modules

HOST, DEVICE, NVME = TierName.HOST, TierName.DEVICE, TierName.NVME
# host copy 10 GB/s, disk read 2 GB/s, write 1 GB/s, host Adam 400 M/s, device Adam 100 M/s
BW = Bandwidths(10e9, 2e9, 1e9, 400e6, 100e6, "", "injected")
# A GPT with more state than padding, and than the NVMe stream's buffers: 12 blocks of 64 wide
MODEL = GPTConfig(vocab_size=256, block_size=16, n_layer=12, n_head=4, n_embd=64, bias=False)
# 4 blocks: the configured sub-group's buffer sets (a whole part each) cost more than its states
SMALL = GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=4, n_embd=64, bias=False)


def _cfg(stage: int = 3, zero: dict | None = None, nvme: str | None = "/swap", **extra) -> object:
    z = {"stage": stage, **(zero or {})}
    if nvme:
        for section in ("offload_optimizer", "offload_param") if stage == 3 else ("offload_optimizer",):
            z.setdefault(section, {})
            z[section] = {"nvme_path": nvme, **z[section]}
    return load_config({"train_micro_batch_size_per_gpu": 2, "zero_optimization": z,
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **extra})


def _inputs(cfg, host: int | None, *, device: int | None = None, cuda: bool = False,
            world: int = 1, process: int = 0, transients: int = 0, gathered: int = 0,
            model=None, dtype: torch.dtype = torch.float32) -> PlanInputs:
    model = model if model is not None else tiny_gpt(cfg=MODEL)
    recipe = recipe_from(model, None, None, cfg.optimizer)
    groups = group_parameters(model, select_modules(model, None), recipe.group_of)
    budgets = {}
    if host is not None:
        budgets[HOST] = (host, "memory.host")
    if device is not None:
        budgets[DEVICE] = (device, "memory.device")
    return PlanInputs(cfg, groups, world, 0, cuda, PartitionPolicy.for_stage(cfg.zero_optimization.stage),
                      dtype, dtype, 1, recipe.kind, None, budgets,
                      process_bytes=process, transient_bytes=transients, gathered_bytes=gathered)


def _host_need(p) -> int:
    return p.checks["host"][0]


def test_everything_in_ram_puts_nothing_on_nvme_even_with_a_fast_disk():
    cfg = _cfg()
    fast_disk = Bandwidths(1e9, 100e9, 100e9, 400e6, 100e6, "", "a disk faster than RAM")
    for bw in (BW, fast_disk):
        plan = choose(_inputs(cfg, 1 << 30, process=100 << 20), bw)
        assert plan.chosen.tier(NVME) == 0, plan.explain()
        assert plan.chosen.choice.param != "nvme" and plan.chosen.choice.optimizer != "nvme"
        z = plan.config.zero_optimization
        assert z.offload_param.device in ("none", "cpu") and z.offload_optimizer.device in ("none", "cpu")
    # on a CPU device the host kernel (400 M/s) beats torch's Adam (100 M/s): the optimizer goes
    # to the host tier; with torch faster it stays on the device
    assert choose(_inputs(cfg, 1 << 30), BW).chosen.choice.optimizer == "cpu"
    slow_host = Bandwidths(10e9, 2e9, 1e9, 50e6, 400e6, "", "injected")
    assert choose(_inputs(cfg, 1 << 30), slow_host).chosen.choice.optimizer == "none"


def test_ram_that_holds_it_wins_even_over_a_disk_placement_predicted_faster(monkeypatch):
    """The rule, not only the time model: a budget that holds the optimizer in RAM stepped in
    step() but not the restores of stepping in backward leaves NVMe candidates (stepping in
    backward, part on disk); predicted faster by a patched model, they still lose."""
    cfg = _cfg(stage=2)
    roomy = choose(_inputs(cfg, 1 << 30), BW)
    need = {p.choice.step_in_backward: _host_need(p) for p in roomy.considered
            if p.choice.optimizer == "cpu"}
    assert need[True] > need[False]
    monkeypatch.setattr(planner, "step_time", lambda inputs, placement, layouts, bw:
                        {"model": 0.001 if placement.nvme else 1.0})
    plan = choose(_inputs(cfg, (need[True] + need[False]) // 2), BW)
    faster = [p for p in plan.considered if p.fits and p.tier(NVME) and p.seconds < plan.chosen.seconds]
    assert faster, plan.explain()
    assert plan.chosen.tier(NVME) == 0, plan.explain()
    assert "RAM holds it, so no candidate with bytes on NVMe was taken" in plan.explain()


def test_a_tight_budget_moves_state_to_nvme_and_keeps_in_ram_what_fits():
    cfg = _cfg()
    roomy = choose(_inputs(cfg, 1 << 30, process=50 << 20), BW)
    in_ram = [p for p in roomy.considered if p.fits and not p.tier(NVME)]
    least = min(_host_need(p) for p in in_ram)
    # everything on NVMe, nothing kept in RAM (the planner lists no such candidate when RAM
    # holds more: it would be a slower copy of the 'cpu' one)
    nothing_kept = min(_host_need(planner.predict(_inputs(cfg, 1 << 30, process=50 << 20),
                                                  planner.Choice("nvme", 0, pb, "nvme", 1.0, 0, ob, sib), BW))
                       for pb in (5, 2) for ob in (4, 3) for sib in (True, False))
    assert nothing_kept < least
    budget = (least + nothing_kept) // 2  # below every all-in-RAM placement, above the floor
    plan = choose(_inputs(cfg, budget, process=50 << 20), BW)
    c = plan.chosen
    assert c.fits and c.tier(NVME) > 0 and _host_need(c) <= budget, plan.explain()
    assert not any(p.fits for p in plan.considered if not p.tier(NVME))
    # what RAM can hold stays there: the chosen max_in_cpu leaves less than one unit's worth
    # (or one 64-element step) of the budget unused
    z = plan.config.zero_optimization
    assert (z.offload_optimizer.device, z.offload_param.device) != ("none", "none")
    assert z.offload_optimizer.max_in_cpu == c.choice.opt_max_in_cpu
    assert z.offload_param.max_in_cpu == c.choice.param_max_in_cpu
    # (here: the weights in RAM, the optimizer on NVMe with max_in_cpu elements kept in RAM)
    assert c.choice.opt_max_in_cpu > 0 or c.choice.param_max_in_cpu > 0, plan.explain()
    if c.choice.optimizer == "nvme":
        slack = budget - _host_need(c)
        assert 0 <= slack < 64 * 32, (slack, plan.explain())  # 64 elements of at most 32 B
    # the prediction is the byte rules' figure for the config the plan writes
    from zerokit.engine.planner import _layouts, _placement

    placement = _placement(_inputs(cfg, budget), plan.config)
    assert planned_bytes(plan.config, placement, _layouts(_inputs(cfg, budget), placement),
                         "AdamW") == c.bytes
    # a smaller budget keeps less in RAM and is predicted slower
    tighter = choose(_inputs(cfg, budget - (budget - nothing_kept) // 2, process=50 << 20), BW)
    assert tighter.chosen.tier(NVME) >= c.tier(NVME) and tighter.chosen.seconds >= c.seconds


def test_the_stream_keeps_its_full_read_ahead_unless_only_fewer_buffers_fit():
    """3 stream buffers leave room for more max_in_cpu and so are predicted faster (by less
    than READ_AHEAD_MARGIN), but measured up to 1.3x slower at 1B (one sub-group read ahead
    instead of two): a 4-buffer candidate that fits is taken; 3 only where no 4-buffer one fits
    (or one is predicted clearly faster: below). Small sub-groups make one buffer set cheap."""
    cfg = _cfg(zero={"sub_group_size": 2048})

    def plan(budget):
        return choose(_inputs(cfg, budget, process=50 << 20), BW)

    floor = min(_host_need(planner.predict(_inputs(cfg, 1 << 30, process=50 << 20),
                                           planner.Choice("nvme", 0, pb, "nvme", 1.0, 0, ob, sib), BW))
                for pb in (5, 2) for ob in (4, 3) for sib in (True, False))
    mid = plan(floor + (1 << 20))
    c = mid.chosen
    assert c.choice.optimizer == "nvme" and c.choice.opt_buffer_count == 4, mid.explain()
    predicted_faster = [p for p in mid.considered if p.fits and p.choice.opt_buffer_count == 3
                        and p.seconds < c.seconds]
    assert predicted_faster, mid.explain()  # the rule, not the time model, decided
    assert "full read-ahead (buffer_count 4) fits" in mid.explain()
    tight = plan(floor)  # one buffer set short of any 4-buffer candidate
    assert tight.chosen.choice.opt_buffer_count == 3, tight.explain()
    assert "full read-ahead" not in tight.explain()


@pytest.mark.parametrize("shallow_gain", [1.03, 1.10])
def test_fewer_stream_buffers_win_only_when_predicted_clearly_faster(monkeypatch, shallow_gain):
    """The read-ahead is a preference, not a filter: at 1B with a 4 GiB budget the 4-buffer rule
    put the weights on NVMe (predicted 16.2 s, ran 16.6) over weights in RAM with 3 buffers
    (predicted 15.2 s; by hand 14.6-14.7). A 3-buffer candidate predicted `shallow_gain` times
    faster than every fitting 4-buffer one is taken past READ_AHEAD_MARGIN, not below it."""
    cfg = _cfg(zero={"sub_group_size": 2048})
    original = planner._predict

    def predicted(inputs, cfg, placement, out, bw):
        out = original(inputs, cfg, placement, out, bw)
        if out.choice.opt_buffer_count < planner.OPT_BUFFER_COUNTS[0]:
            out.seconds /= shallow_gain
        return out
    floor = min(_host_need(planner.predict(_inputs(cfg, 1 << 30, process=50 << 20),
                                           planner.Choice("nvme", 0, pb, "nvme", 1.0, 0, ob, sib), BW))
                for pb in (5, 2) for ob in (4, 3) for sib in (True, False))
    monkeypatch.setattr(planner, "_predict", predicted)
    plan = choose(_inputs(cfg, floor + (1 << 20), process=50 << 20), BW)
    pool = [p for p in plan.considered if p.fits and p.tier(NVME)]
    deep = min(p.seconds for p in pool if p.choice.opt_buffer_count == 4)
    shallow = min(p.seconds for p in pool if p.choice.opt_buffer_count == 3)
    assert not [p for p in plan.considered if p.fits and not p.tier(NVME)], plan.explain()
    if shallow * (1 + planner.READ_AHEAD_MARGIN) < deep:
        assert plan.chosen.choice.opt_buffer_count == 3, plan.explain()
        assert "full read-ahead" not in plan.explain()
    else:
        assert plan.chosen.choice.opt_buffer_count == 4, plan.explain()
        assert "full read-ahead (buffer_count 4) fits" in plan.explain()
    assert (plan.chosen.choice.opt_buffer_count == 3) == (shallow_gain == 1.10)  # margin 5%


def test_an_impossible_budget_is_refused_naming_the_smallest_budget_that_works():
    cfg = _cfg()
    inputs = _inputs(cfg, 1 << 20, process=64 << 20)
    with pytest.raises(PlacementBudgetError) as e:
        choose(inputs, BW)
    text = str(e.value)
    # the floor, enumerated here: every placement with nothing kept in RAM by max_in_cpu
    roomy = _inputs(cfg, 1 << 40, process=64 << 20)
    smallest = min(_host_need(planner.predict(roomy, planner.Choice(pd, 0, pb, od, 1.0, 0, ob, sib), BW))
                   for pd in ("none", "cpu", "nvme") for od in ("none", "cpu", "nvme")
                   for pb in (5, 2) for ob in (4, 3) for sib in (True, False)
                   if not (od == "none" and sib))
    assert f"The smallest budget that would work: memory.host {mib(smallest)}" in text, text
    for part in ("process (RSS at initialize less the model)", "master", "optimizer_state",
                 "host:", "nvme:", "over 1.00 MiB (memory.host)"):
        assert part in text, text
    # the figure is right: it works, and a byte less does not
    choose(_inputs(cfg, smallest, process=64 << 20), BW)
    with pytest.raises(PlacementBudgetError):
        choose(_inputs(cfg, smallest - 1, process=64 << 20), BW)


def test_device_budget_on_a_gpu_offloads_and_weighs_twin_flow():
    cfg = _cfg(stage=2, nvme=None)
    model_bytes = sum(p.numel() for p in tiny_gpt(cfg=MODEL).parameters()) * 4
    plan = choose(_inputs(cfg, 1 << 30, device=model_bytes * 3, cuda=True), BW)
    ratios = {p.choice.ratio for p in plan.considered if p.choice.optimizer == "cpu"}
    assert ratios == {1.0, 0.8}, ratios  # 400 / (400 + 100): host and device finish together
    assert plan.chosen.checks["device"][0] <= model_bytes * 3
    assert plan.chosen.choice.optimizer == "cpu"
    # device memory for everything: nothing leaves the device (the device Adam 4x the host's)
    fast_device = Bandwidths(10e9, None, None, 100e6, 400e6, "", "injected")
    assert choose(_inputs(cfg, 1 << 30, device=1 << 30, cuda=True), fast_device).chosen.choice.optimizer == "none"


def test_hand_set_keys_stay_and_only_free_keys_are_searched():
    cfg = _cfg(zero={"offload_optimizer": {"device": "nvme", "max_in_cpu": 6400, "buffer_count": 5},
                     "offload_param": {"device": "cpu"}})
    plan = choose(_inputs(cfg, 1 << 30), BW)
    assert {(p.choice.optimizer, p.choice.param, p.choice.opt_max_in_cpu, p.choice.opt_buffer_count)
            for p in plan.considered} == {("nvme", "cpu", 6400, 5)}
    assert {p.choice.step_in_backward for p in plan.considered} == {True, False}  # "auto": free
    z = plan.config.zero_optimization
    assert z.offload_optimizer.max_in_cpu == 6400 and z.offload_optimizer.buffer_count == 5
    # a device 'nvme' given without max_in_cpu: the planner fills it (the budget allows all in RAM
    # but the device is the user's: kept)
    cfg = _cfg(zero={"offload_optimizer": {"device": "nvme"}})
    assert planner.asked(cfg, {HOST: (1, "memory.host")})
    plan = choose(_inputs(cfg, 1 << 30), BW)
    assert plan.chosen.choice.optimizer == "nvme" and plan.chosen.choice.opt_max_in_cpu > 0
    # everything hand-set: nothing to plan
    cfg = _cfg(zero={"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "none"}})
    assert not planner.asked(cfg, {HOST: (1 << 30, "memory.host")})
    assert not planner.asked(_cfg(), {})


def test_auto_without_a_budget_is_refused_naming_the_keys():
    cfg = _cfg(zero={"offload_optimizer": {"device": "auto"}})
    with pytest.raises(ValueError, match=r"zero_optimization\.offload_optimizer\.device 'auto'.*memory\.host"):
        planner.asked(cfg, {})
    from zerokit.memory import estimate

    with pytest.raises(ValueError, match="offload_optimizer.device 'auto' is chosen by the placement planner"):
        estimate("demo", config={"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "auto"}}},
                 activations=False)


@pytest.mark.parametrize("world, cuda, gathers", [(1, False, False), (1, True, True), (2, False, True)])
def test_step_time_is_the_stated_model(world, cuda, gathers):
    """Weights on the host, optimizer on the host, one micro-step: host Adam over every element,
    the shards copied in two gathers (none where one rank's host shard is the CPU's weights),
    each element's gradient in; no copy of the weights out, which the host kernel writes into
    the host shard in place; no disk."""
    cfg = _cfg(zero={"offload_optimizer": {"device": "cpu", "step_in_backward": False, "ratio": 1.0},
                     "offload_param": {"device": "cpu"}})
    inputs = _inputs(cfg, 1 << 30, world=world, cuda=cuda, device=(1 << 30) if cuda else None)
    plan = choose(inputs, BW)
    (p,) = plan.considered
    n = sum(lay.shard_numel for lay in planner._layouts(inputs, planner._placement(inputs, plan.config)))
    assert p.time_parts["device Adam"] == 0
    assert p.time_parts["host Adam"] == pytest.approx(n / 400e6)
    assert p.time_parts["host copies"] == pytest.approx((2 * 4 * n * gathers + 4 * n) / 10e9)
    assert not any(k.startswith("disk") for k in p.time_parts)
    assert p.seconds == pytest.approx(sum(p.time_parts.values()))
    assert "chosen:" in plan.explain() and "placements considered" in plan.explain()


def test_bandwidths_are_measured_once_per_machine_and_path_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROKIT_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def probe(path, device):
        calls.append(path)
        return Bandwidths(1e9, 2e9, 3e9, 4e6, 5e6, "2026-01-01 00:00 UTC", "measured")

    monkeypatch.setattr(bandwidths, "PROBE", probe)
    a = bandwidths.rates(str(tmp_path), torch.device("cpu"))
    b = bandwidths.rates(str(tmp_path), torch.device("cpu"))
    assert calls == [str(tmp_path)] and a.source == "measured" and b.source.startswith("cached in")
    assert (b.host_copy, b.disk_read, b.disk_write, b.measured_at) == (1e9, 2e9, 3e9, "2026-01-01 00:00 UTC")
    bandwidths.rates(None, torch.device("cpu"))  # another path: measured again
    assert calls == [str(tmp_path), None]
    entries = json.loads((tmp_path / "cache" / "bandwidths.json").read_text())
    assert len(entries) == 2 and all("measured_at" in e for e in entries.values())
    # the real probe on this disk gives positive rates, both directions at once too
    read, write, mixed = bandwidths.disk_rates(str(tmp_path), 8 << 20)
    assert read > 0 and write > 0 and mixed > 0
    assert not list(tmp_path.glob(".zerokit-bandwidth-probe-*"))
    with pytest.raises(ValueError, match="bandwidth host_copy must be a positive number"):
        Bandwidths(0, None, None, 1, 1)
    # a cache entry from before the mixed rate is measured again, and then has it
    cached = json.loads((tmp_path / "cache" / "bandwidths.json").read_text())
    for entry in cached.values():
        entry.pop("disk_mixed")
    (tmp_path / "cache" / "bandwidths.json").write_text(json.dumps(cached))
    monkeypatch.setattr(bandwidths, "PROBE", lambda path, device: probe(path, device).__class__(
        1e9, 2e9, 3e9, 4e6, 5e6, "", "measured", 4e9))
    assert bandwidths.rates(str(tmp_path), torch.device("cpu")).disk_mixed == 4e9
    assert bandwidths.rates(str(tmp_path), torch.device("cpu")).source.startswith("cached in")


def test_the_disk_probe_times_rewrites_through_the_io_engine(tmp_path, monkeypatch):
    """[Note: measured bandwidths]: the engine rewrites its files in place with many requests in
    flight, so the probe lays both files down untimed, then times requests submitted together
    into files that already hold their bytes (a first write allocates, several times slower
    here), and fsyncs what it wrote before the clock stops."""
    from zerokit.io import aio as aio_mod

    nbytes, request = 8 << 20, 1 << 20
    monkeypatch.setattr(bandwidths, "DISK_REQUEST_BYTES", request)
    submitted, fsyncs = [], []

    class Recording(aio_mod.AsyncIO):
        def write(self, path, tensor, offset=0, **kw):
            size = os.path.getsize(path) if os.path.exists(path) else 0
            submitted.append(("write", os.path.basename(path), offset, tensor.numel(), size))
            return super().write(path, tensor, offset, **kw)

        def read(self, path, tensor, offset=0, **kw):
            submitted.append(("read", os.path.basename(path), offset, tensor.numel(),
                              os.path.getsize(path)))
            return super().read(path, tensor, offset, **kw)

    real_fsync = os.fsync
    monkeypatch.setattr(aio_mod, "AsyncIO", Recording)
    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), real_fsync(fd))[1])
    read, write, mixed = bandwidths.disk_rates(str(tmp_path), nbytes, trials=2)
    assert read > 0 and write > 0 and mixed > 0
    laid, timed = submitted[:2], submitted[2:]
    assert [(k, o, n, size) for k, _, o, n, size in laid] == [("write", 0, nbytes, 0)] * 2
    # read alone, write alone, both: 2 trials each, every request a whole DISK_REQUEST_BYTES
    per = nbytes // request
    assert len(timed) == 2 * per + 2 * per + 2 * 2 * per
    assert all(n == request and size == nbytes for _, _, _, n, size in timed)
    assert {name for k, name, *_ in timed if k == "write"} != {name for k, name, *_ in timed
                                                                if k == "read"}
    assert len(fsyncs) == 2 + 2 * 2  # the two laid down, and each timed write (alone, both)
    assert not list(tmp_path.glob(".zerokit-bandwidth-probe-*"))


def test_figures_of_an_older_probe_are_measured_again(tmp_path, monkeypatch):
    """The cache's key carries the probe's version: figures the one-request-at-a-time probe
    cached (a key without it) are not read."""
    monkeypatch.setenv("ZEROKIT_CACHE_DIR", str(tmp_path))
    key = bandwidths._key(None, torch.device("cpu"))
    assert key.endswith(f"|probe {bandwidths.PROBE_VERSION}")
    stale = Bandwidths(1e9, 0.9e9, 1.2e9, 4e6, 5e6, "2026-11-29 08:50 UTC", "measured", 0.69e9)
    old_key = key.rsplit("|probe", 1)[0]
    (tmp_path / "bandwidths.json").write_text(json.dumps(
        {old_key: {k: v for k, v in dataclasses.asdict(stale).items() if k != "source"}}))
    monkeypatch.setattr(bandwidths, "PROBE", lambda path, device: Bandwidths(
        1e9, 2.3e9, 3.7e9, 4e6, 5e6, "now", "measured", 2.9e9))
    found = bandwidths.rates(None, torch.device("cpu"))
    assert (found.source, found.disk_mixed) == ("measured", 2.9e9)


def test_reads_and_writes_at_once_move_at_the_mixed_rate():
    """Bandwidths.disk_seconds: the stream and the gradient files read and write together through
    the I/O engine: both at the measured mixed rate; without it, one after the other."""
    serial = Bandwidths(1e9, 2e9, 1e9, 4e6, 5e6)
    assert serial.disk_seconds(4e9, 4e9) == pytest.approx(2 + 4)
    duplex = Bandwidths(1e9, 2e9, 1e9, 4e6, 5e6, disk_mixed=2.5e9)
    assert duplex.disk_seconds(4e9, 4e9) == pytest.approx(8 / 2.5)
    assert duplex.disk_seconds(3e9, 0) == pytest.approx(3 / 2.5)
    assert duplex.disk_seconds(0, 0) == serial.disk_seconds(0, 0) == 0
    assert Bandwidths.from_list(duplex.as_list(), "", "x").disk_mixed == 2.5e9
    assert Bandwidths.from_list(serial.as_list(), "", "x").disk_mixed is None
    assert "both at once 2.50 GB/s" in duplex.describe()


def test_initialize_fills_auto_devices_from_the_plan(tmp_path, monkeypatch):
    """offload_*.device "auto" through zerokit.initialize: the engine runs the chosen placement,
    the resolved keys are in its config, the bandwidths were probed once and cached."""
    import psutil

    import zerokit

    monkeypatch.setenv("ZEROKIT_CACHE_DIR", str(tmp_path / "cache"))
    probes = []
    monkeypatch.setattr(bandwidths, "PROBE", lambda path, device: probes.append(path) or BW)
    torch.set_num_threads(1)
    budget = psutil.Process().memory_info().rss + (512 << 20)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "memory": {"host": budget, "rss_margin": "256MiB"},
           "zero_optimization": {"stage": 3,
                                 "offload_optimizer": {"device": "auto", "nvme_path": str(tmp_path)},
                                 "offload_param": {"device": "auto", "nvme_path": str(tmp_path)}}}
    engine, *_ = zerokit.initialize(model=tiny_gpt(), config=cfg)
    try:
        # BW: the host kernel (400 M/s) beats torch's Adam (100 M/s) on this CPU, RAM holds it
        assert engine.placement.offloads and not engine.placement.nvme
        assert not engine.placement.params_on_nvme
        zero = engine.config.zero_optimization  # the typed config the engine runs
        assert zero.offload_optimizer.device == "cpu" and zero.offload_param.device in ("none", "cpu")
        shown = engine.config["zero_optimization"]  # the DeepSpeed dict (the HF Trainer reads it)
        assert shown["offload_optimizer"]["device"] == "cpu" and shown["offload_param"]["device"] != "auto"
        assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "auto"  # the user's, untouched
        x = torch.randint(0, 256, (2, 16))
        engine.backward(engine(x, x))
        engine.step()
        assert engine.ledger.bytes(tier="nvme", peak=True) == 0
        assert engine.ledger.bytes(tier="host", peak=True) <= budget
        assert probes == [str(tmp_path)]
    finally:
        engine.destroy()


@pytest.mark.parametrize("model_cfg,window_bound", [
    (MODEL, False),
    (GPTConfig(vocab_size=4096, block_size=16, n_layer=4, n_head=4, n_embd=1024, bias=False), True)])
def test_the_plan_counts_the_gradient_writes_only_where_a_part_has_a_gradient_file(model_cfg,
                                                                                   window_bound):
    """The gradient pieces on their way to NVMe files hold host buffers (the tier's write window
    and the chunk being filled, or every gradient byte where fewer): counted in the host need
    where some nvme part has a gradient file, and nowhere else (stepped in backward the
    gradient is held in memory, counted as grads; a host part has none)."""
    from zerokit.engine import byte_plan
    from zerokit.engine.planner import _layouts, _placement, _resolved
    from zerokit.parts.nvme import GRAD_CHUNK_BYTES
    from zerokit.tiers.nvme import WRITES_IN_FLIGHT_BYTES

    cfg = _cfg()
    inputs = _inputs(cfg, 1 << 30, model=tiny_gpt(cfg=model_cfg))

    def figures(choice):
        c = _resolved(cfg, choice, "/swap")
        placement = _placement(inputs, c)
        layouts = _layouts(inputs, placement)
        return (byte_plan.gradient_write_bytes(layouts),
                byte_plan.planned_host_need(c, placement, layouts, "AdamW").buffers, layouts)

    files, buffers, layouts = figures(planner.Choice("nvme", 0, 5, "nvme", 1.0, 0, 4, False))
    every = sum(-(-lay.record("nvme_grad0").nbytes // 4096) * 4096 for lay in layouts)
    assert files == min(WRITES_IN_FLIGHT_BYTES + GRAD_CHUNK_BYTES, every) > 0
    assert (files < every) == window_bound
    for choice in (planner.Choice("nvme", 0, 5, "nvme", 1.0, 0, 4, True),  # held, no file
                   planner.Choice("nvme", 0, 5, "cpu", 1.0, 0, 4, False)):  # a host part
        assert figures(choice)[0] == 0
    # and the host need holds it: the same layouts without it need exactly that much less
    original = byte_plan.gradient_write_bytes
    try:
        byte_plan.gradient_write_bytes = lambda layouts: 0
        _, without, _ = figures(planner.Choice("nvme", 0, 5, "nvme", 1.0, 0, 4, False))
    finally:
        byte_plan.gradient_write_bytes = original
    assert buffers - without == files


@pytest.mark.parametrize("accumulation", [1, 3])
def test_the_gradient_window_holds_the_largest_file_and_accumulation_reads_as_much_ahead(accumulation):
    """byte_plan.gradient_file_io: the tier's write window holds the largest part's gradient
    file (a unit's pieces write while backward computes the next), at least
    WRITES_IN_FLIGHT_BYTES; with accumulation as many bytes are read ahead ([Note: gradient
    read-ahead]); the host need counts both."""
    import dataclasses

    from zerokit.engine import byte_plan
    from zerokit.engine.planner import _layouts, _placement, _resolved
    from zerokit.parts.nvme import GRAD_CHUNK_BYTES
    from zerokit.tiers.nvme import WRITES_IN_FLIGHT_BYTES

    cfg = _cfg()
    big = GPTConfig(vocab_size=24000, block_size=16, n_layer=1, n_head=4, n_embd=1024, bias=False)
    inputs = dataclasses.replace(_inputs(cfg, 1 << 34, model=tiny_gpt(cfg=big)), accumulation=accumulation)
    c = _resolved(cfg, planner.Choice("none", 0, 5, "nvme", 1.0, 0, 4, False), "/swap")
    placement = _placement(inputs, c)
    layouts = _layouts(inputs, placement)
    largest = max(lay.record("nvme_grad0").nbytes for lay in layouts if lay.has("nvme_grad0"))
    assert largest > WRITES_IN_FLIGHT_BYTES  # the embedding's 24000 x 1024 fp32 gradient
    io = byte_plan.gradient_file_io(layouts)
    assert io.write_window == -(-largest // GRAD_CHUNK_BYTES) * GRAD_CHUNK_BYTES
    assert io.read_ahead == (io.write_window if accumulation > 1 else 0)
    every = sum(-(-lay.record("nvme_grad0").nbytes // 4096) * 4096 for lay in layouts)
    assert byte_plan.gradient_write_bytes(layouts) == (
        min(io.write_window + GRAD_CHUNK_BYTES, every) + min(io.read_ahead, every))


def test_accumulation_holds_the_nvme_gradients_in_ram_where_the_budget_allows():
    """offload_optimizer.nvme_gradients: in files, every micro-step after the first reads, adds
    and writes the gradient files again (the time model counts (m - 1) x their bytes each way);
    held in RAM they cost the master's bytes per NVMe element there and no file. At
    accumulation 4 a budget that holds them takes them, and the config says so."""
    import dataclasses

    cfg = _cfg(zero={"offload_param": {"device": "cpu"},
                     "offload_optimizer": {"device": "nvme", "step_in_backward": False}})

    def inputs(budget, m):
        return dataclasses.replace(_inputs(cfg, budget, process=50 << 20), accumulation=m)

    def predict(m, held):
        return planner.predict(inputs(1 << 30, m), planner.Choice("cpu", 0, 5, "nvme", 1.0, 0, 4, False,
                                                                   held), BW)

    files, held = predict(4, False), predict(4, True)
    grads = files.bytes[NVME]["grads"]
    assert grads > 0 and held.bytes[NVME]["grads"] == 0
    # 4 B per NVMe element, in RAM instead (and no buffers carrying them to and from files)
    assert held.bytes[HOST]["grads"] - files.bytes[HOST]["grads"] == grads
    once = predict(1, False)
    refill = "disk: gradient files in backward"
    assert once.time_parts[refill] == held.time_parts[refill] == 0
    assert files.time_parts[refill] == pytest.approx(3 * grads / BW.disk_read + 3 * grads / BW.disk_write)
    stream = "disk: the step's stream"
    assert files.time_parts[stream] == pytest.approx(once.time_parts[stream])
    assert held.time_parts[stream] == pytest.approx(predict(1, True).time_parts[stream])
    assert held.seconds < files.seconds
    plan = choose(inputs(_host_need(held) + (1 << 20), 4), BW)
    assert plan.chosen.choice.nvme_grads_held, plan.explain()
    assert plan.config.zero_optimization.offload_optimizer.nvme_gradients == "host"
    assert "gradients in RAM" in plan.explain()
    # set by hand, the key is kept
    by_hand = _cfg(zero={"offload_param": {"device": "cpu"},
                         "offload_optimizer": {"device": "nvme", "step_in_backward": False,
                                               "nvme_gradients": "file"}})
    kept = choose(dataclasses.replace(_inputs(by_hand, _host_need(files) + (1 << 20), process=50 << 20),
                                      accumulation=4), BW)
    assert not kept.chosen.choice.nvme_grads_held
    assert not any(p.choice.nvme_grads_held for p in kept.considered)


def test_a_budget_between_files_and_every_gradient_held_holds_the_first_parts():
    """Where RAM holds some of the NVMe parts' gradients but not all, the planner holds the
    first whole parts' (nvme_gradients_max_in_cpu) rather than none: at accumulation 4 each held
    byte saves more file traffic than max_in_cpu's. Its bytes and disk time lie between the two
    ends, and the config carries the key."""
    import dataclasses

    cfg = _cfg(zero={"offload_param": {"device": "cpu"},
                     "offload_optimizer": {"device": "nvme", "step_in_backward": False}})

    # gradients well beyond the file machinery's own buffers (its write window, read-ahead)
    # and the stream's buffer sets, which grow with a unit, not with the model: 48 blocks of
    # 3M elements, on the meta device (the planner reads sizes only)
    with torch.device("meta"):
        model = tiny_gpt(cfg=GPTConfig(vocab_size=256, block_size=16, n_layer=48, n_head=4,
                                       n_embd=512, bias=False))

    def inputs(budget):
        return dataclasses.replace(_inputs(cfg, budget, process=50 << 20, model=model),
                                   accumulation=4)

    def predict(held, gmax=None):
        return planner.predict(inputs(1 << 30), planner.Choice("cpu", 0, 5, "nvme", 1.0, 0, 4,
                                                                False, held, gmax), BW)

    files, every = predict(False), predict(True)
    assert _host_need(files) < _host_need(every)
    budget = (_host_need(files) + _host_need(every)) // 2
    plan = choose(inputs(budget), BW)
    chosen = plan.chosen.choice
    assert chosen.nvme_grads_held and chosen.grad_max_in_cpu, plan.explain()
    off = plan.config.zero_optimization.offload_optimizer
    assert (off.nvme_gradients, off.nvme_gradients_max_in_cpu) == ("host", chosen.grad_max_in_cpu)
    assert not off.step_in_backward
    assert "the rest in files" in plan.explain()
    assert _host_need(plan.chosen) <= budget
    part = predict(True, chosen.grad_max_in_cpu)
    assert 0 < part.bytes[NVME]["grads"] < files.bytes[NVME]["grads"]
    refill = "disk: gradient files in backward"
    assert every.time_parts[refill] == 0 < part.time_parts[refill] < files.time_parts[refill]
    # the points tried: whole parts only, none beyond what fits
    tried = {p.choice.grad_max_in_cpu for p in plan.considered if p.choice.nvme_grads_held}
    assert len(tried) > 1 and all(p.fits for p in plan.considered
                                  if p.choice.nvme_grads_held and p.choice.opt_max_in_cpu == 0
                                  and p.choice.grad_max_in_cpu in tried)


@pytest.mark.parametrize("param, world, gathers", [("cpu", 1, False), ("nvme", 1, True), ("cpu", 2, True)])
def test_a_placement_that_gathers_nothing_holds_no_gathered_peak(param, world, gathers):
    """Of the transients, the gathered peak is held only where some unit gathers: not by one
    rank whose host shards are its weights on this CPU; by one whose shards are files, or by two."""
    cfg = _cfg(zero={"offload_optimizer": {"device": "cpu", "step_in_backward": False},
                     "offload_param": {"device": param}})
    plan = choose(_inputs(cfg, 1 << 30, world=world, transients=7 << 20, gathered=5 << 20), BW)
    # every shard in RAM, or (nvme) every shard a file
    seen = [p for p in plan.considered if not p.invalid and p.choice.param_max_in_cpu == 0]
    assert seen
    for p in seen:
        held = p.checks["host"][3]["device transients (gathered weights, reductions)"]
        assert held == (7 << 20 if gathers else 2 << 20), p.choice


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_cpu_device_weights_in_place_on_the_host_win_over_a_copy_on_the_device_tier(dtype):
    """On a CPU device, weights on the device tier with the optimizer on the host tier take a
    16-bit output buffer beside them in the same RAM and a copy after each step; with the
    weights on the host tier the host kernel writes them in place. The two were priced the same
    and tied, and the tie went to candidate order (bench_infinity 125M: 256 MiB more RSS for
    the same step, 2.87 vs 2.62 GiB; benchmarks/results/bench_infinity-125m-tie-ab-20261208.json)."""
    cfg = _cfg()
    plan = choose(_inputs(cfg, 1 << 30, dtype=dtype), BW)
    chosen = plan.chosen
    assert (chosen.choice.param, chosen.choice.optimizer) == ("cpu", "cpu"), plan.explain()
    twin = next(p for p in plan.considered if p.fits and p.choice.optimizer == "cpu"
                and p.choice.param == "none" and p.choice.step_in_backward == chosen.choice.step_in_backward)
    assert _host_need(twin) > _host_need(chosen)  # its weights are RAM on a CPU device
    # and the copy of its new weights to them, which the in-place kernel does not make
    assert twin.time_parts["host copies"] > chosen.time_parts["host copies"], plan.explain()


def test_a_tie_in_time_goes_to_less_ram_counting_a_cpu_devices_tier():
    """_tie_key's third term is the host check's need (on a CPU device it holds the device
    tier's bytes too), not the host tier's bytes alone."""
    def pred(param: str, host_tier: int, ram: int) -> planner.Prediction:
        return planner.Prediction(planner.Choice(param=param, optimizer="cpu"),
                                  bytes={HOST: {"master": host_tier}}, seconds=1.0,
                                  checks={"host": (ram, 1 << 40, "memory.host", {})})
    on_device = pred("none", host_tier=100, ram=300)  # fewer host-tier bytes, more RAM
    on_host = pred("cpu", host_tier=200, ram=200)
    assert min([on_device, on_host], key=planner._tie_key) is on_host
    assert min([on_host, on_device], key=planner._tie_key) is on_host
