"""The speculative step (offload_optimizer.step_in_backward, parts/speculation.py): offloaded
parts step in backward with 1 / loss scale, and the step commits that update or rolls it back
(redo with the clipped coefficient, or skip).

The parity grid: stages 1-3 x {host parts, NVMe parts, Twin-Flow 0.4} x gradient_clipping {0,
large (never applies), 1e-3 (always applies)} x {fp16 dynamic loss scaling with an overflow forced
at step 1, bf16 with a non-finite gradient forced at step 1 (skipped)} x accumulation {1, 3}. In
every case, after every step, the compute weights, every part's fp32 master and optimizer state
and its step count are bit-equal to the same run stepping in step() (step_in_backward false), the
counters say what was committed, redone and skipped, and both runs match a plain-torch reference
whose update is linear in the gradient (Adam with betas 0 and eps far above |g|, so clipping and
unscaling errors show) within 16-bit noise. Several cases run in one world (one launch). The fast
subset adds fp16 with a static loss scale (its overflow skips the step too).
"""
from __future__ import annotations

import itertools
import os

import pytest
import torch

from harness import run_world
from reference import global_batches, rank_micro_batch, reference_train, tiny_gpt

STEPS, MICRO, BAD_STEP = 3, 2, 1
LR = 10.0  # updates ~ lr * g / eps = 1e-2 g: well above the weights' resolution
NEVER = 1e6  # a clipping threshold the tiny model's gradient norm never reaches
ALWAYS = 1e-3

PLACEMENTS = ("cpu", "nvme", "twin")
CLIPS = (0.0, NEVER, ALWAYS)
PRECISIONS = ("fp16", "bf16")
ACCUMULATION = (1, 3)


def _config(case, path, step_in_backward, speculation="always"):
    stage, placement, clip, precision, gas = case
    zero = {"stage": stage, "reduce_bucket_size": 2000, "sub_group_size": 1000}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0)
    if placement.endswith("+param"):  # weight shards on the host: the parts write them in place
        zero["offload_param"] = {"device": "cpu"}
        placement = placement[:-len("+param")]
    off = {"device": "nvme" if placement == "nvme" else "cpu", "step_in_backward": step_in_backward,
           "speculation": speculation}
    if placement == "nvme":
        off.update(nvme_path=path, buffer_count=3, pipeline_read=True, pipeline_write=True)
    if placement == "twin":
        off["ratio"] = 0.4
    zero["offload_optimizer"] = off
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "gradient_clipping": clip, "zero_optimization": zero,
            # fp16s: a static loss scale, which skips an overflowing step as the dynamic one does
            "fp16": {"enabled": precision.startswith("fp16"), "initial_scale_power": 8,
                     "loss_scale": 128.0 if precision == "fp16s" else 0.0},
            "bf16": {"enabled": precision == "bf16"},
            "aio": {"block_size": 65536, "queue_depth": 4, "thread_count": 2},
            # an SGD-like, scale-sensitive update (see the module docstring)
            "optimizer": {"type": "Adam", "params": {"lr": LR, "betas": [0.0, 0.0], "eps": 1e3,
                                                      "weight_decay": 0.0}}}


def _state(engine) -> dict[str, torch.Tensor]:
    """This rank's compute weights and every part's master, optimizer state and step count."""
    from zerokit.parts.nvme import read_range

    def real(t: torch.Tensor, lo: int, u) -> torch.Tensor:
        """t holds elements [lo, lo + len) of the unit's flat index space: those of parameters
        (the padding after them is never a parameter's and holds whatever was there)."""
        return t.detach().flatten()[:max(0, min(t.numel(), u.numel - lo))].clone()

    out = {}
    for u in engine.units:
        if not u.trainable:
            continue
        weights = u.shard if u.shard is not None else u.flat
        out[f"{u.name}/weights"] = real(weights, u.shard_range[0] if u.shard is not None else 0, u)
        for i, p in enumerate(u.parts):
            key = f"{u.name}/{p.tier}{i}"
            if p.tier == "device":
                out[f"{key}/master"] = real(u.master, p.lo, u)
                for k, v in engine.optimizer.state.get(u.master, {}).items():
                    out[f"{key}/{k}"] = real(v, p.lo, u) if v.dim() else v.clone()
                continue
            out[f"{key}/steps"] = torch.tensor(p.steps)
            if p.tier == "host":
                out[f"{key}/master"] = real(p.master, p.lo, u)
                out.update({f"{key}/{k}": real(v, p.lo, u) for k, v in p.state.items()})
            else:
                out[f"{key}/master"] = real(read_range(p.nvme, p.master), p.lo, u)
                out.update({f"{key}/{k}": real(read_range(p.nvme, v), p.lo, u)
                            for k, v in p.state.items()})
    return out


def _params_not_shard(engine, step: int) -> list[str]:
    """Where a unit's shard is its weights: parameters the next forward reads that differ from
    the shard the update wrote (a stale copy would train on old weights within 16-bit noise of
    the reference, so the update's distance from torch's would not show it)."""
    return [f"step {step} {s.fqn}" for u in engine.units if u.weights_are_shard for s in u.slots
            if not torch.equal(s.param.detach().flatten(), u.shard[s.offset:s.offset + s.numel])]


def _run(rank, world, case, path, step_in_backward, speculation="always"):
    """One engine over STEPS steps, the loss made non-finite at one micro-step of BAD_STEP."""
    import zerokit

    gas = case[-1]
    os.makedirs(path, exist_ok=True)
    engine, _, _, _ = zerokit.initialize(model=tiny_gpt(), config=_config(case, path, step_in_backward,
                                                                                 speculation))
    states, stale = [], []
    for i, batch in enumerate(global_batches(STEPS, MICRO * world * gas)):
        for micro in range(gas):
            x, y = rank_micro_batch(batch, rank, world, micro, gas)
            loss = engine(x, y)
            if i == BAD_STEP and micro == gas - 1:
                loss = loss * float("inf")  # fp16: an overflow; bf16: a non-finite gradient
            engine.backward(loss)
            engine.step()
        states.append(_state(engine))
        stale += _params_not_shard(engine, i)
    out = {"states": states, "stale": stale,
           "shard_is_weights": all(u.weights_are_shard for u in engine.units), "weights": engine.consolidated_fp32_state_dict(),
           "counts": dict(vars(engine.speculation)), "skipped": engine.skipped_steps,
           "speculating": engine._steps_in_backward}
    engine.destroy()
    return out


def _grid(rank, world, cases, path, speculation="always"):
    """Each case both ways in this world; returns per case the mismatches and what to check."""
    results = []
    for n, case in enumerate(cases):
        runs = [_run(rank, world, case, os.path.join(path, f"{n}-{sib}"), sib, speculation)
                for sib in (True, False)]
        sib, base = runs
        bad = []
        for step, (a, b) in enumerate(zip(sib["states"], base["states"])):
            assert a.keys() == b.keys()
            bad += [f"step {step} {k}: max diff {(a[k].double() - b[k].double()).abs().max().item():.3g}"
                    for k in a if not torch.equal(a[k], b[k])]
        bad += [f"{'speculative' if r is sib else 'in step()'}: {name} is not the shard"
                for r in runs for name in r["stale"]]
        results.append({"case": case, "bad": bad, "counts": sib["counts"],
                        "shard_is_weights": sib["shard_is_weights"], "skipped": sib["skipped"],
                        "speculating": (sib["speculating"], base["speculating"]),
                        "weights": base["weights"] if rank == 0 else None})
    return results


_REFERENCE: dict = {}


def _reference(precision, clip, gas, world):
    """Plain torch over the same global batches, the bad step's batch left out (a skipped step
    applies nothing), fp32 master weights and 16-bit compute in world x gas chunks."""
    key = (precision, clip, gas, world)
    if key not in _REFERENCE:
        batches = global_batches(STEPS, MICRO * world * gas)
        del batches[BAD_STEP]
        dtype = torch.float16 if precision.startswith("fp16") else torch.bfloat16
        _REFERENCE[key] = reference_train(
            tiny_gpt, lambda ps: torch.optim.Adam(ps, lr=LR, betas=(0.0, 0.0), eps=1e3), batches,
            dtype=dtype, clip=clip, chunks=world * gas)[1]
    return _REFERENCE[key]


def _always_counts(clip):
    """speculation 'always': every applied step speculated; the bad step's update rolled back."""
    applied = STEPS - 1
    return {"committed": 0 if clip == ALWAYS else applied, "redone": applied if clip == ALWAYS else 0,
            "skipped": 1, "held_back": 0}


def _adaptive_counts(clip):
    """speculation 'adaptive': after step 0's redo (clipping applied) no step speculates."""
    if clip == ALWAYS:
        return {"committed": 0, "redone": 1, "skipped": 0, "held_back": STEPS - 1}
    return _always_counts(clip)


def _check(per_rank, world, want_counts=_always_counts):
    results = per_rank[0]
    for other in per_rank[1:]:  # every rank's own mismatches
        for r, o in zip(results, other):
            r["bad"] += [f"rank {per_rank.index(other)}: {b}" for b in o["bad"]]
    start = {k: v.detach().clone() for k, v in tiny_gpt().named_parameters()}
    failures = []
    for r in results:
        case = r["case"]
        _, _, clip, precision, gas = case
        if r["bad"]:
            failures.append(f"{case}: speculative != stepping in step(): {r['bad'][:4]}")
            continue
        assert r["speculating"] == (True, False), (case, r["speculating"])
        assert r["skipped"] == 1, (case, r["skipped"])
        want = want_counts(clip)
        got = {k: r["counts"][k] for k in want}
        if got != want:
            failures.append(f"{case}: counts {got}, expected {want}")
        ref = _reference(precision, clip, gas, world)
        moved = torch.cat([(r["weights"][n] - start[n]).flatten() for n in ref])
        expected = torch.cat([(w - start[n]).flatten() for n, w in ref.items()])
        err = float((moved - expected).norm() / expected.norm())
        if not err < 0.05:  # 16-bit gradients: a few per cent; a wrong scale or clip: far more
            failures.append(f"{case}: the update is {err:.3g} (relative) away from torch's")
    assert not failures, "\n".join(failures)


def _cases(stage):
    return list(itertools.product([stage], PLACEMENTS, CLIPS, PRECISIONS, ACCUMULATION))


# The fast tier: every placement, clipping and precision once, with and without accumulation.
FAST = [(2, "cpu", ALWAYS, "fp16", 3), (2, "nvme", NEVER, "bf16", 1), (2, "twin", 0.0, "fp16", 1),
        (2, "nvme", ALWAYS, "fp16", 3), (3, "twin", ALWAYS, "bf16", 3), (1, "cpu", 0.0, "bf16", 1),
        (3, "nvme", NEVER, "fp16s", 1), (1, "twin", ALWAYS, "fp16s", 3)]


def test_speculative_step_fast_subset(tmp_path):
    _check(run_world(_grid, 2, FAST, str(tmp_path), timeout=600), 2)


# One rank at stage 3: the shard is the weights the forward reads ([Note: one rank's shard is its
# weights] in policy/layout.py), so an update stepped in backward, its restore and its redo write
# the weights autograd holds while backward goes on; with offload_param the host and NVMe parts
# write the host shard in place.
WORLD1 = [(3, "cpu+param", ALWAYS, "fp16", 3), (3, "nvme+param", NEVER, "bf16", 1),
          (3, "twin+param", ALWAYS, "bf16", 1), (3, "cpu", 0.0, "fp16s", 3),
          (3, "nvme", ALWAYS, "bf16", 3)]


def test_speculative_step_at_one_rank_where_the_shard_is_the_weights(tmp_path):
    per_rank = run_world(_grid, 1, WORLD1, str(tmp_path), timeout=600)
    _check(per_rank, 1)
    assert all(r["shard_is_weights"] for r in per_rank[0])


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_speculative_step_parity_grid(tmp_path, stage):
    _check(run_world(_grid, 2, _cases(stage), str(tmp_path), timeout=1800), 2)


def test_adaptive_speculation_holds_back_after_a_clipped_step(tmp_path):
    """The default ('adaptive'): once a step's clipping applied, the next steps step in step()
    (no speculation, no redo) until clipping leaves a step alone; bit-equal all the same."""
    cases = [(2, "cpu", ALWAYS, "bf16", 1), (3, "nvme", ALWAYS, "fp16", 3), (1, "twin", NEVER, "bf16", 1)]
    _check(run_world(_grid, 2, cases, str(tmp_path), "adaptive", timeout=600), 2, _adaptive_counts)
