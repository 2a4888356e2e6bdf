#!/usr/bin/env python
"""CUDA check of device placement and host syncs (needs a GPU; no network). One command per mode:

    python benchmarks/gpu_check.py                                          # no launcher
    torchrun --standalone --nproc-per-node 1 benchmarks/gpu_check.py        # one rank per GPU
    torchrun --standalone --nproc-per-node 2 benchmarks/gpu_check.py        # on a 1-GPU machine:
                                                                            # must be refused
    python benchmarks/gpu_check.py --dry-run-on-cpu                         # checks this script
                                                                            # itself, without a GPU
Run with PYTHONPATH=src from the repository root. Each case prints `PASS <case>: ...` or
`FAIL <case>: ...`; the last line is `SUMMARY: <n> passed, <m> failed` and the exit status is 1
if anything failed.

Cases: the demo GPT trains a few steps on CUDA at stages 0-3 (fp32, losses and final weights
against a plain torch loop on the same GPU), stage 3 in bf16, stage 3 with offload_param cpu,
stage 2 with offload_optimizer cpu; parameters, buffers, master weights, gradients and optimizer
state are asserted to live where the plan says; a model already on the GPU stays there; host
syncs during stage-3 steps are counted (torch.cuda.set_sync_debug_mode("warn") plus
Event.synchronize) and listed by source line; under a launcher, the rank-agreement check of NCCL
(an async all-reduce read behind a CUDA event) is timed against the blocking check it replaced.
"""
from __future__ import annotations

import collections
import os
import sys
import time
import traceback
import warnings
from typing import Any

import torch

RESULTS: list[tuple[str, bool, str]] = []
STEPS, BATCH, SEQ = 4, 4, 64


def case(name: str):
    def run(fn):
        try:
            detail = fn() or ""
            RESULTS.append((name, True, detail))
            print(f"PASS {name}: {detail}", flush=True)
        except Exception as e:  # report every failure and go on with the next case
            RESULTS.append((name, False, f"{type(e).__name__}: {e}"))
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
        return fn
    return run


def make_gpt(seed: int = 0) -> torch.nn.Module:
    from zerokit.models import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=256, block_size=SEQ, n_layer=4, n_head=4, n_embd=128, bias=False))


def batches(device: torch.device, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        t = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
        out.append((t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)))
    return out


def config(stage: int, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH, "steps_per_print": 10 ** 9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage, **zero}}


def reference(device: torch.device) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make_gpt().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    losses = []
    for x, y in batches(device):
        loss = loss_of(model(x, y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().float() for k, v in model.named_parameters()}


def loss_of(out) -> torch.Tensor:
    return out[1] if isinstance(out, tuple) else out


def train(engine, device: torch.device) -> list[float]:
    losses = []
    for x, y in batches(device):
        loss = loss_of(engine(x, y))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def expect_device(what: str, t: torch.Tensor | None, device: torch.device) -> None:
    if t is not None and t.numel() and t.device != device:
        raise AssertionError(f"{what} is on {t.device}, expected {device}")


def check_placement(engine, device: torch.device, *, host_shards: bool = False,
                    host_optimizer: bool = False) -> str:
    cpu = torch.device("cpu")
    engine.wait_for_weights()
    for name, b in engine.module.named_buffers():
        expect_device(f"buffer {name}", b, device)
    for u in engine.units:
        if u.state.value == "gathered":
            for s in u.slots:
                expect_device(f"parameter {s.fqn}", s.param.data, device)
        expect_device(f"{u.name}.shard", u.shard, cpu if host_shards else device)
        if host_shards and device.type == "cuda" and u.shard is not None and not u.shard.is_pinned():
            raise AssertionError(f"{u.name}.shard is on the host but not pinned")
        if u.trainable:
            expect_device(f"{u.name}.master", u.master, device)
            expect_device(f"{u.name}.master_grad", u.master_grad, device)
            if host_optimizer and u.host_numel == 0:
                raise AssertionError(f"{u.name} has no host part with offload_optimizer cpu")
    states = [v for st in engine.optimizer.state.values() for v in st.values() if torch.is_tensor(v)
              and v.numel() > 1]
    for v in states:
        expect_device("optimizer state", v, device)
    hosted = sum(u.host_numel for u in engine.units if u.trainable)
    return (f"params/buffers/master/grads on {device}, {len(states)} device optimizer-state tensors, "
            f"{hosted} elements stepped on the host")


def compare(losses, ref_losses, weights, ref_weights, tol: float) -> str:
    worst_loss = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(losses, ref_losses))
    worst_w = max((weights[k].to(v.device) - v).abs().max().item() for k, v in ref_weights.items())
    if worst_loss > tol or worst_w > tol:
        raise AssertionError(f"vs torch: loss rel diff {worst_loss:.2e}, weight max abs diff "
                             f"{worst_w:.2e} (tolerance {tol:g}); losses {losses} vs {ref_losses}")
    return f"losses {[round(v, 4) for v in losses]} match torch (rel {worst_loss:.1e}, w {worst_w:.1e})"


class SyncCounter:
    """Host syncs by source line: sync-debug warnings (item/cpu/tolist/blocking copies) and
    CUDA event waits (rank agreement's lagged checks)."""

    def __init__(self) -> None:
        self.where: collections.Counter[str] = collections.Counter()

    def __enter__(self) -> "SyncCounter":
        self._warn = warnings.catch_warnings(record=True)
        self._caught = self._warn.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        self._event_sync = torch.cuda.Event.synchronize
        counter = self

        def synchronize(ev):
            frame = sys._getframe(1)
            counter.where[f"Event.synchronize @ {_short(frame.f_code.co_filename)}:{frame.f_lineno}"] += 1
            return counter._event_sync(ev)
        torch.cuda.Event.synchronize = synchronize
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.Event.synchronize = self._event_sync
        for w in self._caught:
            if "synchroniz" in str(w.message):
                self.where[f"{str(w.message).split('.')[0][:40]} @ {_short(w.filename)}:{w.lineno}"] += 1
        self._warn.__exit__(*exc)

    def total(self) -> int:
        return sum(self.where.values())


def _short(path: str) -> str:
    return path.split("src/")[-1] if "src/" in path else os.path.basename(path)


def main() -> int:
    dry = "--dry-run-on-cpu" in sys.argv[1:]
    if not torch.cuda.is_available() and not dry:
        print("FAIL setup: no CUDA device visible")
        print("SUMMARY: 0 passed, 1 failed")
        return 1
    import zerokit

    count = torch.cuda.device_count() if not dry else 1
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    mode = "torchrun" if "RANK" in os.environ else "no launcher"
    name = torch.cuda.get_device_name(0) if not dry else "dry run on the CPU"
    print(f"gpu_check: {mode}, LOCAL_WORLD_SIZE={local_world}, {count} GPU(s): {name}, "
          f"torch {torch.__version__}", flush=True)

    if local_world > count:  # the launch must be refused at initialize, naming both counts
        @case(f"refuse {local_world} local ranks on {count} GPU(s)")
        def _():
            try:
                zerokit.initialize(model=make_gpt(), config=config(0))
            except ValueError as e:
                if f"{local_world} local ranks" in str(e) and f"{count} CUDA device" in str(e):
                    return f"ValueError: {e}"
                raise AssertionError(f"the error does not name both counts: {e}") from e
            raise AssertionError("initialize accepted more local ranks than GPUs")
        return _finish()

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if not dry else \
        torch.device("cpu")
    ref_losses, ref_weights = reference(device)

    for stage in (0, 1, 2, 3):
        @case(f"stage {stage} fp32 on {device}")
        def _(stage=stage):
            engine, *_ = zerokit.initialize(model=make_gpt(), config=config(stage))
            if engine.device != device or (not dry and torch.cuda.current_device() != device.index):
                raise AssertionError(f"engine.device {engine.device}, current device "
                                     f"{torch.cuda.current_device()}, expected {device}")
            losses = train(engine, device)
            text = compare(losses, ref_losses, engine.consolidated_fp32_state_dict(), ref_weights, 2e-4)
            text += "; " + check_placement(engine, device)
            engine.destroy()
            return text

    @case("stage 3 bf16")
    def _():
        cfg = dict(config(3), bf16={"enabled": True})
        engine, *_ = zerokit.initialize(model=make_gpt(), config=cfg)
        losses = train(engine, device)
        if not all(abs(a - b) < 0.05 * abs(b) for a, b in zip(losses, ref_losses)):
            raise AssertionError(f"bf16 losses {losses} far from fp32 {ref_losses}")
        text = check_placement(engine, device)
        engine.destroy()
        return f"losses {[round(v, 3) for v in losses]}; {text}"

    @case("stage 3 offload_param cpu")
    def _():
        engine, *_ = zerokit.initialize(model=make_gpt(), config=config(
            3, offload_param={"device": "cpu", "pin_memory": True}))
        losses = train(engine, device)
        text = compare(losses, ref_losses, engine.consolidated_fp32_state_dict(), ref_weights, 2e-4)
        text += "; " + check_placement(engine, device, host_shards=True)
        engine.destroy()
        return text

    @case("stage 2 offload_optimizer cpu")
    def _():
        engine, *_ = zerokit.initialize(model=make_gpt(), config=config(
            2, offload_optimizer={"device": "cpu", "pin_memory": True}))
        losses = train(engine, device)
        text = compare(losses, ref_losses, engine.consolidated_fp32_state_dict(), ref_weights, 2e-3)
        text += "; " + check_placement(engine, device, host_optimizer=True)
        engine.destroy()
        return text

    def final_weights(cfg: dict) -> tuple[dict[str, torch.Tensor], Any]:
        engine, *_ = zerokit.initialize(model=make_gpt(), config=cfg)
        train(engine, device)
        out = engine.consolidated_fp32_state_dict()
        counts = dict(vars(engine.speculation))
        engine.destroy()
        return out, counts

    def bit_equal(a: dict, b: dict) -> None:
        bad = [k for k in a if not torch.equal(a[k], b[k])]
        if bad:
            k = bad[0]
            raise AssertionError(f"{len(bad)} tensors differ, e.g. {k}: max "
                                 f"{(a[k].double() - b[k].double()).abs().max().item():.3g}")

    for clip, want in ((1e-3, "redone"), (0.0, "committed")):
        @case(f"stage 2 offload_optimizer cpu, Twin-Flow 0.5, speculative step ({want}) = step()")
        def _(clip=clip, want=want):
            def cfg(sib: bool) -> dict:
                c = config(2, offload_optimizer={"device": "cpu", "pin_memory": True, "ratio": 0.5,
                                                 "step_in_backward": sib, "speculation": "always"})
                return dict(c, gradient_clipping=clip)
            spec, counts = final_weights(cfg(True))
            base, _ = final_weights(cfg(False))
            bit_equal(spec, base)
            if counts[want] != STEPS:
                raise AssertionError(f"speculation counts {counts}, expected {want}={STEPS}")
            return f"bit-equal after {STEPS} steps; {counts}"

    @case("stage 2 bf16 master + optimizer states: device part (CUDA) = host part, bit for bit")
    def _():
        def cfg(offload: dict | None) -> dict:
            c = dict(config(2, **({"offload_optimizer": offload} if offload else {})))
            c["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True,
                         "bf16_optimizer_states": True}
            return c
        on_device, _ = final_weights(cfg(None))
        on_host, _ = final_weights(cfg({"device": "cpu", "pin_memory": True}))
        bit_equal(on_device, on_host)
        return f"bit-equal after {STEPS} steps ({len(on_device)} tensors)"

    @case("a model already on the GPU stays there")
    def _():
        model = make_gpt().to(device)
        engine, *_ = zerokit.initialize(model=model, config=config(1))
        train(engine, device)
        where = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
        if where != {device}:
            raise AssertionError(f"model tensors on {where}, expected only {device}")
        engine.destroy()
        return f"every parameter and buffer on {device}"

    if dry:
        return _finish()

    @case("host syncs per stage-3 step")
    def _():
        engine, *_ = zerokit.initialize(model=make_gpt(), config=config(3))
        data = batches(device, 6)
        for x, y in data[:2]:  # record the order, warm up
            engine.backward(loss_of(engine(x, y)))
            engine.step()
        torch.cuda.synchronize()
        with SyncCounter() as syncs:
            for x, y in data[2:]:
                engine.backward(loss_of(engine(x, y)))
                engine.step()
        torch.cuda.synchronize()
        engine.destroy()
        per_step = syncs.total() / len(data[2:])
        where = "; ".join(f"{k} x{v}" for k, v in syncs.where.most_common())
        units = len(engine.units)
        if per_step >= units:
            raise AssertionError(f"{per_step:g} syncs per step for {units} units: {where}")
        return f"{per_step:g} per step ({units} units, world {engine.comm.world_size}): {where or 'none'}"

    if mode == "torchrun":
        agreement_cost(device)
    return _finish()


def agreement_cost(device: torch.device) -> None:
    """The NCCL rank-agreement check (world 1 NCCL group: the same calls, no peer) against the
    blocking check it replaced, each issued once per "unit" behind 1 ms-ish of queued GPU work."""
    import torch.distributed as dist

    from zerokit.comm.agreement import LaggedChecks, Signature

    a = torch.randn(2048, 2048, device=device)

    def blocking(values: list[int]) -> None:  # the old Comm.first_disagreement
        mine = torch.tensor(values, dtype=torch.int64, device=device)
        both = torch.cat([mine, -mine])
        dist.all_reduce(both, dist.ReduceOp.MAX)
        _ = both[:1].cpu(), -both[1:].cpu()

    def lagged_run(checks: LaggedChecks, i: int) -> None:
        checks.launch(Signature(1, i % 8, 4096), f"unit #{i % 8}")

    def timed(fn, n: int = 64) -> tuple[float, float, int]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with SyncCounter() as syncs:
            for i in range(n):
                for _ in range(4):
                    a @ a  # ~ a unit's compute, queued
                fn(i)
            host = (time.perf_counter() - t0) / n
        torch.cuda.synchronize()
        return host * 1e6, (time.perf_counter() - t0) / n * 1e6, syncs.total()

    @case("rank-agreement cost on CUDA (NCCL world 1)")
    def _():
        def mismatch(*args) -> None:
            raise AssertionError(f"a world of 1 cannot disagree: {args}")
        checks = LaggedChecks(device, mismatch)
        timed(lambda i: lagged_run(checks, i), 8)
        old_host, old_total, old_syncs = timed(lambda i: blocking([i % 8]))
        new_host, new_total, new_syncs = timed(lambda i: lagged_run(checks, i))
        checks.settle()
        return (f"per unit: blocking check {old_host:.0f} us host ({old_syncs} syncs / 64 units, "
                f"wall {old_total:.0f} us); lagged check {new_host:.0f} us host ({new_syncs} syncs "
                f"/ 64 units, wall {new_total:.0f} us)")


def _finish() -> int:
    failed = [r for r in RESULTS if not r[1]]
    print(f"SUMMARY: {len(RESULTS) - len(failed)} passed, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
