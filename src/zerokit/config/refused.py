"""DeepSpeed config keys zerokit refuses by name, each with the reason (and the issue that will
implement it, where one will).

Accepting these would let a run silently compute something other than what the config asks for
(quantized weights or gradients, 16-bit master weights, a client-owned accumulation boundary), or
they belong to a feature zerokit does not have yet. A value in `accepted` describes what zerokit
does anyway (`zero_quantized_weights: false`): it is accepted silently, so configs that spell out
DeepSpeed's defaults load. Keys zerokit accepts and ignores are config/ignored.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from zerokit.config.errors import without_key

ISSUE_INFINITY = "ZeRO-Infinity, issue #16"


@dataclass(frozen=True)
class Refused:
    reason: str
    accepted: tuple | Callable[[Any], bool] = ()  # values that mean what zerokit does anyway
    issue: str | None = None  # the issue that will implement it ("not yet"), if any

    def accepts(self, value: Any) -> bool:
        if callable(self.accepted):
            return bool(self.accepted(value))
        return any(value is a or (type(value) is type(a) and value == a) for a in self.accepted)


def _all_off(section: Any) -> bool:
    """A section whose every option is off (false, 0, null, empty): DeepSpeed's defaults."""
    return isinstance(section, dict) and not any(section.values())


def _disabled(section: Any) -> bool:
    return isinstance(section, dict) and not section.get("enabled", False)


def _at_most_one(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value <= 1


_CHANGES_MATH = "accepting it would change the math silently"
_DS_REMOVED = "removed from DeepSpeed itself (0.19.8 refuses it too)"

REFUSED: dict[str, Refused] = {
    # ---- would change the math ----------------------------------------------------------------
    **{f"zero_optimization.{key}": Refused(f"{what}: {_CHANGES_MATH}", accepted=(False,))
       for key, what in [
           ("zero_quantized_weights", "ZeRO++ quantized weight all-gathers (int8 weights in forward)"),
           ("zero_quantized_nontrainable_weights", "ZeRO++ quantized frozen weights"),
           ("zero_quantized_gradients", "ZeRO++ quantized gradient reduction")]},
    "zero_optimization.zero_hpz_partition_size": Refused(
        "ZeRO++ hierarchical partitioning (a secondary weight copy per node) is not implemented; "
        "zerokit is flat data parallel", accepted=_at_most_one),
    "zero_optimization.zenflow": Refused(
        f"ZenFlow updates unimportant gradients late: {_CHANGES_MATH}", accepted=_disabled),
    "zero_optimization.leaf_module": Refused(
        "DeepSpeed's stage 3 leaf modules (set_z3_leaf_modules) are not implemented (issue "
        "'Robustness'); initialize(wrap=[cls]) makes a class one unit, gathered whole",
        accepted=_all_off),
    "zero_optimization.offload_optimizer.super_offload": Refused(
        "SuperOffload (a different host-update schedule) is not implemented", accepted=(False,)),
    "bf16.check_grad_overflow": Refused(
        "skipping a bf16 step on inf/nan gradients is not implemented (zerokit skips steps only "
        "with dynamic fp16 loss scaling): ignoring it would apply such steps", accepted=(False,)),
    "bf16.check_overflow": Refused(
        "DeepSpeed's name for bf16.check_grad_overflow: skipping a bf16 step on inf/nan gradients "
        "is not implemented", accepted=(False,)),
    "fp16.fp16_master_weights_and_grads": Refused(
        f"fp16 master weights and gradients instead of fp32: {_CHANGES_MATH}", accepted=(False,)),
    "torch_autocast": Refused(
        "torch.autocast around forward (its own dtype per op) is not implemented; use fp16 or bf16 "
        "(the whole module in that dtype, an fp32 master)", accepted=_disabled),
    "managed_gradient_accumulation": Refused(
        "false (every step() updates, the client owns the boundary) is not implemented; call "
        "engine.set_gradient_accumulation_boundary(), as Accelerate does", accepted=(True,)),
    "optimizer.params.max_grad_norm": Refused(
        "not an optimizer parameter (DeepSpeed refuses it too): use the top-level gradient_clipping"),
    "weight_quantization": Refused(f"quantized weights: {_CHANGES_MATH}"),
    "data_efficiency": Refused(
        "DeepSpeed's data sampling and routing (curriculum, random-LTD) is not implemented: "
        "ignoring it would train on other data", accepted=_disabled),
    "expert_parallel": Refused("zerokit is data parallel only (no expert parallelism)",
                               accepted=_disabled),
    "tensor_parallel.autotp_size": Refused(
        "tensor parallelism is not implemented (zerokit is data parallel only)", accepted=_at_most_one),
    "tensor_parallel.tensor_parallel.tp_size": Refused(
        "tensor parallelism is not implemented (zerokit is data parallel only)", accepted=_at_most_one),
    # ---- removed from DeepSpeed too (its message, in short) -----------------------------------
    **{key: Refused(f"{what}: {_DS_REMOVED}") for key, what in [
        ("nebula", "Nebula checkpointing"), ("compression_training", "the compression library"),
        ("amp", "Apex AMP (use fp16 or bf16)"), ("quantize_training", "Mixture-of-Quantization"),
        ("sparse_gradients", "sparse embedding gradients"), ("eigenvalue", "eigenvalue MoQ"),
        ("sparse_attention", "Sparse Attention"), ("elasticity", "elastic training"),
        ("graph_harvesting", "graph harvesting"), ("curriculum_learning", "the legacy curriculum "
                                                                           "(use data_efficiency)"),
        ("progressive_layer_drop", "Progressive Layer Dropping")]},
    **{f"zero_optimization.{key}": Refused(f"{what}: {_DS_REMOVED}") for key, what in [
        ("mics_shard_size", "MiCS sharding"), ("mics_hierarchical_params_gather", "MiCS sharding"),
        ("zeropp_loco_param", "LoCo-ZeRO++")]},
}


def _lookup(raw: dict, parts: tuple[str, ...]) -> tuple[dict | None, bool]:
    parent: Any = raw
    for part in parts[:-1]:
        parent = parent.get(part) if isinstance(parent, dict) else None
    return (parent, True) if isinstance(parent, dict) and parts[-1] in parent else (None, False)


def refused_message(path: str, value: Any, entry: Refused) -> str:
    when = f"not implemented yet ({entry.issue})" if entry.issue else "refused"
    return f"{path}={value!r} is {when}: {entry.reason}"


def check_refused(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(raw without the refused keys set to an accepted value, a message per refused setting).

    The caller's dict is not changed. An accepted key that the schema declares is kept."""
    from zerokit.config.ignored import _declared

    problems, out = [], raw
    for path, entry in REFUSED.items():
        parts = tuple(path.split("."))
        parent, present = _lookup(out, parts)
        if not present:
            continue
        value = parent[parts[-1]]
        if not entry.accepts(value):
            problems.append(refused_message(path, value, entry))
        elif not _declared(parts) and not _inside_ignored(parts):
            out = without_key(out, parts)  # the ignored section around it is reported whole
    return out, problems


def _inside_ignored(parts: tuple[str, ...]) -> bool:
    from zerokit.config.ignored import IGNORED

    return any(".".join(parts[:n]) in IGNORED for n in range(1, len(parts)))


