"""Every key of DeepSpeed's config is classified by zerokit: implemented (a schema field, or an old
name read as one), accepted and ignored with a reason, or refused by name (with the issue that
will implement it, where one will). The keys come from DeepSpeed 0.19.8's own sources: its key
constants and its pydantic config models. docs/deepspeed.md's table lists each of them.
"""
from __future__ import annotations

import importlib
import os

import pytest

from zerokit.config import IGNORED, REFUSED, ConfigError, load_config
from zerokit.config.aliases import ALIASES
from zerokit.config.ignored import _declared
from zerokit.config.legacy import rename_legacy

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = {"train_micro_batch_size_per_gpu": 1}

# runtime/constants.py: the section each prefixed constant's key lives in (the rest are top level).
SECTION_OF_PREFIX = [
    ("BFLOAT16_", "bf16"), ("CHECK_OVERFLOW", "bf16"), ("FP16_", "fp16"),
    ("TORCH_AUTOCAST_", "torch_autocast"), ("CHECKPOINT_", "checkpoint"),
    ("LOAD_UNIVERSAL_CHECKPOINT", "checkpoint"), ("USE_NODE_LOCAL_STORAGE_CHECKPOINT", "checkpoint"),
    ("GRAD_ACCUM_DTYPE", "data_types"), ("PARAM_DTYPE", "data_types"), ("BUFFER_DTYPE", "data_types"),
    ("KEEP_IN_FP32_MODULES", "data_types"), ("OPTIMIZER_PARAMS", "optimizer"), ("TYPE", "optimizer"),
    ("LEGACY_FUSION", "optimizer"), ("SCHEDULER_PARAMS", "scheduler"), ("MAX_GRAD_NORM", "optimizer.params"),
]
# runtime/constants.py names that are not config keys (values of keys, internal names).
NOT_KEYS = {"ROUTE_TRAIN", "ROUTE_EVAL", "ROUTE_PREDICT", "ROUTE_ENCODE", "GRADIENT_ALLREDUCE_OP_MEAN",
            "GRADIENT_ALLREDUCE_OP_SUM", "PIPE_REPLICATED", "DATA_PARALLEL_GROUP", "GLOBAL_RANK",
            "DDP_BFLOAT16", "BFLOAT16_OLD", "CHECKPOINT_PARALLEL_WRITE_PIPELINE_STAGE",
            "CHECKPOINT_TAG_VALIDATION_MODES", "TORCH_AUTOCAST"}
# Top-level sections that other DeepSpeed modules define (module, constant) or name inline.
OTHER_SECTIONS = [
    ("deepspeed.runtime.swap_tensor.constants", "AIO"),
    ("deepspeed.runtime.activation_checkpointing.config", "ACT_CHKPT"),
    ("deepspeed.profiling.constants", "FLOPS_PROFILER"),
    ("deepspeed.autotuning.constants", "AUTOTUNING"),
    ("deepspeed.comm.constants", "COMMS_LOGGER"),
    ("deepspeed.runtime.data_pipeline.constants", "DATA_EFFICIENCY"),
    ("deepspeed.runtime.data_pipeline.constants", "CURRICULUM_LEARNING"),
    ("deepspeed.datastates.config", "DATASTATES_CHECKPOINTING"),
    ("deepspeed.utils.config", "TIMERS"),
    ("deepspeed.runtime.config", "EXPERT_PARALLEL"),
]
# runtime/config.py reads these sections by literal name (param_dict.get("pipeline"), ...).
INLINE_SECTIONS = ["zero_optimization", "pipeline", "hybrid_engine", "weight_quantization", "compile",
                   "tensor_parallel", "tensorboard", "wandb", "csv_monitor", "comet", "torch_autocast",
                   "bfloat16"]


def _deepspeed():
    """DeepSpeed's sources, from the real DeepSpeed of the `bench` extra (never the compat one)."""
    try:
        ds = importlib.import_module("deepspeed")
    except ImportError:
        pytest.skip("the real DeepSpeed is not installed: install zerokit's `bench` extra "
                    "(deepspeed==0.19.8) to check zerokit's table against its config keys")
    if "zerokit" in getattr(ds, "__version__", ""):
        pytest.skip("`import deepspeed` is zerokit's compatibility layer here; the real DeepSpeed "
                    "(the `bench` extra) is needed to read its config keys")
    return ds


def _config_models() -> list:
    """(prefix, model) of DeepSpeed 0.19.8's pydantic models of the sections zerokit reads."""
    _deepspeed()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig)

    return [("zero_optimization", DeepSpeedZeroConfig),
            ("zero_optimization.offload_param", DeepSpeedZeroOffloadParamConfig),
            ("zero_optimization.offload_optimizer", DeepSpeedZeroOffloadOptimizerConfig),
            ("fp16", DeepSpeedFP16Config), ("bf16", DeepSpeedBF16Config)]


def deepspeed_aliases() -> dict[str, str]:
    """{field name path: alias path} of every aliased field of those models: DeepSpeed accepts
    both spellings (populate_by_name)."""
    return {f"{prefix}.{n}": f"{prefix}.{f.alias}" for prefix, model in _config_models()
            for n, f in model.model_fields.items() if f.alias and f.alias != n}


def deepspeed_keys() -> set[str]:
    """Dotted paths of every top-level key, and every key of zero_optimization, its offload
    sections, fp16 and bf16, that DeepSpeed 0.19.8 reads: each field by its name and by its alias."""
    _deepspeed()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime import config as ds_config
    from deepspeed.runtime import constants

    keys: set[str] = set()
    for name, value in vars(constants).items():
        if not (name.isupper() and isinstance(value, str)) or name in NOT_KEYS:
            continue
        if name.endswith(("_DEFAULT", "_FORMAT")) or "\n" in value:
            continue
        section = next((s for prefix, s in SECTION_OF_PREFIX if name.startswith(prefix)), None)
        keys.add(value if section is None or value == section else f"{section}.{value}")
    for module, name in OTHER_SECTIONS:
        keys.add(getattr(importlib.import_module(module), name))
    keys.update(INLINE_SECTIONS)
    keys.update(ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS)
    keys.update(f"zero_optimization.{k}" for k in ds_config._REMOVED_ZERO_CONFIG_KEYS)
    for prefix, model in _config_models():
        keys.update(f"{prefix}.{k}" for n, f in model.model_fields.items() for k in {n, f.alias or n})
    return keys


def _legacy_target(path: str) -> str | None:
    """The key an old DeepSpeed name is read as (config/legacy.py), if it is one."""
    head, _, last = path.rpartition(".")
    raw: dict = {}
    section = raw
    for part in filter(None, head.split(".")):
        section = section.setdefault(part, {})
    section[last] = True
    _, renamed = rename_legacy(raw)
    return renamed[0].split(" -> ")[1] if renamed else None


def classify(path: str) -> list[str]:
    """Every class the key falls in; exactly one is the contract. A key inside an ignored or
    refused section is that section's; a field's name is classified as its alias."""
    path = ALIASES.get(path, path)
    parts = path.split(".")
    found = []
    if path in IGNORED or any(".".join(parts[:n]) in IGNORED for n in range(1, len(parts))):
        found.append("ignored")
    if path in REFUSED or any(".".join(parts[:n]) in REFUSED for n in range(1, len(parts))):
        found.append("refused" if (REFUSED.get(path) is None or REFUSED[path].issue is None) else "not yet")
    if not found and (_declared(tuple(parts)) or _legacy_target(path)):
        found.append("implemented")
    if path in IGNORED and path in REFUSED:
        found.append("both tables")
    return found


def test_every_deepspeed_key_is_classified_once() -> None:
    keys = deepspeed_keys()
    assert len(keys) > 150, f"too few DeepSpeed keys found ({len(keys)}): the walk broke"
    unclassified = sorted(k for k in keys if not classify(k))
    twice = sorted((k, classify(k)) for k in keys if len(classify(k)) > 1)
    assert not unclassified, f"DeepSpeed keys zerokit does not classify: {unclassified}"
    assert not twice, f"DeepSpeed keys in more than one class: {twice}"


def test_the_docs_table_lists_every_deepspeed_key() -> None:
    with open(os.path.join(REPO, "docs", "deepspeed.md")) as f:
        doc = f.read()
    missing = sorted(k for k in deepspeed_keys() if f"`{k}`" not in doc
                     and not any(f"`{'.'.join(k.split('.')[:n])}`" in doc
                                 for n in range(1, k.count(".") + 1)
                                 if ".".join(k.split(".")[:n]) in {**IGNORED, **REFUSED}))
    assert not missing, f"docs/deepspeed.md's config table lacks: {missing}"


def test_aliases_are_deepspeeds() -> None:
    """zerokit reads as one key exactly the spellings DeepSpeed's models read as one."""
    aliases = deepspeed_aliases()
    assert len(aliases) >= 9, f"too few aliased DeepSpeed fields ({aliases}): the walk broke"
    assert ALIASES == aliases


@pytest.mark.parametrize("name", sorted(ALIASES))
def test_both_spellings_of_an_aliased_key_load_alike(name) -> None:
    """The HF Trainer + Accelerate write `gather_16bit_weights_on_model_save`: each field name
    loads as its alias, with the same value, reported under one name where ignored."""
    from zerokit.config import ignored_settings

    alias = ALIASES[name]
    value = {"zero_optimization.gather_16bit_weights_on_model_save": True,
             "zero_optimization.use_all_reduce_for_fetch_params": True,
             "zero_optimization.allgather_sequential": True}.get(name, 12345)
    loaded = []
    for key in (name, alias):
        cfg = load_config({**BASE, "zero_optimization": {"stage": 3, key.split(".")[1]: value}})
        loaded.append((cfg.zero_optimization.model_dump(), ignored_settings(cfg)))
    assert loaded[0] == loaded[1]
    if _declared(tuple(alias.split("."))):
        assert getattr(load_config({**BASE, "zero_optimization": {name.split(".")[1]: value}})
                       .zero_optimization, alias.split(".")[1]) == value


def test_two_spellings_with_different_values_are_refused() -> None:
    with pytest.raises(ConfigError, match="two spellings of one key"):
        load_config({**BASE, "zero_optimization": {"prefetch_bucket_size": 1,
                                                   "stage3_prefetch_bucket_size": 2}})


def test_every_table_entry_is_a_deepspeed_key() -> None:
    """Nothing in the tables that DeepSpeed does not have (a typo there would hide a key)."""
    keys = deepspeed_keys()
    extra = {"tensor_parallel.autotp_size", "tensor_parallel.tensor_parallel.tp_size", "comet",
             "checkpoint.checkpoint_serialization", "checkpoint.writer", "checkpoint.parallel_write",
             "bf16.check_overflow"}
    stray = sorted(p for p in [*IGNORED, *REFUSED] if p not in keys and p not in extra)
    assert not stray, f"table entries that are not DeepSpeed 0.19.8 keys: {stray}"


@pytest.mark.parametrize("raw, fragment", [
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
     "zero_optimization.zero_quantized_weights=True is refused"),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}}, "zero_hpz_partition_size=8"),
    ({"activation_checkpointing": {"contiguous_memory_optimization": True}}, "needs number_checkpoints"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     "offload_param.device 'nvme' needs offload_param.nvme_path"),
    ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel.autotp_size=2 is refused"),
    ({"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}},
     "gradient_allreduce_op='sum' is not supported with ZeRO stage 3"),
    ({"bf16": {"enabled": True, "bf16_optimizer_states": True}},
     "bf16.bf16_optimizer_states=true needs bf16.bf16_master_weights_and_grads=true"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}, "zero_optimization": {"stage": 0}},
     "needs zero_optimization.stage 1, 2 or 3"),
    ({"bf16": {"enabled": False, "bf16_master_weights_and_grads": True}, "zero_optimization": {"stage": 1}},
     "bf16.bf16_master_weights_and_grads=true needs bf16.enabled=true"),
    ({"bf16": {"enabled": True, "stochastic_rounding": True}, "zero_optimization": {"stage": 1}},
     "bf16.stochastic_rounding=true needs bf16.bf16_master_weights_and_grads=true"),
    ({"elasticity": {"enabled": False}}, "removed from DeepSpeed itself"),
])
def test_refused_keys_name_themselves(raw, fragment) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({**BASE, **raw})
    assert fragment in str(info.value), str(info.value)


def test_defaults_of_refused_keys_load() -> None:
    """Configs that spell out DeepSpeed's defaults for refused features still load."""
    cfg = load_config({**BASE, "zero_optimization": {
        "stage": 3, "zero_quantized_weights": False, "zero_quantized_gradients": False,
        "zero_hpz_partition_size": 1}, "activation_checkpointing": {
        "partition_activations": False, "cpu_checkpointing": False, "number_checkpoints": None},
        "tensor_parallel": {"autotp_size": 1}, "gradient_allreduce_op": "mean"})
    assert cfg.zero_optimization.stage == 3
    assert [p for p, _, _ in __import__("zerokit.config", fromlist=["x"]).ignored_settings(cfg)] == [
        "tensor_parallel"]


def test_a_typo_still_names_the_nearest_key() -> None:
    with pytest.raises(ConfigError, match="did you mean 'round_robin_gradients'"):
        load_config({**BASE, "zero_optimization": {"round_robin_gradient": True}})
    with pytest.raises(ConfigError, match="did you mean 'sub_group_size'"):
        load_config({**BASE, "zero_optimization": {"sub_group_sise": 1}})


def _describe(path: str) -> tuple[str, str]:
    """(zerokit's answer, why) for one DeepSpeed key, as docs/deepspeed.md shows it."""
    from zerokit.config.errors import _model_at

    if path in ALIASES:
        shown, _ = _describe(ALIASES[path])
        return shown, (f"DeepSpeed's field name for `{ALIASES[path]}`: the same key (DeepSpeed "
                       f"accepts both spellings)")
    kind = classify(path)[0]
    parts = path.split(".")
    owner = next(".".join(parts[:n]) for n in range(len(parts), 0, -1)
                 if ".".join(parts[:n]) in {**IGNORED, **REFUSED} or n == 1)
    if kind == "ignored":
        entry = IGNORED.get(path) or IGNORED[owner]
        honoured = f" ({_values(entry.honoured)} is what zerokit does: not reported)" if entry.honoured else ""
        return "accepted, ignored, reported at start-up" + honoured, entry.reason
    if kind in ("refused", "not yet"):
        entry = REFUSED.get(path) or REFUSED[owner]
        shown = f"not yet ({entry.issue})" if entry.issue else "refused"
        if callable(entry.accepted):
            shown += {"_disabled": " unless enabled is false", "_all_off": " unless every option is off",
                      "_at_most_one": " above 1"}[entry.accepted.__name__]
        elif entry.accepted:
            shown += f" unless {_values(entry.accepted)}"
        return shown, entry.reason
    target = _legacy_target(path)
    if target:
        return "implemented", f"DeepSpeed's old name for `{target}`, read as it (reported at start-up)"
    model = _model_at(__import__("zerokit.config", fromlist=["x"]).ZeroKitConfig, tuple(parts))
    field = next((f for n, f in model.model_fields.items() if parts[-1] in (n, f.alias)), None)
    return "implemented", (field.description or "as DeepSpeed") if field else "as DeepSpeed"


def _values(values: tuple) -> str:
    import json

    return " or ".join(f"`{json.dumps(v)}`" for v in values)


def config_table() -> str:
    """The markdown table of docs/deepspeed.md (python tests/unit/test_deepspeed_keys.py)."""
    rows = ["| DeepSpeed key | zerokit | what it means here |", "|---|---|---|"]
    for path in sorted(deepspeed_keys(), key=lambda p: (p.count(".") > 0, p.split(".")[0], p)):
        shown, why = _describe(path)
        rows.append(f"| `{path}` | {shown} | {why.replace('|', '/')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(config_table())
