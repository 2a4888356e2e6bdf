"""bench_step --profile: where a step's time goes, per phase (forward, backward, step).

Every row gets, beside its own phase times, the same model trained *locally* on each rank (no
wrapper, no communication, both ranks at once so the cores are as busy): the compute a phase
cannot do without. For the zerokit rows, the difference is split by timing zerokit's own
functions (exclusive time: a timed function's time excludes the timed functions it calls):

  collective wait   blocked in a gloo exchange's wait (the data had not arrived yet)
  publish wait      the same, for the new weights, inside step()'s wait_for_weights
  collective post   posting an exchange's sends and receives (comm.collectives._exchange_pieces)
  agreement         rank agreement: headers sent / compared (comm.agreement.HeaderedExchanges)
  reduce finish     the sum of the received rows, and copy-outs, once an exchange landed
  grad copy         gradients into a unit's reduction bucket (stage 2-3)
  copies            reduced gradients to the optimizer's part, new weights out of it
  norm+flags        the step's one all-reduce (norm, non-finite losses, SIGTERM, used units)
  optimizer         the optimizer math on this rank's shard
  gather issue      stage 3: a unit's buffer allocated and its gather issued
  other             the rest of the phase beyond the local compute: hooks, Python, allocation

Overlap (the issue's measure: time collectives ran under compute / collective time): every
exchange of the last profiled step is recorded and replayed alone after the timed steps, rank
against rank, which gives the time the step's collectives take with nothing else to do; the
overlap is 1 - (collective + publish wait) / that time, per phase, clamped to [0, 1].
"""
from __future__ import annotations

import functools
import statistics
import time
from collections import defaultdict
from typing import Any, Callable

LABELS = ["collective wait", "publish wait", "collective post", "agreement", "reduce finish",
          "grad copy", "copies", "norm+flags", "optimizer", "gather issue"]
PHASES = ["forward", "backward", "step"]


class Profiler:
    def __init__(self) -> None:
        self.phase = "other"
        self.step_totals: list[dict[tuple[str, str], float]] = []
        self._now: dict[tuple[str, str], float] = defaultdict(float)
        self._stack: list[list[Any]] = []
        self.exchanges: list[tuple[str, int, int]] = []  # (phase, peer, bytes) of the last step
        self._recording = False

    def wrap(self, owner: Any, name: str, label: str,
             relabel: Callable[[list[str]], str | None] | None = None) -> None:
        real = getattr(owner, name)
        prof = self

        @functools.wraps(real)
        def timed(*args: Any, **kwargs: Any) -> Any:
            lab = (relabel([f[0] for f in prof._stack]) if relabel else None) or label
            frame = [lab, 0.0]
            prof._stack.append(frame)
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                prof._stack.pop()
                prof._now[(prof.phase, lab)] += dt - frame[1]
                if prof._stack:
                    prof._stack[-1][1] += dt
        setattr(owner, name, timed)

    def start_step(self, record: bool) -> None:
        self._now = defaultdict(float)
        self._recording = record
        if record:
            self.exchanges = []

    def end_step(self) -> None:
        self.step_totals.append(dict(self._now))

    def medians(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {p: {} for p in PHASES}
        for p in PHASES:
            for lab in LABELS:
                xs = [s.get((p, lab), 0.0) for s in self.step_totals]
                if any(xs):
                    out[p][lab] = statistics.median(xs)
        return out


def instrument_zerokit(prof: Profiler) -> None:
    """Time zerokit's own functions (see the module docstring for the labels)."""
    import zerokit.comm.collectives as coll
    import zerokit.engine.engine as eng
    from zerokit.comm.agreement import HeaderedExchanges
    from zerokit.parts.device import DevicePart
    from zerokit.parts.executors import DeviceExecutor
    from zerokit.units.unit import Unit

    publish = lambda stack: "publish wait" if "publish wait" in stack else None  # noqa: E731
    prof.wrap(coll._Works, "wait", "collective wait", publish)
    prof.wrap(eng.Engine, "wait_for_weights", "publish wait",
              lambda stack: None if prof.phase == "step" else "collective wait")
    real_pieces = coll._exchange_pieces

    def pieces(send, recv, peer, works):
        if prof._recording:
            prof.exchanges.append((prof.phase, peer, send.numel() * send.element_size()))
        return real_pieces(send, recv, peer, works)
    coll._exchange_pieces = pieces
    prof.wrap(coll, "_exchange_pieces", "collective post")
    prof.wrap(HeaderedExchanges, "submit", "agreement")
    prof.wrap(HeaderedExchanges, "_check", "agreement")
    prof.wrap(coll.Handle, "wait", "reduce finish",
              lambda stack: "norm+flags" if "norm+flags" in stack else None)
    prof.wrap(Unit, "launch_reduce", "grad copy")
    prof.wrap(Unit, "_deliver", "copies")
    prof.wrap(DevicePart, "write_weights", "copies")
    prof.wrap(eng, "reduce_step_scalars", "norm+flags")
    prof.wrap(DeviceExecutor, "launch", "optimizer")
    prof.wrap(Unit, "gather", "gather issue")


def replay_exchanges(exchanges: list[tuple[str, int, int]]) -> dict[str, float]:
    """Seconds the recorded exchanges take alone, per phase (every rank replays its own list;
    the lists are the same on every rank when the ranks agree)."""
    import torch
    import torch.distributed as dist

    out: dict[str, float] = defaultdict(float)
    bufs: dict[int, tuple[Any, Any]] = {}
    for _ in range(2):  # the first pass warms the buffers and connections up
        out.clear()
        dist.barrier()
        for phase, peer, nbytes in exchanges:
            if nbytes not in bufs:
                bufs[nbytes] = (torch.ones(nbytes // 4 or 1), torch.empty(nbytes // 4 or 1))
            send, recv = bufs[nbytes]
            t0 = time.perf_counter()
            works = [dist.isend(send, peer), dist.irecv(recv, peer)]
            for w in works:
                w.wait()
            out[phase] += time.perf_counter() - t0
    return dict(out)


def local_compute(build_model: Callable[[], Any], adamw: dict, args: Any, rank: int
                  ) -> dict[str, float]:
    """Median seconds of forward, backward, step of the plain model on this rank alone (every
    rank at once, so the cores are as busy as in the row), on the row's kind of batches."""
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(args.seed + 1 + rank)
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), **adamw)
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    dist.barrier()
    for i in range(args.warmup + args.steps):
        t = torch.randint(0, 256, (args.micro_batch, args.seq + 1), generator=g)
        x, y = t[:, :-1].contiguous(), t[:, 1:].contiguous()
        t0 = time.perf_counter()
        loss = model(x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if i >= args.warmup:
            for p, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2)):
                times[p].append(dt)
    return {p: statistics.median(v) for p, v in times.items()}


def table(results: dict[str, dict]) -> str:
    """One line per (row, phase), in ms: the row's time, the local compute, each label."""
    import _common as C

    headers = ["row", "phase", "total ms", "local compute", "beyond local", *LABELS, "other",
               "overlap"]
    rows = []
    for name, r in results.items():
        prof = r.get("profile")
        if r.get("status") != "ok" or not prof:
            continue
        for p in PHASES:
            total = r[f"{'optimizer' if p == 'step' else p}_s"]["median"]
            local = prof["local"][p]
            labs = prof["labels"].get(p, {})
            beyond = total - local
            other = beyond - sum(labs.values())
            alone = prof["alone"].get(p, 0.0)
            waited = labs.get("collective wait", 0.0) + labs.get("publish wait", 0.0)
            overlap = f"{max(0.0, min(1.0, 1 - waited / alone)):.0%} of {alone * 1e3:.0f}" \
                if alone > 0 else ""
            rows.append([name, p, f"{total * 1e3:.0f}", f"{local * 1e3:.0f}", f"{beyond * 1e3:+.0f}",
                         *[f"{labs[lab] * 1e3:.1f}" if lab in labs else "" for lab in LABELS],
                         f"{other * 1e3:+.0f}" if labs else "", overlap])
    return C.format_table(headers, rows)
