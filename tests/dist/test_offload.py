"""ZeRO-Offload, Twin-Flow and the delayed parameter update (zero_optimization.offload_optimizer).

- parity: offload (ratio 1), Twin-Flow (0.4) and ratio 0 give the weights of the same run without
  offload, for stages 1, 2, 3 x fp32 / bf16 x world 1 and 2, with clipping (the host kernel's
  fused grad_scale), gradient accumulation, an LR schedule, Adagrad, Lion and a user torch.optim
  instance. fp32 within rtol 1e-6; bf16 within test_parity.py's two-part bound.
- ratio "auto": measures host and device rates, picks a ratio in [0, 1] and says why (the plan).
- delayed update: equals a one-process reference whose gradients, after the warm-up, are computed
  on the weights one update behind; with Twin-Flow (ratio 0.4) on weights whose host part is one
  update behind and whose device part is current.
- ledger: device bytes per rank drop by the host part's master (16-bit compute only: in fp32 the
  master is the weights) + 8 B of Adam state + 4 B of gradient per element, and those bytes
  appear on the host tier.
"""
from __future__ import annotations

import pytest
import torch

from harness import run_world
from reference import engine_train, global_batches, reference_train, tiny_gpt
from fast_tier import slow_except

STEPS, MICRO, LR = 4, 2, 1e-3
OPT = {"AdamW": {"lr": LR, "weight_decay": 0.1}, "Adagrad": {"lr": 1e-2, "weight_decay": 0.01},
       "Lion": {"lr": 1e-4, "weight_decay": 0.1}}
# (stage, dtype, gas, optimizer, extra) -> compared at these ratios (None: offload off).
BASE = [(stage, dtype, 1, "AdamW", "") for stage in (1, 2, 3) for dtype in ("fp32", "bf16")]
EXTRA = [(2, "fp16", 1, "AdamW", ""), (2, "bf16", 2, "AdamW", ""), (1, "bf16", 2, "AdamW", ""), (2, "fp32", 1, "Adagrad", ""),
         (3, "fp32", 1, "Lion", ""), (2, "fp32", 1, "AdamW", "schedule"),
         (1, "fp32", 1, "AdamW", "user_adam")]
RATIOS = {case: (1.0, 0.4) for case in BASE + EXTRA}
RATIOS.update({(2, "fp32", 1, "AdamW", ""): (0.0, 0.4, 1.0), (2, "bf16", 1, "AdamW", ""): (0.0, 0.4, 1.0, "auto"),
               (3, "fp32", 1, "Lion", ""): (1.0, 0.4, 0.0)})


def _config(stage, dtype, gas, opt, extra, ratio, delayed=None) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 2000}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0)
    if ratio is not None:
        zero["offload_optimizer"] = {"device": "cpu", "ratio": ratio,
                                     **({"delayed_update": delayed} if delayed else {})}
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
           "gradient_clipping": 1.0, "bf16": {"enabled": dtype == "bf16"}, "zero_optimization": zero,
           # fp16: a loss scale high enough to overflow in the first steps (skipped-step path)
           "fp16": {"enabled": dtype == "fp16", "initial_scale_power": 20, "hysteresis": 1}}
    if extra != "user_adam":
        cfg["optimizer"] = {"type": opt, "params": OPT[opt]}
    if extra == "schedule":
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": LR,
                                                            "warmup_num_steps": 3}}
    return cfg


def _train(rank, world, cfg, steps=STEPS, gas=1, user_adam=False, check_delay_after=None):
    import zerokit

    model = tiny_gpt()
    opt = torch.optim.Adam(model.parameters(), lr=LR, weight_decay=0.01) if user_adam else None
    engine, _, _, _ = zerokit.initialize(model=model, optimizer=opt, config=cfg)

    def delay_still_running(i: int) -> None:
        if check_delay_after is not None and i >= check_delay_after:
            assert engine.offload._worker is not None, "the delayed host update was joined in step()"

    losses = engine_train(engine, global_batches(steps, MICRO * world * gas), rank, world, gas,
                          after_step=delay_still_running)
    out = (losses, engine.consolidated_fp32_state_dict(), _ledger(engine))
    engine.destroy()
    return out


def _ledger(engine) -> dict:
    led = engine.ledger
    table = {(t, k): led.bytes(tier=t, kind=k) for t in ("device", "host")
             for k in ("weights", "grads", "master", "optimizer_state", "buffers")}
    table["host_numel"] = sum(u.host_numel for u in engine.units)
    table["opt_numel"] = sum(u.opt_range[1] - u.opt_range[0] for u in engine.units if u.trainable)
    table["units"] = len(engine.units)
    table["skipped"] = engine.skipped_steps
    return table


def _parity_world(rank: int, world: int) -> dict:
    out = {}
    for case, ratios in RATIOS.items():
        stage, dtype, gas, opt, extra = case
        for ratio in (None,) + ratios:
            out[case, ratio] = _train(rank, world, _config(*case, ratio), gas=gas,
                                      user_adam=extra == "user_adam")
    return out


def _close(case, got, want, lr=LR, steps=STEPS) -> None:
    (losses, weights, _), (ref_losses, ref_weights, _) = got, want
    if case[1] == "fp32":
        # The host kernel and torch's optimizer order a few fp32 operations differently (about an
        # ulp of an update); where a gradient element is near zero, Adam/Adagrad's normalisation
        # can grow that to a small fraction of the step: hence an absolute floor of lr x 1e-4.
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=1e-7)
        for name, w in ref_weights.items():
            torch.testing.assert_close(weights[name], w, rtol=1e-6, atol=lr * 1e-4,
                                       msg=lambda m: f"{case} {name}: {m}")
        return
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-2, atol=0)
    outside = total = 0
    for name, w in ref_weights.items():  # test_parity.py's bf16 bound
        torch.testing.assert_close(weights[name], w, rtol=0, atol=2 * lr * steps,
                                   msg=lambda m: f"{case} {name}: {m}")
        outside += int((~((weights[name] - w).abs() <= lr / 10 + 2 ** -8 * w.abs())).sum())
        total += w.numel()
    assert outside <= total * 1e-3, f"{case}: {outside} of {total} elements beyond lr/10"


def _check_ledger(case, ratio, off: dict, on: dict, world: int) -> None:
    k = on["host_numel"]
    # The split is rounded to 64 elements per unit; otherwise it is the ratio of the shard.
    assert abs(k - ratio * on["opt_numel"]) <= 64 * on["units"], (case, ratio, k, on["opt_numel"])
    master = 4 if case[1] != "fp32" else 0  # fp32: the device master is the weights themselves
    dev = lambda t: sum(v for key, v in t.items() if isinstance(key, tuple) and key[0] == "device")  # noqa: E731
    # Adam's per-tensor step counters (4 B per unit) stay with torch's optimizer.
    assert abs((dev(off) - dev(on)) - k * (master + 8 + 4)) <= 8 * on["units"], (case, ratio, off, on)
    # the host gradient in 16 bits where that is exact: one micro-step, and fp16's 16-bit reduction
    # or bf16 at one rank ([Note: 16-bit offloaded gradients] in engine/precision.py)
    sixteen = case[2] == 1 and (case[1] == "fp16" or (case[1] == "bf16" and world == 1))
    assert on["host", "master"] == 4 * k and on["host", "grads"] == (2 if sixteen else 4) * k
    assert on["host", "optimizer_state"] == 8 * k
    assert on["device", "weights"] == off["device", "weights"]


@pytest.mark.parametrize("world", slow_except([1, 2], fast=[1]))
def test_offload_matches_no_offload(world: int) -> None:
    results = [_parity_world(0, 1)] if world == 1 else run_world(_parity_world, world, timeout=300)
    for rank_result in results:
        for case, ratios in RATIOS.items():
            off = rank_result[case, None]
            for ratio in ratios:
                lr = 1e-2 if case[3] == "Adagrad" else LR
                _close((*case, ratio), rank_result[case, ratio], off, lr=lr)
                assert rank_result[case, ratio][2]["skipped"] == off[2]["skipped"], (case, ratio)
                if case[1] == "fp16":  # the overflow path ran: steps were skipped, then taken
                    assert 0 < off[2]["skipped"] < STEPS, off[2]["skipped"]
                if case[3] == "AdamW" and case[4] == "" and ratio != "auto":
                    _check_ledger(case, ratio, off[2], rank_result[case, ratio][2], world)


# ---- the delayed parameter update ------------------------------------------------------------
DELAY_STEPS, WARMUP = 6, 2


def stale_reference(batches, warmup: int, clip: float = 1.0, stale_mask: dict | None = None):
    """torch AdamW on fp32 weights where, after `warmup` + 1 fresh steps, each gradient is computed
    on the weights one update behind (ZeRO-Offload's one-step delayed parameter update: step t's
    update runs while step t+1 computes its gradient on the weights before it).

    stale_mask (name -> bool tensor): only these elements are one update behind (Twin-Flow: the
    host part is delayed, the device part is updated at once)."""
    master = tiny_gpt()
    compute = tiny_gpt()
    opt = torch.optim.AdamW(master.parameters(), **OPT["AdamW"])
    names = [n for n, _ in master.named_parameters()]
    history = [[p.detach().clone() for p in master.parameters()]]  # weights after n updates
    losses = []
    for t, (x, y) in enumerate(batches):
        used = history[t - 1] if t >= warmup + 1 else history[t]
        if stale_mask is not None and t >= warmup + 1:
            used = [torch.where(stale_mask[n], old, new)
                    for n, old, new in zip(names, history[t - 1], history[t])]
        with torch.no_grad():
            for pc, w in zip(compute.parameters(), used):
                pc.copy_(w)
        loss = compute(x, y)
        loss.backward()
        for pc, pm in zip(compute.parameters(), master.parameters()):
            pm.grad, pc.grad = pc.grad, None
        torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
        opt.step()
        opt.zero_grad()
        history.append([p.detach().clone() for p in master.parameters()])
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in master.named_parameters()}


def _host_masks(engine) -> dict[str, torch.Tensor]:
    """name -> which elements every rank steps on the host (the first host_numel of each shard)."""
    masks = {}
    for u in engine.units:
        flat = torch.zeros(u.padded_numel, dtype=torch.bool)
        for r in range(engine.comm.world_size):
            flat[r * u.shard_numel:r * u.shard_numel + u.host_numel] = True
        masks.update(u.split(flat))
    return masks


def _delayed_world(rank: int, world: int) -> dict:
    import zerokit

    out = {}
    for ratio in (1.0, 0.4):
        for stage in (1, 2, 3):
            cfg = _config(stage, "fp32", 1, "AdamW", "", ratio,
                          delayed={"enabled": True, "warmup_steps": WARMUP})
            out[stage, ratio] = _train(rank, world, cfg, steps=DELAY_STEPS, check_delay_after=WARMUP)
        engine, *_ = zerokit.initialize(model=tiny_gpt(), config=cfg)  # the split, for the reference
        out["masks", ratio] = _host_masks(engine)
        engine.destroy()
    return out


@pytest.mark.parametrize("world", slow_except([1, 2], fast=[1]))
def test_delayed_update_matches_stale_reference(world: int) -> None:
    results = [_delayed_world(0, 1)] if world == 1 else run_world(_delayed_world, world, timeout=300)
    batches = global_batches(DELAY_STEPS, MICRO * world)
    fresh_losses, _ = stale_reference(batches, DELAY_STEPS)
    for rank_result in results:
        for ratio in (1.0, 0.4):
            masks = rank_result["masks", ratio]
            if ratio == 1.0:
                assert all(bool(m.all()) for m in masks.values())
            else:  # both parts exist, so both staleness rules are exercised
                share = sum(int(m.sum()) for m in masks.values()) / sum(m.numel() for m in masks.values())
                assert 0.3 < share < 0.5, share
            ref_losses, ref = stale_reference(batches, WARMUP, stale_mask=masks)
            assert ref_losses[WARMUP + 1:] != fresh_losses[WARMUP + 1:]  # the staleness is visible
            for stage in (1, 2, 3):
                losses, weights, _ = rank_result[stage, ratio]
                torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                                           atol=1e-6, msg=lambda m: f"stage {stage} ratio {ratio}: {m}")
                for name, w in ref.items():
                    torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-6,
                                               msg=lambda m: f"stage {stage} ratio {ratio} {name}: {m}")


# ---- Lion on the device (torch) and on the host (native kernel) -------------------------------
class PublishedLion(torch.optim.Optimizer):
    """Lion as published (Chen et al. 2023, Algorithm 2), plain torch per tensor: the reference."""

    def __init__(self, params, lr: float, weight_decay: float, betas=(0.9, 0.99)):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, betas=betas))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            (b1, b2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
            for p in group["params"]:
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                p.mul_(1 - lr * wd)
                p.add_((m * b1 + p.grad * (1 - b1)).sign(), alpha=-lr)
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


LION_SPLITS = {0: (None,), 1: (None, 0.4), 2: (None, 0.0, 0.4, 1.0), 3: (None, 0.0, 0.4, 1.0)}


def _lion_world(rank: int, world: int) -> dict:
    return {(stage, ratio): _train(rank, world, _config(stage, "fp32", 1, "Lion", "", ratio))[:2]
            for stage, ratios in LION_SPLITS.items() for ratio in ratios}


@pytest.mark.slow
def test_lion_at_every_stage_and_split_matches_one_process_reference() -> None:
    """optimizer {type: Lion}: torch's Lion steps the device part, the native kernel the host part
    (Twin-Flow 0 < r < 1 has both); every stage, with and without offload, equals torch Lion on
    the whole model in one process."""
    world = 2
    ref_losses, ref = reference_train(tiny_gpt, lambda ps: PublishedLion(ps, **OPT["Lion"]),
                                      global_batches(STEPS, MICRO * world), clip=1.0)
    lr = OPT["Lion"]["lr"]
    for rank_result in run_world(_lion_world, world, timeout=300):
        for (stage, ratio), (losses, weights) in rank_result.items():
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=1e-7)
            for name, w in ref.items():
                torch.testing.assert_close(weights[name], w, rtol=1e-6, atol=lr * 1e-4,
                                           msg=lambda m: f"stage {stage} ratio {ratio} {name}: {m}")


_CUDA_LION = """if True:
    import json, sys, torch, zerokit
    sys.path[:0] = sys.argv[1:3]
    from reference import engine_train, global_batches, tiny_gpt
    from test_offload import _config
    out = {}
    for stage, ratio in [(1, None), (2, 1.0), (2, 0.4), (3, 0.4), (3, 1.0)]:
        engine, *_ = zerokit.initialize(model=tiny_gpt(), config=_config(stage, "fp32", 1, "Lion", "", ratio))
        assert engine.comm.device.type == "cuda"
        engine_train(engine, global_batches(4, 2), 0, 1)
        sd = engine.consolidated_fp32_state_dict()
        out[f"{stage}-{ratio}"] = {k: v.cpu().tolist() for k, v in sd.items()}
        engine.destroy()
    print(json.dumps(out))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the device part of Lion)")
def test_lion_with_a_cuda_device_part(tmp_path) -> None:
    """One NCCL rank on the GPU: Lion's device part (empty at ratio 1, a share at 0.4) steps."""
    import json
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", _CUDA_LION, here, os.path.join(here, "dist")],
                         env=env, capture_output=True, text=True, timeout=300, cwd=here)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    _, ref = reference_train(tiny_gpt, lambda ps: PublishedLion(ps, **OPT["Lion"]),
                             global_batches(4, 2), clip=1.0)
    for case, weights in results.items():
        for name, w in ref.items():
            # GPU and CPU kernels of the forward differ by float noise; Lion moves by +-lr, so
            # a bound far below lr still catches a wrong update.
            torch.testing.assert_close(torch.tensor(weights[name]), w, rtol=0, atol=OPT["Lion"]["lr"] / 10,
                                       msg=lambda m: f"{case} {name}: {m}")


# ---- errors ------------------------------------------------------------------------------------
def test_offload_errors_name_the_problem() -> None:
    import zerokit
    from zerokit.config import ConfigError

    base = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": LR}}}
    with pytest.raises(ConfigError, match="offload_optimizer.device 'cpu' needs stage 1, 2 or 3"):
        zerokit.initialize(model=tiny_gpt(), config={**base, "zero_optimization": {
            "stage": 0, "offload_optimizer": {"device": "cpu"}}})
    with pytest.raises(ConfigError, match=r"ratio must be in \[0, 1\]"):
        zerokit.initialize(model=tiny_gpt(), config={**base, "zero_optimization": {
            "stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}})
    sgd = {**base, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(TypeError, match="torch.optim.sgd.SGD has no host kernel; offload supports"):
        zerokit.initialize(model=tiny_gpt(), config=sgd)


def test_auto_ratio_picks_and_explains() -> None:
    import zerokit
    from zerokit.config.plan import explain

    engine, *_ = zerokit.initialize(model=tiny_gpt(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": "auto"}}})
    placement = engine.placement
    assert 0.0 <= placement.ratio <= 1.0 and not placement.auto
    assert "elements/s" in placement.auto_reason and "auto:" in explain(engine)
    assert sum(u.host_numel for u in engine.units) == sum(
        placement.host_numel(u.opt_range[1] - u.opt_range[0]) for u in engine.units)
    engine.destroy()


def test_gathered_edit_reaches_host_master_under_delayed_update() -> None:
    """An edit through GatheredParameters lands in the host master and survives the delayed
    update's write-back of weights computed before it."""
    import zerokit
    from zerokit.zero import GatheredParameters

    model = tiny_gpt()
    engine, *_ = zerokit.initialize(model=model, config=_config(
        3, "bf16", 1, "AdamW", "", 1.0, delayed={"enabled": True, "warmup_steps": 0}))
    batches = global_batches(3, MICRO)
    for x, y in batches[:2]:
        engine.backward(engine(x, y))
        engine.step()  # the second step's host update is still in flight
    weight = model.transformer.h[1].mlp.c_fc.weight
    with GatheredParameters([weight], modifier_rank=0):
        with torch.no_grad():
            weight.fill_(0.5)
    name = "transformer.h.1.mlp.c_fc.weight"
    assert torch.equal(engine.consolidated_fp32_state_dict()[name], torch.full_like(weight, 0.5))
    x, y = batches[2]
    engine.backward(engine(x, y))  # runs on the edited weights (the write-back kept the edit)
    engine.step()
    with GatheredParameters(weight):
        moved = (weight.detach().float() - 0.5).abs()
    assert moved.max() < 0.01, moved.max()  # one update (lr 1e-3) away from the edit, not undone
    engine.destroy()


@pytest.mark.slow
def test_exit_with_a_delayed_update_in_flight_is_clean() -> None:
    """A process that ends while the host worker still runs the delayed update must not abort
    (interpreter shutdown would unwind the daemon thread out of the native kernel)."""
    import subprocess
    import sys

    code = """if True:
        import torch, zerokit
        from zerokit.models import GPT, GPTConfig
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=6, n_embd=512, n_head=8, block_size=32, vocab_size=256))
        engine, *_ = zerokit.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {
                "device": "cpu", "delayed_update": {"enabled": True, "warmup_steps": 0}}}})
        t = torch.randint(0, 256, (1, 33))
        for _ in range(2):
            engine.backward(engine(t[:, :-1].contiguous(), t[:, 1:].contiguous()))
            engine.step()
        print("in flight:", engine.offload._worker is not None)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "terminate called" not in out.stderr, (out.returncode, out.stderr[-2000:])
    assert "in flight: True" in out.stdout


# ---- ratio "auto": the decision follows the measured rates ---------------------------------------
@pytest.mark.parametrize("host,device,free_fraction,want", [
    (1e9, 3e9, None, 0.25), (2e8, 2e8, None, 0.5), (3e9, 1e9, None, 0.75),  # balanced: h / (h + d)
    (1e9, 3e9, 4.0, 0.25),     # the device part fits easily: the balance stands
    (1e9, 3e9, 0.5, 0.75),     # half the need free: 1 - 0.5 * 0.5 = 0.75 on the host at least
    (3e9, 1e9, 1.0, 0.75),     # floor 0.5 below the balance 0.75: the balance stands
    (1e9, 1e9, 0.0, 1.0),      # no device memory free: everything on the host
])
def test_auto_ratio_balances_the_measured_rates(host, device, free_fraction, want) -> None:
    from zerokit.engine.auto_ratio import balance

    need = 16 * 10_000
    ratio, why = balance(host, device, need, None if free_fraction is None else int(free_fraction * need))
    assert ratio == pytest.approx(want, abs=1e-12), why
    assert ("raised to" in why) == (want > host / (host + device) + 1e-12), why


@pytest.mark.parametrize("host,device,free_fraction", [(1e9, 3e9, None), (3e9, 1e9, None), (1e9, 3e9, 0.5)])
def test_auto_ratio_uses_the_measured_rates(monkeypatch, host, device, free_fraction) -> None:
    """initialize() places what the decision says for the rates measured (injected here) and the
    device memory free (simulated: a CPU run has no floor of its own)."""
    import zerokit
    from zerokit.engine import auto_ratio

    monkeypatch.setattr(auto_ratio, "measure_rates", lambda dev: (host, device))
    need = {}

    def free(dev):
        return None if free_fraction is None else int(free_fraction * need["bytes"])
    monkeypatch.setattr(auto_ratio, "device_free_bytes", free)
    model = tiny_gpt()
    # bf16: fp32 master 4 + Adam 8 + gradient 4 bytes per optimizer element on the device.
    need["bytes"] = 16 * sum(p.numel() for p in model.parameters())
    engine, *_ = zerokit.initialize(model=model, config=_config(2, "bf16", 1, "AdamW", "", "auto"))
    balanced = host / (host + device)
    opt_numel = sum(u.opt_range[1] - u.opt_range[0] for u in engine.units)
    # The need is counted over the padded optimizer ranges, as the engine lays them out.
    want = balanced if free_fraction is None else max(balanced, 1 - 0.5 * free_fraction * need["bytes"] /
                                                      (16 * opt_numel))
    assert engine.placement.ratio == pytest.approx(want, abs=1e-9), engine.placement.auto_reason
    assert f"{host / 1e6:.0f} M elements/s" in engine.placement.auto_reason
    host_numel = sum(u.host_numel for u in engine.units)
    assert abs(host_numel - want * opt_numel) <= 64 * len(engine.units), (host_numel, want, opt_numel)
    engine.destroy()
