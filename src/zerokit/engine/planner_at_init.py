"""The placement planner at initialize: the facts only a live process has (its own memory, rank
0's measured bandwidths shared with every rank, the all-gather's rate), then the pure planner
(engine/planner.py, [Note: the placement planner]) and its sizes (engine/size_plan.py)."""
from __future__ import annotations

import logging

import torch

from zerokit.engine.bandwidths import Bandwidths
from zerokit.engine.planner import Plan, PlanInputs, freedom
from zerokit.tier_names import TierName

log = logging.getLogger("zerokit")


def _model_host_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's tensors in host memory now (each storage once): what laying out
    the units replaces, so not part of the process's own memory."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type == "cpu" and t.numel():
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def _shared_bandwidths(comm, path: str | None) -> Bandwidths:
    """Rank 0's rates (measured or cached), the same on every rank: every rank plans alike."""
    from zerokit.engine import bandwidths

    mine = bandwidths.rates(path, comm.device) if comm.rank == 0 else None
    if comm.world_size == 1:
        return mine
    t = torch.tensor(mine.as_list() if mine else [0.0] * bandwidths.BROADCAST_NUMBERS,
                     dtype=torch.float64, device=comm.device)
    comm.broadcast_(t, 0, "placement planner: bandwidths")
    return mine or Bandwidths.from_list(t.tolist(), "", "rank 0's")


def plan_at_initialize(inputs: PlanInputs, model: torch.nn.Module, comm) -> Plan:
    """initialize's call: the process's memory (the largest of the ranks'), the shared
    bandwidths, then the sizes, their transients and `choose` (size_plan.py); rank 0 logs the
    explanation."""
    from zerokit.engine import bandwidths, host_budget, size_plan

    # Untrimmed on purpose: at 1B the steps' RSS less the ledger was 1.13-1.23 GiB (activations,
    # autograd's gradients before their bucket, the heap's slack: no byte rule counts them),
    # this figure 1.32-1.38 GiB; after malloc_trim it was 0.26 GiB and every budgeted 1B row
    # crossed its budget by 0.15-0.25 GiB (docs/offload.md, "Against hand tuning"). Counting
    # those bytes is the fix.
    rss = host_budget.RssWatch.rss()
    inputs.process_bytes = int(comm.max_flag(float(max(0, rss - _model_host_bytes(model))),
                                             "placement planner: process memory"))
    if TierName.HOST not in inputs.budgets:
        avail, source = host_budget.available_host_bytes()
        inputs.host_available = (avail // host_budget.local_ranks() + rss,
                                 f"{source} available per rank, plus this process's RSS")
    plan = size_plan.plan_with_sizes(inputs, model, bandwidths.all_gather_rate(comm),
                                     _shared_bandwidths(comm, freedom(inputs.cfg).nvme_path))
    if comm.rank == 0:
        log.info("%s", plan.explain())
    return plan
