"""Issue 25 (points 1-6, 10): the same tiny DeepSpeed scripts through the real DeepSpeed 0.19.8
(DS_ACCELERATOR=cpu) and through zerokit's `import deepspeed`, comparing what each reads or
computes. Each script batches several probes so that each implementation starts once.

Where DeepSpeed cannot run a case on the CPU (fp16: "Type fp16 is not supported on your
device"), the DeepSpeed side runs DeepSpeed's own loss scaler class on the same overflow
sequence, and zerokit's engine is held to that and to the weights it left (a skipped step
changes none).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from _fidelity_runner import REPO, real_deepspeed_or_skip, run

# World 2, stage 1, a client-free config without gradient_clipping: DeepSpeed's defaults apply.
TRAINING = r'''
import random
import numpy as np

def make(extra=None, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
           "optimizer": {"type": "SGD", "params": {"lr": 0.05}}, "zero_optimization": {"stage": 1},
           "zero_allow_untested_optimizer": True, **(extra or {})}
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

out = {}
x = torch.ones(2, 4) * (rank + 1)
engine, opt, _, _ = make()
w0 = engine.module.weight.detach().clone()
# Accelerate's loop: the caller sets the boundary before each backward, step() at the boundary.
for s in range(2):
    for m in range(4):
        engine.set_gradient_accumulation_boundary(m == 3)
        loss = (engine(x) * 100).sum()
        returned = engine.backward(loss)
        if s == 0 and m == 0:
            out["backward_returns"] = float(returned) / float(loss)
    engine.step()
    out.setdefault("applied", []).append(engine.was_step_applied())
out["clip"] = engine.gradient_clipping()
out["weights"] = engine.module.weight.detach().flatten().tolist()
out["global_samples"] = engine.global_samples
out["global_steps"] = engine.global_steps
engine.save_checkpoint(os.path.join(workdir, "ckpt"), client_state={"mine": 5})

# Resume in a fresh engine after seeding: the process's RNG streams stay the caller's.
e2, *_ = make()
torch.manual_seed(123); np.random.seed(123); random.seed(123)
path, client = e2.load_checkpoint(os.path.join(workdir, "ckpt"))
out["rng"] = [float(torch.rand(1)), float(np.random.rand()), random.random()]
out["load_path_dir"] = os.path.relpath(os.path.dirname(path), workdir)
out["load_path_is_file"] = os.path.isfile(path)
out["client_keys"] = sorted(client)
out["client"] = {k: client.get(k) for k in ("mine", "global_samples")}
out["param_shapes"] = [{k: list(v) for k, v in g.items()} for g in client.get("param_shapes", [])]
out["after_load"] = [e2.micro_steps, e2.global_steps, e2.global_samples]

# A step whose gradient is not finite (bf16): skipped, and reported as skipped.
e3, o3, _, _ = make({"bf16": {"enabled": True}, "gradient_accumulation_steps": 1})
rows = []
for s in range(3):
    xx = x * float("inf") if s == 1 else x
    e3.backward(e3(xx.to(torch.bfloat16)).float().sum())
    e3.step()
    rows.append([e3.was_step_applied(), bool(o3.overflow), e3.global_steps, e3.skipped_steps])
out["bf16_skip"] = rows
emit(out)
'''

# fp16's loss scale at its minimum. DeepSpeed's CPU accelerator has no fp16: its side drives
# DeepSpeed's DynamicLossScaler (what its ZeRO optimizers call) through the same overflows.
LOSS_SCALE = r'''
out = {}
if "zerokit" not in deepspeed.__version__:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    deepspeed.init_distributed()  # the scaler logs through deepspeed.comm
    scaler = DynamicLossScaler(init_scale=4, scale_window=1000, min_scale=1, delayed_shift=1,
                               consecutive_hysteresis=False)
    scales = [scaler.cur_scale]
    try:
        for _ in range(5):
            scaler.update_scale(True)
            scales.append(scaler.cur_scale)
        out["error"] = None
    except Exception as e:
        out["error"] = [type(e).__name__, str(e)]
    out["scales"] = scales
else:
    def make(fp16):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.05}},
               "zero_optimization": {"stage": 1}, "fp16": {"enabled": True, **fp16}}
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def overflow(engine):
        engine.backward(engine(torch.full((2, 4), float("inf"), dtype=torch.half)).float().sum())
        engine.step()

    engine, opt, _, _ = make({"initial_scale_power": 2, "hysteresis": 1, "min_loss_scale": 1})
    scales = [opt.cur_scale]
    try:
        for _ in range(5):
            overflow(engine)
            scales.append(opt.cur_scale)
        out["error"] = None
    except Exception as e:
        out["error"] = [type(e).__name__, str(e)]
    out["scales"] = scales
    # raise_error_at_min_scale false (zerokit's key): skipped, every time, never raises.
    engine, opt, _, _ = make({"initial_scale_power": 0, "hysteresis": 1, "min_loss_scale": 1,
                              "raise_error_at_min_scale": False})
    for _ in range(3):
        overflow(engine)
    out["no_raise"] = [engine.skipped_steps, opt.cur_scale]
    # A static loss scale: the overflowing step is skipped, and says so.
    engine, opt, _, _ = make({"loss_scale": 128})
    before = engine.module.weight.detach().clone()
    overflow(engine)
    out["static"] = [engine.was_step_applied(), bool(opt.overflow),
                     bool(torch.equal(before, engine.module.weight.detach()))]
emit(out)
'''


@pytest.fixture(scope="module")
def training(tmp_path_factory) -> dict:
    real_deepspeed_or_skip()
    tmp = tmp_path_factory.mktemp("fidelity")
    return {impl: run(TRAINING, impl, tmp / impl, world=2, join_group=True) for impl in ("deepspeed", "zerokit")}


def _both(training: dict, key: str) -> tuple:
    ds, zk = training["deepspeed"], training["zerokit"]
    assert [r[key] for r in ds] == [r[key] for r in ds[:1]] * len(ds)  # every rank alike
    return ds[0][key], zk[0][key], [r[key] for r in zk]


def test_gradient_clipping_defaults_to_deepspeeds_one(training) -> None:
    """Point 1: a config without gradient_clipping clips at 1.0 under DeepSpeed's API; the
    gradient norm here is ~1e3, so unclipped SGD would move each weight ~10, clipped ~0.05."""
    ds, zk, _ = _both(training, "clip")
    assert ds == zk == 1.0
    ds_w, zk_w, _ = _both(training, "weights")
    assert zk_w == pytest.approx(ds_w, rel=1e-5, abs=1e-6)


def test_global_samples_when_the_caller_owns_the_boundary(training) -> None:
    """Point 5: 2 steps of GAS 4 x micro-batch 2 x world 2 are 32 samples, saved and loaded."""
    ds, zk, _ = _both(training, "global_samples")
    assert ds == zk == 32
    assert _both(training, "global_steps")[:2] == (2, 2)
    assert _both(training, "applied")[:2] == ([True, True], [True, True])


def test_load_checkpoint_leaves_the_processes_rng_alone(training) -> None:
    """Point 6: after seeding, a resume draws from the caller's streams (DeepSpeed's default)."""
    ds, zk, zk_ranks = _both(training, "rng")
    assert zk == ds and all(r == ds for r in zk_ranks)


def test_backward_returns_the_loss_over_gas(training) -> None:
    """Point 10: engine.backward(loss) returns loss / gradient_accumulation_steps."""
    ds, zk, _ = _both(training, "backward_returns")
    assert ds == pytest.approx(0.25) and zk == pytest.approx(ds)


def test_load_checkpoint_result_as_deepspeeds(training) -> None:
    """Point 10: the first value is a file in the tag directory; the client state holds the
    caller's keys and DeepSpeed's; micro_steps after the load is 0, the counters are restored."""
    for key in ("load_path_dir", "load_path_is_file", "client_keys", "client", "param_shapes",
                "after_load"):
        ds, zk, zk_ranks = _both(training, key)
        assert zk == ds, key
        assert all(r == ds for r in zk_ranks), key
    assert _both(training, "after_load")[0] == [0, 2, 32]


def test_a_skipped_step_is_reported_as_skipped(training) -> None:
    """Point 4 (bf16, a non-finite gradient): was_step_applied() False and optimizer.overflow
    True after the skipped step, True / False after the next applied one, as DeepSpeed."""
    ds, zk, _ = _both(training, "bf16_skip")
    assert ds == zk == [[True, False, 1, 0], [False, True, 2, 1], [True, False, 3, 1]]


def test_fp16_at_min_loss_scale_raises_as_deepspeed(tmp_path) -> None:
    """Point 3: the overflow that would lower the scale below min_loss_scale raises DeepSpeed's
    error (its DynamicLossScaler on the same overflows); point 4 with a static loss scale."""
    real_deepspeed_or_skip()
    (ds,) = run(LOSS_SCALE, "deepspeed", tmp_path / "deepspeed", join_group=True)
    (zk,) = run(LOSS_SCALE, "zerokit", tmp_path / "zerokit", join_group=True)
    assert ds["error"][1].startswith("Current loss scale already at minimum - cannot decrease scale")
    assert zk["error"][1] == ds["error"][1]
    assert zk["scales"] == ds["scales"] == [4, 2, 1]
    assert zk["no_raise"] == [3, 1]
    assert zk["static"] == [False, True, True]


NVME_EXIT = r'''
os.makedirs(os.path.join(workdir, "nvme"), exist_ok=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
       "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
       "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
                                                               "nvme_path": os.path.join(workdir, "nvme")}}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
engine.backward(engine(torch.ones(2, 8)).sum())
engine.step()
files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(workdir, "nvme")) for f in fs]
emit({"files_while_alive": len(files)})
# no engine.destroy(): a script that just ends
'''


def test_nvme_swap_files_are_removed_at_a_normal_exit(tmp_path) -> None:
    """Point 10: the docs say the swap files go when the engine closes; a script that never
    calls destroy() exits normally and leaves none (zerokit's own promise: DeepSpeed's NVMe
    swapper needs its aio op, which this CPU environment does not build)."""
    (zk,) = run(NVME_EXIT, "zerokit", tmp_path / "zerokit", join_group=True)
    assert zk["files_while_alive"] > 0
    nvme = os.path.join(str(tmp_path), "zerokit", "nvme")
    left = [os.path.join(d, f) for d, dirs, fs in os.walk(nvme) for f in fs + dirs]
    assert not left, left


def test_benchmarks_run_from_a_clean_clone(tmp_path) -> None:
    """Point 12: without benchmarks/results (a fresh clone has none), bench_infinity (its swap
    folder is made inside it) runs through to its JSON; no row is run (--rows ''), so it takes
    seconds. Every other benchmark writes through _common.results_dir / write_json, which
    create it."""
    import shutil

    clone = tmp_path / "clone"
    shutil.copytree(os.path.join(REPO, "benchmarks"), clone / "benchmarks",
                    ignore=shutil.ignore_patterns("results", "__pycache__"))
    out = subprocess.run([sys.executable, "benchmarks/bench_infinity.py", "--models", "125m",
                          "--rows", ""], cwd=clone, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.path.join(REPO, "src")})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert (clone / "benchmarks" / "results" / "bench_infinity-latest.json").is_file()
    for name in os.listdir(os.path.join(REPO, "benchmarks")):
        if name.endswith(".py") and name != "_common.py":
            with open(os.path.join(REPO, "benchmarks", name)) as f:
                assert "RESULTS_DIR" not in f.read(), f"{name}: use _common.results_dir()"
