"""What one placement candidate costs: its bytes against each tier's budget, its step time.

[Note: what a candidate costs]
The placement planner (engine/planner.py, [Note: the placement planner]) prices each candidate
placement here:
1. bytes: each candidate's model states per tier and kind are engine/byte_plan.py's rules on the
   engine's own units (`plan_layouts`, `planned_bytes`), never a second copy. The checks:
   host: the host tier's bytes + the process's own (RSS at initialize less the model's tensors,
   `process_bytes`) + memory.rss_margin (what no rule models: activations, allocator slack), and,
   where the compute device is this host's CPU, the device tier's bytes and the step's
   transients (stage 3's gathered peak, the reductions' buffers), which live in the same RAM;
   a candidate none of whose units gathers (one rank, its shards in RAM: [Note: one rank's
   shard is its weights]) holds no gathered peak;
   against memory.host, or without it the memory available (as the start-up check);
   device: the device tier's bytes + the transients, against memory.device; nvme: the nvme
   tier's bytes, against memory.nvme. A candidate over any is dropped.
2. time: the step as bytes moved over the measured bandwidths plus the optimizer's compute
   (engine/bandwidths.py): device-part elements / device Adam rate, host and nvme elements /
   host Adam rate, host copies (each host or nvme weight shard copied in 2 gathers per micro-
   step, none where the shard is the weights: [Note: one rank's shard is its weights]; each
   offloaded element's gradient in, and its new weight out unless the kernel writes it into a
   host shard in place, `_written_in_place`: weights on a CPU device's device tier are the
   same RAM, but their update goes to a 16-bit buffer first and is copied) / host copy rate,
   and disk time in three phases: the weight files read per gather (forward and backward,
   the disk doing nothing else) / the read rate; the gradient files once more each way per
   micro-step after the first where each micro-step reduces (the accumulation's
   read-add-write, in backward);
   the step's stream (the nvme parts' files read and written once, engine/nvme_plan.py, and the
   weight files written). The last two read and write at once through the I/O engine's queue:
   Bandwidths.disk_seconds, both at the measured mixed rate (one after the other at the read
   and write rates where none was measured: injected rates). Forward and backward compute
   is the same for every candidate and left out; overlap with it is not modelled (the phases
   add up), so read-ahead counts show only in bytes: between candidates within 0.5% in
   time the planner keeps fewer NVMe bytes, then the larger read-ahead, then less RAM (the
   host check's need: on a CPU device that counts the device tier too).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zerokit.engine import nvme_plan
from zerokit.engine.bandwidths import Bandwidths
from zerokit.policy import PlacementPolicy
from zerokit.policy.layout import gradient_refill_bytes
from zerokit.tier_names import TierName

if TYPE_CHECKING:
    from zerokit.engine.planner import PlanInputs


def budget_checks(inputs: PlanInputs, states: dict, layouts: list) -> dict:
    """check -> (bytes needed, limit or None, where the limit comes from, breakdown)."""
    host = {k: v for k, v in states[TierName.HOST].items() if v}
    device = {k: v for k, v in states[TierName.DEVICE].items() if v}
    nvme = {k: v for k, v in states[TierName.NVME].items() if v}
    transients = inputs.transient_bytes
    if not any(lay.gathers for lay in layouts):
        transients -= inputs.gathered_bytes
    if transients:
        device["transients (gathered weights, reductions)"] = transients
    ram = dict(host)
    if not inputs.cuda:  # the device tier is this host's RAM
        ram.update({f"device {k}": v for k, v in device.items()})
    if inputs.process_bytes:
        ram["process (RSS at initialize less the model)"] = inputs.process_bytes
    if inputs.rss_margin:
        ram["memory.rss_margin"] = inputs.rss_margin
    budgets = inputs.budgets
    if TierName.HOST in budgets:
        limit, source = budgets[TierName.HOST]
    elif inputs.host_available is not None:
        limit, source = inputs.host_available
    else:
        limit, source = None, ""
    out = {"host": (sum(ram.values()), limit, source, ram)}
    if TierName.DEVICE in budgets or inputs.cuda:
        dev = budgets.get(TierName.DEVICE, (None, ""))
        out["device"] = (sum(device.values()), dev[0], dev[1], device)
    out["nvme"] = (sum(nvme.values()), *budgets.get(TierName.NVME, (None, "")), nvme)
    return out


def step_time(inputs: PlanInputs, placement: PlacementPolicy, layouts: list,
              bw: Bandwidths) -> dict[str, float]:
    """The stated model ([Note: what a candidate costs], point 2): seconds per step by what."""
    m = inputs.accumulation
    dev = sum(p.numel for lay in layouts for p in lay.parts if p.tier is TierName.DEVICE)
    off = sum(lay.host_numel + lay.nvme_numel for lay in layouts)
    elem = torch.empty(0, dtype=inputs.dtype).element_size()
    master = torch.empty(0, dtype=placement.master_dtype).element_size()
    shards = sum(lay.record("shard").nbytes for lay in layouts  # copied into a gathered buffer
                 if lay.has("shard") and lay.record("shard").tier is not TierName.DEVICE
                 and lay.gathers)
    copied_out = off - sum(_written_in_place(lay) for lay in layouts)
    parts = {"device Adam": dev / bw.device_adam, "host Adam": off / bw.host_adam,
             "host copies": (2 * m * shards + master * off + elem * copied_out) / bw.host_copy}
    files = nvme_plan.nvme_need(layouts, inputs.kind, placement.state_dtype) if placement.nvme else 0
    again = gradient_refill_bytes(layouts)  # the accumulation's read-add-write
    w_read, w_write = nvme_plan.weight_traffic(layouts, m)
    if files or w_read:
        parts["disk: weights read"] = w_read / bw.disk_read
        parts["disk: gradient files in backward"] = bw.disk_seconds(again, again)
        parts["disk: the step's stream"] = bw.disk_seconds(files, files + w_write)
    return parts


def _written_in_place(lay) -> int:
    """Offloaded elements of a unit whose new weights the kernel or the stream writes into the
    weights' home itself (their 16-bit output, or the fp32 master, is a view of a host shard):
    no copy after the step, where every other offloaded element's output is copied to its home."""
    outs = [("host_out16" if lay.has("host_out16") else "host_master", TierName.HOST),
            ("nvme_out", TierName.NVME)]
    return sum(part.numel for part in lay.parts for name, tier in outs
               if part.tier is tier and lay.has(name) and lay.aliases(name, "shard"))
