"""bf16 master weights and optimizer states on every tier (issue #27 point 1): nvme parts
(offload_optimizer device 'nvme': bf16 files, streamed through the host kernel), the device part
(no offload, Twin-Flow's ratio < 1: the host kernel's math in torch) and host parts.

- tiers: the same config placed on host parts, nvme parts, Twin-Flow 0.4 (host + device part),
  Twin-Flow 0.4 over nvme, and no offload gives, after every step, every element's master and
  optimizer state and the step counts bit-equal to the host parts' (stochastic rounding too), at
  stages 1-3, world 1 and 2; with the delayed update and a host budget (max_in_cpu) too;
- an independent reference: a plain-torch loop over the bf16 parameters stepping each with
  fallback_bf16's math (no engine, no units) gives the engine's weights bit for bit;
- stepping in backward (the speculative step) with bf16 nvme parts and Twin-Flow equals stepping in
  step(), committed, redone (clipping) and skipped (a non-finite gradient), with an SGD-like,
  scale-sensitive update (Adam with betas 0 and eps far above |g|);
- the files on disk (measured, not recomputed) and a step's I/O report are half the fp32 run's:
  master, gradient, state and the speculative step's second slot; the stream's host buffers too,
  and the estimator says the ledger's NVMe bytes;
- checkpoints of bf16 nvme parts resume exactly, move to host and device parts and to another
  world size, and convert to and from fp32 files (widened exactly / rounded once).
"""
from __future__ import annotations

import os

import pytest
import torch

from harness import run_world
from reference import engine_train, global_batches, rank_micro_batch, tiny_gpt

STEPS, MICRO, LR = 3, 2, 1e-3
NEVER, ALWAYS = 1e6, 1e-3  # clipping thresholds the tiny model's gradient norm never / always exceeds
AIO = {"block_size": 65536, "queue_depth": 4, "thread_count": 2}


def _speculate_every_step() -> dict:
    """offload_optimizer.speculation 'always' where zerokit has the key (adaptive speculation
    holds a step back after a clipped one; the counts below expect every step speculated)."""
    from zerokit.config.schema import OffloadOptimizerConfig

    return {"speculation": "always"} if "speculation" in OffloadOptimizerConfig.model_fields else {}


_SPECULATE_EVERY_STEP = _speculate_every_step()


def _config(stage: int, placement: str, path: str | None, *, sr: bool = False, states: bool = True,
            master: bool = True, sib: bool = False, clip: float = 0.0, sgd: bool = False,
            sub_group: int = 1000, gas: int = 1) -> dict:
    """placement: cpu | nvme | twin (cpu, ratio 0.4) | nvme-twin (nvme, ratio 0.4) | none."""
    zero = {"stage": stage, "reduce_bucket_size": 2000, "sub_group_size": sub_group}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0)
    if placement != "none":
        off = {"device": "nvme" if placement.startswith("nvme") else "cpu", "step_in_backward": sib,
               **_SPECULATE_EVERY_STEP}
        if off["device"] == "nvme":
            off.update(nvme_path=path, buffer_count=3, pipeline_read=True, pipeline_write=True)
        if placement.endswith("twin"):
            off["ratio"] = 0.4
        zero["offload_optimizer"] = off
    opt = ({"type": "Adam", "params": {"lr": 10.0, "betas": [0.0, 0.0], "eps": 1e3, "weight_decay": 0.0}}
           if sgd else {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}})
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "gradient_clipping": clip,
            "bf16": {"enabled": True, "bf16_master_weights_and_grads": master,
                     "bf16_optimizer_states": states and master, "stochastic_rounding": sr and master},
            "zero_optimization": zero, "aio": AIO, "optimizer": opt}


def flat_state(engine) -> dict[str, torch.Tensor]:
    """Per unit, this rank's optimizer range as one tensor per kind (master and each state, the
    parts concatenated in element order whatever tier holds them) and the parts' step counts;
    padding elements past the unit's parameters left out."""
    from zerokit.parts.nvme import read_range

    out = {}
    for u in engine.units:
        if not u.trainable:
            continue
        a, b = u.opt_range
        real = max(0, min(b, u.numel) - a)
        torch_state = engine.optimizer.state.get(u.master, {})
        pieces: dict[str, list[torch.Tensor]] = {}
        for p in u.parts:
            if p.tier == "device":
                tensors = {"master": u.master.detach()}
                tensors.update({k: v for k, v in torch_state.items() if torch.is_tensor(v) and v.dim()})
                steps = int(torch_state["step"].item()) if "step" in torch_state else 0
            else:
                p.wait()
                read = (lambda t: read_range(p.nvme, t)) if p.tier == "nvme" else (lambda t: t)
                tensors = {"master": read(p.master), **{k: read(v) for k, v in p.state.items()}}
                steps = p.steps
            if p.numel:
                out[f"{u.name}/steps@{p.lo}"] = torch.tensor(steps)
            for k, v in tensors.items():
                pieces.setdefault(k, []).append(v.detach().cpu().flatten())
        for k, v in pieces.items():
            out[f"{u.name}/{k}"] = torch.cat(v)[:real].clone()
    return out


def _steps_only(state: dict) -> dict:
    """The step counts per unit (parts split differently per placement: one count each)."""
    per_unit: dict[str, set] = {}
    for k, v in state.items():
        if "/steps@" in k:
            per_unit.setdefault(k.split("/steps@")[0], set()).add(int(v))
    return per_unit


def _equal(a: dict, b: dict, what: str) -> list[str]:
    bad = []
    keys = sorted(k for k in a if "/steps@" not in k)
    if keys != sorted(k for k in b if "/steps@" not in k):
        return [f"{what}: keys {keys} vs {sorted(b)}"]
    for k in keys:
        if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k]):
            diff = (a[k].double() - b[k].double()).abs().max().item() if a[k].shape == b[k].shape else "shape"
            bad.append(f"{what} {k}: {a[k].dtype} vs {b[k].dtype}, max diff {diff}")
    if _steps_only(a) != _steps_only(b):
        bad.append(f"{what}: step counts {_steps_only(a)} vs {_steps_only(b)}")
    return bad


def _train(rank, world, cfg, steps=STEPS, *, bad_step=None, gas=1):
    """One engine over `steps` steps; a snapshot (flat_state) after each."""
    import zerokit

    if "nvme_path" in cfg["zero_optimization"].get("offload_optimizer", {}):
        os.makedirs(cfg["zero_optimization"]["offload_optimizer"]["nvme_path"], exist_ok=True)
    engine, *_ = zerokit.initialize(model=tiny_gpt(), config=cfg)
    snaps, losses = [], []
    for i, batch in enumerate(global_batches(steps, MICRO * world * gas)):
        for micro in range(gas):
            x, y = rank_micro_batch(batch, rank, world, micro, gas)
            loss = engine(x, y)
            if i == bad_step and micro == gas - 1:
                loss = loss * float("inf")  # a non-finite gradient: the step is skipped
            engine.backward(loss)
            engine.step()
        losses.append(float(loss.detach()))
        snaps.append(flat_state(engine))
    out = {"snaps": snaps, "losses": losses, "weights": engine.consolidated_fp32_state_dict(),
           "speculating": engine._steps_in_backward, "counts": dict(vars(engine.speculation)),
           "nvme": {k: engine.ledger.bytes(tier="nvme", kind=k)
                    for k in ("master", "grads", "optimizer_state", "restores")},
           "nvme_numel": sum(u.layout.nvme_numel for u in engine.units)}
    engine.destroy()
    return out


# ---- every tier alike ------------------------------------------------------------------------
PLACEMENTS = ("cpu", "nvme", "twin", "nvme-twin", "none")
# (stage, stochastic rounding, bf16 states): round-to-nearest and stochastic, bf16 and fp32 states
VARIANTS = ((1, False, True), (2, True, True), (3, True, False))


def _tiers(rank, world, path):
    results = {}
    for stage, sr, states in VARIANTS:
        for placement in PLACEMENTS:
            cfg = _config(stage, placement, os.path.join(path, f"{stage}-{placement}"), sr=sr,
                          states=states)
            results[stage, placement] = _train(rank, world, cfg)
    return results


@pytest.mark.parametrize("world", [1, 2])
def test_every_tier_gives_the_host_parts_bits(tmp_path, world):
    per_rank = run_world(_tiers, world, str(tmp_path), timeout=900)
    w0 = {k: v.detach().float() for k, v in tiny_gpt().to(torch.bfloat16).named_parameters()}
    failures = []
    for rank, results in enumerate(per_rank):
        for stage, sr, states in VARIANTS:
            host = results[stage, "cpu"]
            for placement in PLACEMENTS[1:]:
                run = results[stage, placement]
                for step, (a, b) in enumerate(zip(run["snaps"], host["snaps"])):
                    failures += _equal(a, b, f"rank {rank} stage {stage} {placement} step {step}")
                if run["losses"] != host["losses"]:
                    failures.append(f"rank {rank} stage {stage} {placement}: losses {run['losses']} "
                                    f"vs {host['losses']}")
            last = host["snaps"][-1]
            dtypes = {k.rsplit("/", 1)[1]: v.dtype for k, v in last.items() if "/steps@" not in k}
            assert dtypes == {"master": torch.bfloat16, "exp_avg": torch.bfloat16 if states else torch.float32,
                              "exp_avg_sq": torch.bfloat16 if states else torch.float32}, dtypes
            moved = sum(int((host["weights"][n].float() != w).sum()) for n, w in w0.items())
            assert moved > 0.5 * sum(w.numel() for w in w0.values()), (stage, moved)
            nvme = results[stage, "nvme"]
            n = nvme["nvme_numel"]
            assert n > 0
            assert nvme["nvme"] == {"master": 2 * n, "grads": 2 * n,
                                    "optimizer_state": (4 if states else 8) * n, "restores": 0}, nvme["nvme"]
    assert not failures, "\n".join(failures[:12])


def _other_optimizers(rank, world, path):
    out = {}
    for opt, params in (("Adagrad", {"lr": 1e-2, "initial_accumulator_value": 0.1}),
                        ("Lion", {"lr": 1e-4, "weight_decay": 0.1})):
        for placement in PLACEMENTS:
            cfg = _config(2, placement, os.path.join(path, f"{opt}-{placement}"), sr=True)
            cfg["optimizer"] = {"type": opt, "params": params}
            out[opt, placement] = _train(rank, world, cfg)
    return out


def test_adagrad_and_lion_on_every_tier(tmp_path):
    """Adagrad (its sum starting at initial_accumulator_value, which torch's Adagrad creates in
    the master's dtype) and Lion: every tier gives the host parts' bits."""
    out = run_world(_other_optimizers, 1, str(tmp_path))[0]
    for opt in ("Adagrad", "Lion"):
        host = out[opt, "cpu"]
        for placement in PLACEMENTS[1:]:
            for step, (a, b) in enumerate(zip(out[opt, placement]["snaps"], host["snaps"])):
                bad = _equal(a, b, f"{opt} {placement} step {step}")
                assert not bad, bad[:4]


def _edited(rank, world, path):
    """Two steps, an edit of one weight under GatheredParameters (modifier rank 0), one step:
    the edit reaches the bf16 master wherever it lives (a host tensor, a file, the device)."""
    import zerokit
    from zerokit.zero import GatheredParameters

    out = {}
    for placement in PLACEMENTS:
        cfg = _config(3, placement, os.path.join(path, placement), sr=True)
        if placement.startswith("nvme"):
            os.makedirs(os.path.join(path, placement), exist_ok=True)
        engine, *_ = zerokit.initialize(model=tiny_gpt(), config=cfg)
        batches = global_batches(3, MICRO * world)
        engine_train(engine, batches[:2], rank, world)
        before = flat_state(engine)
        weight = engine.module.transformer.h[0].mlp.c_fc.weight
        with GatheredParameters([weight], modifier_rank=0):
            if rank == 0:
                weight.data.mul_(0.5)
        edited = flat_state(engine)
        engine_train(engine, batches[2:], rank, world)
        out[placement] = (edited, flat_state(engine), before)
        engine.destroy()
    return out


def test_an_edit_under_gathered_parameters_reaches_every_bf16_master(tmp_path):
    for rank, out in enumerate(run_world(_edited, 2, str(tmp_path), timeout=600)):
        for placement in PLACEMENTS:
            edited, _, before = out[placement]
            key = next(k for k in before if k.endswith("/master") and ".h.0" in k)
            changed = int((edited[key] != before[key]).sum())
            assert changed > 0.2 * before[key].numel(), (placement, changed)  # c_fc: most of h.0
            for which in (0, 1):
                bad = _equal(out[placement][which], out["cpu"][which], f"rank {rank} {placement}")
                assert not bad, bad[:4]


def _delayed_and_budgeted(rank, world, path):
    """The one-step delayed update (two bf16 gradient files per nvme part) and a host budget
    (max_in_cpu: the first elements in host memory, the rest in bf16 files), nvme vs cpu."""
    out = {}
    for device in ("cpu", "nvme"):
        cfg = _config(2, device, os.path.join(path, device), sr=True)
        off = cfg["zero_optimization"]["offload_optimizer"]
        off["delayed_update"] = {"enabled": True, "warmup_steps": 1}
        if device == "nvme":
            off["max_in_cpu"] = 3000
        out[device] = _train(rank, world, cfg, steps=4)
    return out


def test_delayed_update_and_host_budget_on_bf16_nvme_parts(tmp_path):
    for rank, r in enumerate(run_world(_delayed_and_budgeted, 2, str(tmp_path), timeout=600)):
        assert r["nvme"]["nvme_numel"] > 0
        for step, (a, b) in enumerate(zip(r["nvme"]["snaps"], r["cpu"]["snaps"])):
            bad = _equal(a, b, f"rank {rank} step {step}")
            assert not bad, bad[:4]
        n = r["nvme"]["nvme_numel"]
        assert r["nvme"]["nvme"]["grads"] == 2 * 2 * n, r["nvme"]["nvme"]  # two bf16 files


# ---- an independent reference ------------------------------------------------------------------
def _fallback_reference(steps: int) -> dict[str, torch.Tensor]:
    """The keys' meaning, without zerokit's engine: a bf16 model whose parameters are the
    masters, each stepped with fallback_bf16's AdamW (fp32 math, each store rounded once to
    bf16) from its bf16 gradient; bf16 moments."""
    from zerokit.optim import fallback_bf16

    model = tiny_gpt().to(torch.bfloat16)
    moments = {n: (torch.zeros(p.numel(), dtype=torch.bfloat16), torch.zeros(p.numel(), dtype=torch.bfloat16))
               for n, p in model.named_parameters()}
    for t, (x, y) in enumerate(global_batches(steps, MICRO), start=1):
        model(x, y).backward()
        with torch.no_grad():
            for n, p in model.named_parameters():
                m, v = moments[n]
                fallback_bf16.adam_step(p.data.view(-1), p.grad.reshape(-1), m, v, lr=LR, beta1=0.9,
                                        beta2=0.999, eps=1e-8, weight_decay=0.1, step=t, adamw=True,
                                        bias_correction_on=True, grad_scale=1.0, out16=None,
                                        storage=fallback_bf16.Storage(False, 0, t, 0))
                p.grad = None
    return {n: p.detach().float() for n, p in model.named_parameters()}


def _reference_runs(rank, world, path):
    return {placement: _train(rank, world, _config(2, placement, os.path.join(path, placement)))["weights"]
            for placement in ("nvme", "nvme-twin", "none")}


def test_engine_matches_a_plain_torch_loop_of_the_kernel_math(tmp_path):
    ref = _fallback_reference(STEPS)
    runs = run_world(_reference_runs, 1, str(tmp_path))[0]
    for placement, weights in runs.items():
        for name, w in ref.items():
            assert torch.equal(weights[name].float(), w), (placement, name,
                                                           (weights[name].float() - w).abs().max().item())


# ---- stepping in backward ------------------------------------------------------------------------
SIB_CASES = [(2, "nvme", NEVER, 1), (3, "nvme", ALWAYS, 1), (2, "nvme-twin", ALWAYS, 2),
             (1, "twin", NEVER, 1)]


def _sib(rank, world, path):
    out = []
    for n, (stage, placement, clip, gas) in enumerate(SIB_CASES):
        runs = [_train(rank, world, _config(stage, placement, os.path.join(path, f"{n}-{sib}"), sr=True,
                                            sib=sib, clip=clip, sgd=True, gas=gas),
                       bad_step=1, gas=gas)
                for sib in (True, False)]
        out.append(runs)
    return out


def test_stepping_in_backward_equals_stepping_in_step(tmp_path):
    per_rank = run_world(_sib, 2, str(tmp_path), timeout=900)
    failures = []
    for rank, cases in enumerate(per_rank):
        for (stage, placement, clip, gas), (sib, base) in zip(SIB_CASES, cases):
            case = f"rank {rank} stage {stage} {placement} clip {clip} gas {gas}"
            assert (sib["speculating"], base["speculating"]) == (True, False), case
            for step, (a, b) in enumerate(zip(sib["snaps"], base["snaps"])):
                failures += _equal(a, b, f"{case} step {step}")
            applied = STEPS - 1
            want = {"committed": 0 if clip == ALWAYS else applied,
                    "redone": applied if clip == ALWAYS else 0, "skipped": 1}
            got = {k: sib["counts"][k] for k in want}
            if got != want:
                failures.append(f"{case}: counts {got}, expected {want}")
            if placement.startswith("nvme"):  # the second slot, bf16 like the first
                n = sib["nvme_numel"]
                assert sib["nvme"]["restores"] == (2 + 4) * n, (case, sib["nvme"], n)
    assert not failures, "\n".join(failures[:12])


# ---- bytes on disk ---------------------------------------------------------------------------------
def _files(rank, world, cfg):
    """Each swap file's size as the disk has it (os.stat), by its name, while the engine lives;
    the stream's host buffers; the estimator's and the ledger's NVMe bytes."""
    import zerokit
    from zerokit.memory import estimate

    path = cfg["zero_optimization"]["offload_optimizer"]["nvme_path"]
    os.makedirs(path, exist_ok=True)
    engine, *_ = zerokit.initialize(model=tiny_gpt(), config=cfg)
    engine_train(engine, global_batches(2, MICRO * world), rank, world)
    io = engine.nvme_io()  # the second step's bytes (the first step's include first touches)
    sizes = {}
    for root, _, names in os.walk(path):
        for name in names:  # the swap files (not the directory's claim lock, named per process)
            if name.endswith(".swp"):
                sizes[name] = os.stat(os.path.join(root, name)).st_size
    from zerokit.config.plan import explain

    # the peak: the gradient pieces' buffers on their way to the files are taken in backward
    sets = engine.ledger.bytes(tier="host", kind="buffers", peak=True)
    ledger_nvme = engine.ledger.bytes(tier="nvme")
    plan = explain(engine)
    engine.destroy()
    est = estimate(tiny_gpt(), world, config=cfg, activations=False)
    return {"sizes": sizes, "buffers": sets, "ledger_nvme": ledger_nvme, "plan": plan,
            "io": (io["bytes_read"], io["bytes_written"]),
            "estimate_nvme": est.tier("nvme"), "estimate_buffers": est.bytes["host"]["buffers"]}


@pytest.mark.parametrize("sib", [False, True])
def test_nvme_files_hold_half_the_bytes(tmp_path, sib):
    def cfg(master, sub):
        out = _config(2, "nvme", str(tmp_path / f"{master}-{sib}-{sub}"), master=master, sib=sib,
                      sub_group=sub)
        # the fp32 master's gradients in its dtype, as DeepSpeed keeps them (at one rank and one
        # micro-step they would be bf16 by default: [Note: 16-bit offloaded gradients])
        out["zero_optimization"]["offload_optimizer"]["gradient_dtype"] = "master"
        return out

    fp32, bf16 = (run_world(_files, 1, cfg(m, 1000))[0] for m in (False, True))
    assert fp32["sizes"].keys() == bf16["sizes"].keys() and fp32["sizes"]
    kinds = {"nvme_master", "nvme_state.exp_avg", "nvme_state.exp_avg_sq"}
    kinds |= {"nvme_master.slot1", "nvme_state.exp_avg.slot1"} if sib else {"nvme_grad0"}
    for kind in kinds:  # each kind of file is there, in every unit
        assert any(kind in name for name in bf16["sizes"]), (kind, sorted(bf16["sizes"]))
    for name, size in fp32["sizes"].items():
        assert size > 0 and bf16["sizes"][name] * 2 == size, (name, size, bf16["sizes"][name])
    # a step's I/O (the engine's report: the stream, gradient files) halves too
    assert min(fp32["io"]) > 0 and (bf16["io"][0] * 2, bf16["io"][1] * 2) == fp32["io"], (fp32["io"], bf16["io"])
    for run in (fp32, bf16):  # the estimator and the host budget's plan count what is allocated
        assert run["estimate_nvme"] == run["ledger_nvme"] == sum(run["sizes"].values()), run
        assert run["estimate_buffers"] == run["buffers"], run
    names = "bf16 master, " + ("" if sib else "bf16 gradient, ") + "bf16 optimizer state"
    assert f"in files ({names})" in bf16["plan"], bf16["plan"]
    # the stream's buffer sets (host): one sub-group per set, half the bytes; the 16-bit output
    # (nvme_out, bf16 in both) is the rest of the host buffers
    big = [run_world(_files, 1, cfg(m, 4000))[0]["buffers"] for m in (False, True)]
    sets_fp32, sets_bf16 = big[0] - fp32["buffers"], big[1] - bf16["buffers"]
    assert sets_fp32 > 0 and sets_bf16 * 2 == sets_fp32, (fp32["buffers"], bf16["buffers"], big)


# ---- checkpoints ---------------------------------------------------------------------------------
def _checkpoint(rank, world, path, save_cfg, load_cfgs):
    """Train 2 steps with save_cfg, save, train 1 more; each load_cfg engine (another seed) loads
    the checkpoint: its state just after loading and after the same third step."""
    import zerokit

    for cfg in (save_cfg, *load_cfgs):
        off = cfg["zero_optimization"].get("offload_optimizer", {})
        if "nvme_path" in off:
            os.makedirs(off["nvme_path"], exist_ok=True)
    batches = global_batches(3, MICRO * world)
    ckpt = os.path.join(path, "ckpt")
    engine, *_ = zerokit.initialize(model=tiny_gpt(), config=save_cfg)
    engine_train(engine, batches[:2], rank, world)
    engine.save_checkpoint(ckpt, tag="t")
    saved = flat_state(engine)
    saved_weights = engine.consolidated_fp32_state_dict()
    engine_train(engine, batches[2:], rank, world)
    out = {"saved": saved, "saved_weights": saved_weights, "after": flat_state(engine), "loads": []}
    engine.destroy()
    for cfg in load_cfgs:
        engine, *_ = zerokit.initialize(model=tiny_gpt(7), config=cfg)
        engine.load_checkpoint(ckpt, tag="t")
        loaded = flat_state(engine)
        engine_train(engine, batches[2:], rank, world)
        out["loads"].append({"loaded": loaded, "after": flat_state(engine)})
        engine.destroy()
    return out


def _load_only(rank, world, ckpt, cfg):
    import zerokit

    off = cfg["zero_optimization"].get("offload_optimizer", {})
    if "nvme_path" in off:
        os.makedirs(off["nvme_path"], exist_ok=True)
    engine, *_ = zerokit.initialize(model=tiny_gpt(7), config=cfg)
    engine.load_checkpoint(ckpt, tag="t")
    out = {"loaded": flat_state(engine), "weights": engine.consolidated_fp32_state_dict()}
    engine.destroy()
    return out


def test_bf16_nvme_checkpoints_resume_and_convert(tmp_path):
    p = str(tmp_path)
    bf16_nvme = _config(2, "nvme", p + "/a", sr=True)
    loads = [_config(2, "nvme", p + "/b", sr=True), _config(2, "cpu", None, sr=True),
             _config(2, "twin", None, sr=True), _config(2, "nvme", p + "/c", master=False)]
    out = run_world(_checkpoint, 2, p + "/w", bf16_nvme, loads, timeout=600)
    for rank, r in enumerate(out):
        for i, load in enumerate(r["loads"][:3]):  # bf16 -> bf16 on nvme, host, device parts: exact
            assert not _equal(load["loaded"], r["saved"], "loaded"), (rank, i, _equal(load["loaded"], r["saved"], "loaded"))
            assert not _equal(load["after"], r["after"], "resumed"), (rank, i, _equal(load["after"], r["after"], "resumed"))
        widened = r["loads"][3]["loaded"]  # bf16 -> fp32 files: widened exactly
        for k, v in r["saved"].items():
            if "/steps@" not in k:
                assert widened[k].dtype == torch.float32 and torch.equal(widened[k], v.float()), k
    # resharded: world 2's bf16 nvme checkpoint into world 1 (nvme, Twin-Flow): each unit's
    # elements are the two ranks' saved ranges end to end, the weights the same
    for cfg in (_config(2, "nvme", p + "/f", sr=True), _config(2, "twin", None, sr=True)):
        one = run_world(_load_only, 1, p + "/w/ckpt", cfg)[0]
        for k, v in one["loaded"].items():
            if "/steps@" not in k:
                both = torch.cat([out[0]["saved"][k], out[1]["saved"][k]])
                assert v.dtype == both.dtype and torch.equal(v, both), k
        for k, v in one["weights"].items():
            assert torch.equal(v, out[0]["saved_weights"][k]), k
    # fp32 nvme -> bf16 nvme: rounded once to nearest
    out = run_world(_checkpoint, 1, p + "/v", _config(2, "nvme", p + "/d", master=False),
                    [_config(2, "nvme", p + "/e")], timeout=600)[0]
    for k, v in out["saved"].items():
        if "/steps@" not in k:
            got = out["loads"][0]["loaded"][k]
            assert got.dtype == torch.bfloat16 and torch.equal(got, v.to(torch.bfloat16)), k
