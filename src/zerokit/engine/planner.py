"""Budgets in, placement out: the placement planner.

[Note: the placement planner]
With a memory budget given (`memory.host` / `device` / `nvme`) and a placement key left to it
(`offload_optimizer.device` / `offload_param.device` "auto" or their sections left out; with a
device 'nvme' given, its max_in_cpu left out), initialize asks `choose` for the placement:
1. candidates: every combination of the keys left free (hand-set keys are kept as given):
   stage-3 weights on device / cpu / nvme, the optimizer on device / cpu / nvme (nvme only where
   an nvme_path is given), the Twin-Flow ratio (1, and on a CUDA device also the ratio at which
   host and device Adam finish together, engine/auto_ratio.py `balance`), step_in_backward on
   and off, offload_optimizer.buffer_count 4 and 3, offload_param.buffer_count 5 and 2, and
   (optimizer on NVMe, stepped in step()) offload_optimizer.nvme_gradients 'file' and 'host'
   (the gradients held in RAM: 4 bytes per element there, no gradient files; where not every
   part's fits, nvme_gradients_max_in_cpu takes four points up to the most whole parts' RAM
   holds, the other parts' gradients in files: `_grad_points`). For each, offload_param.max_in_cpu
   takes five points between none and the most whole shards RAM holds, then the gradients'
   points, and offload_optimizer.max_in_cpu the most elements the host budget then holds
   (bisection).
2.-3. bytes and time: each candidate is priced by engine/candidate_cost.py ([Note: what a
   candidate costs]): its bytes per tier and kind from the byte rules, checked against each
   tier's budget, and its step time from the measured bandwidths.
4. choice: hot data stays in the fastest tier that fits: if any candidate without NVMe bytes
   fits, no candidate with them is chosen; then a candidate with the NVMe stream's full
   read-ahead (buffer_count 4) over one with 3 unless the best with 3 is predicted more than
   READ_AHEAD_MARGIN (5%) faster: the time model cannot see the read-ahead, which measured 0.94x
   to 1.3x of the step at one placement (docs/offload.md), so only a placement the model says is
   clearly faster (weights kept in RAM) outweighs it; among the rest, the fastest. Rank 0 logs every
   candidate with its predicted time and bytes per tier, and why the chosen one won. No
   candidate fitting raises PlacementBudgetError with the closest one's bytes per tier and kind
   and the smallest budget per tier that some candidate fits.
5. the chosen keys are written into the config's offload sections (and engine.config's dict), so
   everything after reads them as if set by hand.
6. beside the placement, the size keys left out (reduce_bucket_size, stage3_prefetch_bucket_size,
   sub_group_size) from the all-gather's measured latency and bandwidth, the units and the
   budget: engine/size_plan.py, [Note: choosing the sizes]; in `Plan.sizes` and the log.
Not measured: activations (rss_margin holds them). Inherited pessimism: the byte rules count
every offloaded element's gradient as held when stepping in backward
(host_budget.speculation_need), so large models rarely get step_in_backward from the planner.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from zerokit.engine import bf16_state
from zerokit.engine.auto_ratio import balance
from zerokit.engine.bandwidths import Bandwidths
from zerokit.engine.byte_plan import plan_layouts, planned_bytes
from zerokit.engine.candidate_cost import budget_checks, step_time
from zerokit.engine.precision import with_gradient_dtype
from zerokit.policy import PartitionPolicy, PlacementPolicy
from zerokit.policy.placement import SPLIT_ALIGN
from zerokit.sizes import mib
from zerokit.tier_names import TierName

OPT_BUFFER_COUNTS = (4, 3)  # the NVMe stream: read i+1, update i, write i-1 needs 3; 4 preferred
PARAM_BUFFER_COUNTS = (5, 2)  # weight shards read ahead (DeepSpeed's default 5)
PARAM_GRID = (0.0, 0.25, 0.5, 0.75, 1.0)  # offload_param.max_in_cpu points, of what RAM holds
GRAD_GRID = (0.25, 0.5, 0.75, 1.0)  # nvme_gradients_max_in_cpu points, of what RAM holds
TIE = 0.005  # predicted times this close are a tie
# A candidate with fewer stream buffers than OPT_BUFFER_COUNTS[0] is taken over every fitting one
# with the full read-ahead only when predicted this much faster: the time model cannot see the
# read-ahead, and at one placement it measured 0.94x-1.04x of the step on 2026-12-07 (1B, 3B)
# but 1.3x once at 1B (docs/offload.md); what 3 buffers free for max_in_cpu is worth less.
READ_AHEAD_MARGIN = 0.05


class PlacementBudgetError(MemoryError):
    """No placement fits the memory budgets; `considered`: the predictions refused."""

    considered: list = []


@dataclass(frozen=True)
class Choice:
    """One candidate: the placement keys it sets ("-": not applicable)."""

    param: str = "none"          # offload_param.device (stage 3)
    param_max_in_cpu: int = 0
    param_buffer_count: int = 5
    optimizer: str = "none"      # offload_optimizer.device
    ratio: float = 1.0
    opt_max_in_cpu: int = 0
    opt_buffer_count: int = 4
    step_in_backward: bool = False
    nvme_grads_held: bool = False  # offload_optimizer.nvme_gradients 'host' (without step_in_backward)
    grad_max_in_cpu: int | None = None  # with nvme_grads_held: nvme_gradients_max_in_cpu (None: all)

    def keys(self, nvme_path: str | None) -> dict[str, dict[str, Any]]:
        """The config keys this choice sets, per offload section."""
        opt: dict[str, Any] = {"device": self.optimizer}
        if self.optimizer != "none":
            opt.update(ratio=self.ratio, step_in_backward=self.step_in_backward)
        else:
            opt.update(step_in_backward=False)
        if self.optimizer == "nvme":
            opt.update(max_in_cpu=self.opt_max_in_cpu, buffer_count=self.opt_buffer_count,
                       nvme_path=nvme_path, nvme_gradients="host" if self.nvme_grads_held else
                       "auto" if self.step_in_backward else "file",
                       nvme_gradients_max_in_cpu=self.grad_max_in_cpu if self.nvme_grads_held else None)
        par: dict[str, Any] = {"device": self.param}
        if self.param == "nvme":
            par.update(max_in_cpu=self.param_max_in_cpu, buffer_count=self.param_buffer_count,
                       nvme_path=nvme_path)
        return {"offload_optimizer": opt, "offload_param": par}

    def describe(self, stage3: bool) -> str:
        where = {"none": "device", "cpu": "host", "nvme": "nvme"}
        out = []
        if stage3:
            w = f"weights {where[self.param]}"
            if self.param == "nvme":
                w += f" (max_in_cpu {self.param_max_in_cpu:,}, read-ahead {self.param_buffer_count})"
            out.append(w)
        o = f"optimizer {where[self.optimizer]}"
        if self.optimizer != "none" and self.ratio < 1.0:
            o += f" (Twin-Flow ratio {self.ratio:.2f})"
        if self.optimizer == "nvme":
            o += f" (max_in_cpu {self.opt_max_in_cpu:,}, buffers {self.opt_buffer_count}"
            o += (")" if not self.nvme_grads_held else ", gradients in RAM)"
                  if self.grad_max_in_cpu is None else
                  f", gradients in RAM up to {self.grad_max_in_cpu:,}, the rest in files)")
        if self.optimizer != "none":
            o += ", stepped in backward" if self.step_in_backward else ", stepped in step()"
        out.append(o)
        return "; ".join(out)


@dataclass
class PlanInputs:
    """What the planner reads: the config, the engine's units and dtypes, the budgets and the
    memory outside the model states (see [Note: the placement planner])."""

    cfg: Any                      # ZeroKitConfig
    groups: list                  # units/wrap.py group_parameters
    world: int
    rank: int
    cuda: bool                    # the compute device is a GPU (else the device tier is host RAM)
    policy: PartitionPolicy
    dtype: torch.dtype
    reduce: torch.dtype
    accumulation: int
    kind: str | None              # the optimizer's kind (optim/recipe.py)
    optimizer: Any = None         # the user's optimizer object, for bf16_state's checks
    budgets: dict = field(default_factory=dict)  # TierName -> (bytes, source)
    host_available: tuple[int, str] | None = None  # without memory.host: per rank, and whence
    process_bytes: int = 0        # host bytes outside the ledger (RSS at initialize less the model)
    transient_bytes: int = 0      # gathered peak + reduction buffers, device tier
    gathered_bytes: int = 0       # of transient_bytes, stage 3's gathered peak: none where no
                                  # unit gathers ([Note: one rank's shard is its weights])
    rss_margin: int = 0


@dataclass
class Prediction:
    choice: Choice
    bytes: dict = field(default_factory=dict)      # TierName -> kind -> bytes (model states)
    checks: dict = field(default_factory=dict)     # check -> (need, limit, source, breakdown)
    seconds: float = 0.0
    time_parts: dict = field(default_factory=dict)
    invalid: str = ""                              # why the combination cannot run

    @property
    def over(self) -> dict[str, int]:
        return {name: need - limit for name, (need, limit, _, _) in self.checks.items()
                if limit is not None and need > limit}

    @property
    def fits(self) -> bool:
        return not self.invalid and not self.over

    def tier(self, tier: TierName) -> int:
        return sum(self.bytes.get(tier, {}).values())


@dataclass
class Plan:
    chosen: Prediction
    considered: list[Prediction]
    config: Any                   # the config with the chosen keys in its offload sections
    bandwidths: Bandwidths
    why: str
    stage3: bool
    nvme_path: str | None = None
    sizes: Any = None             # engine/size_plan.py Sizes, chosen beside the placement

    def shown_in(self, raw: dict) -> None:
        """Writes the chosen keys into `raw`'s offload sections (engine.config, the DeepSpeed
        dict the HF Trainer reads), in new dicts: the user's nested dicts are not touched."""
        zero = dict(raw.get("zero_optimization") or {})
        for name, keys in self.chosen.choice.keys(self.nvme_path).items():
            zero[name] = {**(zero.get(name) or {}), **keys}
        raw["zero_optimization"] = {**zero, **(self.sizes.chosen if self.sizes else {})}

    def explain(self) -> str:
        lines = [f"memory planner: {len(self.considered)} placements considered; bandwidths: "
                 f"{self.bandwidths.describe()}",
                 f"  {'':2} {'step':>10} {'device':>12} {'host':>12} {'nvme':>12}  placement"]
        for p in sorted(self.considered, key=lambda p: (not p.fits, p.seconds)):
            mark = "=>" if p is self.chosen else "  "
            verdict = (f"  [cannot run: {p.invalid}]" if p.invalid else
                       "  [over " + ", ".join(f"{k} by {mib(v)}" for k, v in p.over.items()) + "]"
                       if p.over else "")
            cells = [mib(p.tier(t), 1) for t in (TierName.DEVICE, TierName.HOST, TierName.NVME)]
            secs = f"{_secs(p.seconds):>10}" if not p.invalid else f"{'-':>10}"
            lines.append(f"  {mark} {secs} {cells[0]:>12} {cells[1]:>12} {cells[2]:>12}  "
                         f"{p.choice.describe(self.stage3)}{verdict}")
        c = self.chosen
        lines.append(f"chosen: {c.choice.describe(self.stage3)}: {self.why}; predicted "
                     + ", ".join(f"{k} {_secs(v)}" for k, v in c.time_parts.items() if v)
                     + "; " + "; ".join(f"{name} {mib(need)} of {mib(limit)} ({src})"
                                        for name, (need, limit, src, _) in c.checks.items()
                                        if limit is not None))
        lines += [f"  {name}: " + ", ".join(f"{k} {mib(v)}" for k, v in parts.items())
                  for name, (_, limit, _, parts) in c.checks.items() if limit is not None and parts]
        return "\n".join(lines + ([self.sizes.explain()] if self.sizes else []))


def _secs(x: float) -> str:
    return f"{x:.3g} s" if x >= 1 else f"{x * 1e3:.3g} ms"


# ------------------------------------------------------------------------------ what is free
@dataclass(frozen=True)
class Freedom:
    """Per key, the values the planner may choose from (one value: hand-set or not applicable)."""

    params: tuple[str, ...]
    optimizers: tuple[str, ...]
    ratios: tuple[float, ...] | None  # None: free (decided from the rates)
    step_in_backward: tuple[bool, ...]
    opt_max_in_cpu: int | None        # None: free
    param_max_in_cpu: int | None
    opt_buffer_counts: tuple[int, ...]
    param_buffer_counts: tuple[int, ...]
    nvme_path: str | None
    nvme_grads_held: tuple[bool, ...] = (False,)  # offload_optimizer.nvme_gradients 'host'
    grad_max_in_cpu: tuple[int | None, ...] | None = None  # nvme_gradients_max_in_cpu (None: free)


def _given(cfg, section: str) -> set[str]:
    zero = cfg.zero_optimization
    return set(getattr(zero, section).model_fields_set) if section in zero.model_fields_set else set()


def freedom(cfg) -> Freedom:
    zero = cfg.zero_optimization
    off, par = zero.offload_optimizer, zero.offload_param
    off_set, par_set = _given(cfg, "offload_optimizer"), _given(cfg, "offload_param")
    path = off.nvme_path or par.nvme_path
    disk = ("nvme",) if path else ()
    if zero.stage == 0:
        opts: tuple[str, ...] = ("none",)
    elif "device" in off_set and off.device != "auto":
        opts = (off.device,)
    else:
        opts = ("none", "cpu") + disk
    if zero.stage != 3:
        params: tuple[str, ...] = ("none",)
    elif "device" in par_set and par.device != "auto":
        params = (par.device,)
    else:
        params = ("none", "cpu") + disk
    ratio_free = "ratio" not in off_set or off.ratio == "auto"
    if off.delayed_update.enabled:
        sib: tuple[bool, ...] = (False,)
    elif "step_in_backward" in off_set and off.step_in_backward != "auto":
        sib = (bool(off.step_in_backward),)
    else:
        sib = (True, False)
    if off.nvme_gradients != "auto":
        held: tuple[bool, ...] = (off.nvme_gradients == "host",)
    else:  # (the delayed update would hold two: files only)
        held = (False,) if off.delayed_update.enabled else (False, True)
    return Freedom(
        params, opts, None if ratio_free else (float(off.ratio),), sib,
        None if "max_in_cpu" not in off_set else off.max_in_cpu,
        None if "max_in_cpu" not in par_set else par.max_in_cpu,
        (off.buffer_count,) if "buffer_count" in off_set else OPT_BUFFER_COUNTS,
        (par.buffer_count,) if "buffer_count" in par_set else PARAM_BUFFER_COUNTS,
        path, held, ((off.nvme_gradients_max_in_cpu,)
                     if "nvme_gradients_max_in_cpu" in off_set else None))


def asked(cfg, budgets: dict) -> bool:
    """Whether initialize plans the placement: a budget is given and a placement key is left
    to the planner. 'auto' without a budget is refused, naming the keys."""
    zero = cfg.zero_optimization
    autos = [f"zero_optimization.{s}.device" for s in ("offload_optimizer", "offload_param")
             if getattr(zero, s).device == "auto"]
    if not budgets:
        if autos:
            raise ValueError(f"{' and '.join(autos)} 'auto' chooses the placement from a memory "
                             f"budget, and the config gives none: set memory.host (bytes, a size "
                             f"such as '20GiB', or 'auto'), memory.device or memory.nvme, or give "
                             f"the device ('none', 'cpu' or 'nvme')")
        return False
    free = freedom(cfg)
    return (len(free.optimizers) > 1 or len(free.params) > 1 or bool(autos)
            or ("nvme" in free.optimizers and free.opt_max_in_cpu is None)
            or ("nvme" in free.params and free.param_max_in_cpu is None))


# ------------------------------------------------------------------------------ prediction
def _resolved(cfg, choice: Choice, path: str | None):
    zero = cfg.zero_optimization
    keys = choice.keys(path)
    sections = {}
    for name in ("offload_optimizer", "offload_param"):
        section = getattr(zero, name)
        values = {**section.model_dump(), **keys[name]}
        sections[name] = type(section).model_validate(values)
    new_zero = type(zero).model_validate({**zero.model_dump(), **{k: v.model_dump() for k, v in sections.items()}})
    return cfg.model_copy(update={"zero_optimization": new_zero})


def _placement(inputs: PlanInputs, cfg) -> PlacementPolicy:
    placement = bf16_state.with_state_dtypes(cfg, PlacementPolicy.from_config(cfg.zero_optimization),
                                             inputs.optimizer)
    return with_gradient_dtype(cfg, placement, inputs.world, inputs.accumulation)


def _layouts(inputs: PlanInputs, placement: PlacementPolicy) -> list:
    return plan_layouts(inputs.groups, inputs.world, inputs.rank, inputs.cuda, inputs.policy,
                        inputs.dtype, inputs.reduce, inputs.accumulation, placement)


def predict(inputs: PlanInputs, choice: Choice, bw: Bandwidths, cfg=None) -> Prediction:
    """One candidate's bytes per tier and kind, checks and predicted step time."""
    out = Prediction(choice)
    try:
        cfg = cfg if cfg is not None else _resolved(inputs.cfg, choice, freedom(inputs.cfg).nvme_path)
        placement = _placement(inputs, cfg)
    except (ValueError, NotImplementedError) as e:
        out.invalid = str(e).splitlines()[-1][:200]
        return out
    return _predict(inputs, cfg, placement, out, bw)


def _predict(inputs: PlanInputs, cfg, placement: PlacementPolicy, out: Prediction,
             bw: Bandwidths) -> Prediction:
    layouts = _layouts(inputs, placement)
    out.bytes = planned_bytes(cfg, placement, layouts, inputs.kind)
    out.checks = budget_checks(inputs, out.bytes, layouts)
    if (placement.nvme or placement.params_on_nvme) and not (bw.disk_read and bw.disk_write):
        out.invalid = "no disk bandwidth measured (no nvme_path)"
        return out
    out.time_parts = step_time(inputs, placement, layouts, bw)
    out.seconds = sum(out.time_parts.values())
    return out


def _host_fits(inputs: PlanInputs, cfg, placement: PlacementPolicy) -> bool:
    layouts = _layouts(inputs, placement)
    states = planned_bytes(cfg, placement, layouts, inputs.kind)
    need, limit, _, _ = budget_checks(inputs, states, layouts)["host"]
    return limit is None or need <= limit


# ------------------------------------------------------------------------------ search
def _shapes(inputs: PlanInputs, free: Freedom, bw: Bandwidths) -> list[Choice]:
    ratios = free.ratios
    if ratios is None:
        ratios = (1.0,)
        if inputs.cuda:
            r = round(balance(bw.host_adam, bw.device_adam, 0, None)[0], 2)
            ratios = (1.0, r) if 0.0 < r < 1.0 else ratios
    out = []
    for param in free.params:
        for opt in free.optimizers:
            for ratio in (ratios if opt != "none" else (1.0,)):
                for sib in (free.step_in_backward if opt != "none" else (False,)):
                    # stepped in backward the gradients are held anyway
                    helds = free.nvme_grads_held if opt == "nvme" and not sib else (False,)
                    for ob, pb, held in itertools.product(
                            free.opt_buffer_counts if opt == "nvme" else (OPT_BUFFER_COUNTS[0],),
                            free.param_buffer_counts if param == "nvme" else (PARAM_BUFFER_COUNTS[0],),
                            helds):
                        gmax = free.grad_max_in_cpu[0] if held and free.grad_max_in_cpu else None
                        out.append(Choice(param, free.param_max_in_cpu or 0, pb, opt, ratio,
                                          free.opt_max_in_cpu or 0, ob, sib, held, gmax))
    return out


def _largest(fits, hi: int, step: int = 1) -> int:
    """The largest x in [0, hi] (multiples of `step`, or hi) with fits(x), fits monotone
    decreasing; 0 when none (the candidate then shows over budget)."""
    if fits(hi):
        return hi
    lo, top = 0, hi // step  # fits(lo * step) assumed or reported
    while lo < top:
        mid = (lo + top + 1) // 2
        if fits(mid * step):
            lo = mid
        else:
            top = mid - 1
    return lo * step


def _fill(inputs: PlanInputs, free: Freedom, shape: Choice, bw: Bandwidths) -> list[Prediction]:
    """The shape's predictions with its free max_in_cpu keys chosen (see the Note, point 1)."""
    try:
        cfg = _resolved(inputs.cfg, shape, free.nvme_path)
        base = _placement(inputs, cfg)
    except (ValueError, NotImplementedError) as e:
        return [Prediction(shape, invalid=str(e).splitlines()[-1][:200])]
    opt_free = shape.optimizer == "nvme" and free.opt_max_in_cpu is None
    param_free = shape.param == "nvme" and free.param_max_in_cpu is None
    huge = 1 << 62
    param_points = [shape.param_max_in_cpu]
    if param_free:
        layouts = _layouts(inputs, dataclasses.replace(base, ram_numel=0, param_ram_numel=0))
        points, every = _whole_points([lay.shard_numel for lay in layouts], PARAM_GRID,
                                      lambda n: _host_fits(inputs, cfg, dataclasses.replace(
                                          base, ram_numel=0, param_ram_numel=n)))
        if every and "cpu" in free.params:
            return []  # every shard in RAM: the 'cpu' candidate, without the files
        param_points = points
    grad_free = shape.nvme_grads_held and free.grad_max_in_cpu is None
    out = []
    for pmax in param_points:
        for gmax in (_grad_points(inputs, cfg, dataclasses.replace(base, param_ram_numel=pmax))
                     if grad_free else [shape.grad_max_in_cpu]):
            at = dataclasses.replace(base, param_ram_numel=pmax, grad_ram_numel=gmax)
            omax = shape.opt_max_in_cpu
            if opt_free:
                total = sum(lay.host_numel + lay.nvme_numel for lay in _layouts(
                    inputs, dataclasses.replace(at, ram_numel=huge)))
                omax = _largest(lambda x: _host_fits(inputs, cfg, dataclasses.replace(
                    at, ram_numel=x)), total, SPLIT_ALIGN)
                if omax >= total and "cpu" in free.optimizers:
                    continue  # every element in RAM: the 'cpu' candidate, without the stream
            choice = dataclasses.replace(shape, param_max_in_cpu=pmax, opt_max_in_cpu=omax,
                                         grad_max_in_cpu=gmax)
            out.append(_predict(inputs, _resolved(inputs.cfg, choice, free.nvme_path),
                                dataclasses.replace(at, ram_numel=omax), Prediction(choice), bw))
    return out


def _grad_points(inputs: PlanInputs, cfg, placement: PlacementPolicy) -> list[int | None]:
    """nvme_gradients_max_in_cpu points for a shape holding gradients: None (every part's) where
    that fits with no optimizer element in RAM, else GRAD_GRID of the most whole parts' that
    fit (none held is the 'file' candidate). Spent before max_in_cpu: at m micro-steps a held
    gradient saves 8 m bytes of file traffic per 4 of RAM, max_in_cpu 24 + 8 m per 16."""
    files = dataclasses.replace(placement, ram_numel=0, grad_ram_numel=0)
    sizes = [lay.nvme_numel for lay in _layouts(inputs, files) if lay.nvme_numel]
    points, every = _whole_points(sizes, GRAD_GRID, lambda n: _host_fits(
        inputs, cfg, dataclasses.replace(files, grad_ram_numel=n)))
    return [None] if every else [n for n in points if n]


def _whole_points(sizes: list[int], grid: tuple[float, ...], fits) -> tuple[list[int], bool]:
    """Element counts of the first k whole units (`sizes` in unit order) at `grid` fractions of
    the most that fits (`fits(elements)`, monotone), and whether every unit fits."""
    prefix = [0]
    for n in sizes:
        prefix.append(prefix[-1] + n)
    k = _largest(lambda i: fits(prefix[i]), len(prefix) - 1)
    return sorted({prefix[round(k * f)] for f in grid}), k == len(prefix) - 1


def _tie_key(p: Prediction) -> tuple:
    """Among candidates tied in time: fewer NVMe bytes, more read-ahead, then less RAM: the host
    check's need, which on a CPU device counts the device tier too (the same memory), so a
    second 16-bit copy of the weights on the device tier is not free there."""
    return (p.tier(TierName.NVME), -p.choice.param_buffer_count, -p.choice.opt_buffer_count,
            p.checks["host"][0], p.seconds)


def choose(inputs: PlanInputs, bw: Bandwidths) -> Plan:
    """The fastest placement that fits; see [Note: the placement planner]."""
    free = freedom(inputs.cfg)
    considered = [p for shape in _shapes(inputs, free, bw) for p in _fill(inputs, free, shape, bw)]
    stage3 = inputs.cfg.zero_optimization.stage == 3
    fitting = [p for p in considered if p.fits]
    if not fitting:
        refused = PlacementBudgetError(_refusal(considered, stage3, free.nvme_path is not None))
        refused.considered = considered
        raise refused
    in_ram = [p for p in fitting if not p.tier(TierName.NVME)]
    pool = in_ram or fitting
    full_stream = [p for p in pool if p.choice.opt_buffer_count >= OPT_BUFFER_COUNTS[0]]
    shallow = [p for p in pool if p.choice.opt_buffer_count < OPT_BUFFER_COUNTS[0]]
    deep_kept = bool(full_stream and shallow) and (
        min(p.seconds for p in shallow) * (1 + READ_AHEAD_MARGIN) >= min(p.seconds for p in full_stream))
    pool = full_stream if deep_kept else pool
    fastest = min(p.seconds for p in pool)
    best = min((p for p in pool if p.seconds <= fastest * (1 + TIE)), key=_tie_key)
    why = _why(best, pool, fitting, in_ram, considered, stage3, deep_kept)
    return Plan(best, considered, _resolved(inputs.cfg, best.choice, free.nvme_path), bw, why, stage3,
                free.nvme_path)


def _why(best: Prediction, pool: list, fitting: list, in_ram: list, considered: list,
         stage3: bool, deep_stream: bool) -> str:
    dropped = len(considered) - len(fitting)
    why = f"the fastest predicted of the {len(fitting)} that fit ({dropped} over a budget or unable to run)"
    if in_ram and len(in_ram) < len(fitting):
        why += "; RAM holds it, so no candidate with bytes on NVMe was taken"
    elif not in_ram:
        why += "; no candidate fits without NVMe"
    if deep_stream:
        why += (f"; the stream's full read-ahead (buffer_count {OPT_BUFFER_COUNTS[0]}) fits and "
                f"no candidate with fewer buffers is predicted over "
                f"{100 * READ_AHEAD_MARGIN:.0f}% faster, so none with fewer was taken")
    others = sorted((p for p in pool if p is not best), key=lambda p: p.seconds)
    if others:
        nxt = others[0]
        if nxt.seconds <= best.seconds * (1 + TIE):
            why += (f"; tied in time with '{nxt.choice.describe(stage3)}', kept for fewer NVMe "
                    f"bytes, then more read-ahead, then less RAM")
        else:
            why += (f"; next: '{nxt.choice.describe(stage3)}' at {_secs(nxt.seconds)} "
                    f"(+{100 * (nxt.seconds / best.seconds - 1) if best.seconds else 0:.0f}%)")
    return why


def _refusal(considered: list, stage3: bool, has_disk: bool) -> str:
    valid = [p for p in considered if not p.invalid]
    if not valid:
        return ("no placement can run: " + "; ".join(sorted({p.invalid for p in considered})))
    names = sorted({n for p in valid for n, (_, limit, _, _) in p.checks.items() if limit is not None})
    smallest = {}
    for name in names:  # the least any candidate needs there, among those that fit elsewhere
        others = [p for p in valid if all(n == name or n not in p.over for n in p.checks)]
        best = min(others or valid, key=lambda p: p.checks[name][0])
        smallest[name] = (best.checks[name][0], best)
    closest = min(valid, key=lambda p: sum(p.over.values()))
    lines = ["no placement fits the memory budgets ("
             + ", ".join(f"{n} {mib(p.checks[n][1])} per rank ({p.checks[n][2]})"
                         for n, (_, p) in smallest.items()) + ")."]
    need = [f"{_label(n, p.checks[n][2])} {mib(v)} (with '{p.choice.describe(stage3)}')"
            for n, (v, p) in smallest.items() if v > p.checks[n][1]]
    lines.append("The smallest budget that would work: " + ("; ".join(need) or "-") + ".")
    lines.append(f"The closest placement, '{closest.choice.describe(stage3)}', needs per rank:")
    for name, (total, limit, source, parts) in closest.checks.items():
        detail = ", ".join(f"{k} {mib(v)}" for k, v in parts.items()) or "nothing"
        over = f", over {mib(limit)} ({source}) by {mib(total - limit)}" if limit is not None and total > limit else ""
        lines.append(f"  {name}: {mib(total)} = {detail}{over}")
    lines.append("Raise the budget" + ("" if has_disk else ", give an offload_optimizer or "
                 "offload_param nvme_path (a disk lets the planner put state on NVMe)")
                 + ", or spread the model over more ranks.")
    return "\n".join(lines)


def _label(check: str, source: str) -> str:
    return f"memory.{check}" if source.startswith("memory.") else "host memory available"
