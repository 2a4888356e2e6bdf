"""transformers' `from_pretrained` under ZeRO-3, streamed: each rank reads only its shards.

What transformers (5.x) does with DeepSpeed ZeRO-3 on (an HfDeepSpeedConfig of stage 3 alive,
`is_deepspeed_zero3_enabled()`): it builds the model under `deepspeed.zero.Init(
config_dict_or_path=deepspeed_config())` (`PreTrainedModel.get_init_context`), then calls
`PreTrainedModel._load_pretrained_model(model, state_dict, checkpoint_files, load_config)`. There,
rank 0 reads every tensor of every checkpoint file into one host state dict
(`load_state_dict(file, map_location="cpu")`: `safe_open(...).get_tensor(k)` for each key; the
other ranks get meta tensors), and `_load_state_dict_into_zero3_model` walks the modules: for each
it gathers the module's parameters on every rank (`deepspeed.zero.GatheredParameters(params,
modifier_rank=0)`), rank 0 copies its values in (`module._load_from_state_dict`), and the exit
broadcasts them and re-partitions; buffers are broadcast from rank 0. So rank 0 holds the whole
model in host memory (and, in transformers 4.x, every rank did: DeepSpeed #5290, #3448).

The patch point is that static method. `install()` wraps it once; zerokit's
`deepspeed.zero.Init` (compat) calls `install_if_imported()` on entry, which transformers does
just before it loads. The wrapper streams with zerokit.pretrained (see [Note: streaming load])
when the model holds zerokit-partitioned parameters and the checkpoint is safetensors files whose
keys need at most renaming (transformers' key mapping: `WeightRenaming`s and the base-model
prefix); otherwise it calls transformers' own function, saying why on rank 0 when that means the
rank-0 full load (.bin files, `WeightConverter`s that fuse or split tensors, or
ZEROKIT_PRETRAINED_STREAMING=0 in the environment, the opt-out). Loaded tensors get
`_is_hf_initialized` (so transformers does not initialise them again), missing, unexpected and
mismatched keys go back in transformers' `LoadStateDictInfo` (its report then drops tied and
ignored keys, and raises on mismatches unless `ignore_mismatched_sizes`), and the rank's
`zerokit.pretrained.LoadReport` is left on the model as `model.zerokit_load_report`.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable

from zerokit.units.registry import unit_of
from zerokit.logs import log

_original: Callable | None = None  # transformers' own _load_pretrained_model
OPT_OUT = "ZEROKIT_PRETRAINED_STREAMING"  # "0": transformers' own ZeRO-3 load


def install_if_imported() -> bool:
    """install(), but only where transformers' model loading is imported already."""
    return "transformers.modeling_utils" in sys.modules and install()


def install() -> bool:
    """Wrap `PreTrainedModel._load_pretrained_model` (idempotent). False where transformers, or
    the 5.x loading API the wrapper returns (`LoadStateDictInfo`), is not there."""
    global _original
    try:
        from transformers.core_model_loading import WeightRenaming, rename_source_key  # noqa: F401
        from transformers.modeling_utils import PreTrainedModel
        from transformers.utils.loading_report import LoadStateDictInfo  # noqa: F401
    except ImportError:
        return False
    current = PreTrainedModel.__dict__.get("_load_pretrained_model")
    if current is None:
        return False
    function = getattr(current, "__func__", current)
    if function is _load_pretrained_model:
        return True
    _original = function
    PreTrainedModel._load_pretrained_model = staticmethod(_load_pretrained_model)
    return True


def _load_pretrained_model(model, state_dict, checkpoint_files, load_config, expected_keys=None):
    """transformers' signature and return value: (LoadStateDictInfo, disk_offload_index)."""
    why_not = _why_not_streamed(model, state_dict, checkpoint_files, load_config)
    if why_not is not None:
        if why_not:
            _warn_rank0(f"zerokit: from_pretrained is not streamed ({why_not}); transformers' "
                        f"ZeRO-3 load has rank 0 read the whole checkpoint into host memory")
        return _original(model, state_dict, checkpoint_files, load_config, expected_keys)
    from transformers.utils.loading_report import LoadStateDictInfo

    from zerokit.pretrained import load_pretrained_sharded, state_dict_targets

    # Mismatches are reported, not raised: transformers' report raises on them itself unless
    # ignore_mismatched_sizes, and otherwise initialises those keys as it does for missing ones.
    report = load_pretrained_sharded(model, checkpoint_files, rename=_hf_rename(model, load_config),
                                     ignore_mismatched_sizes=True)
    targets = state_dict_targets(model)
    for key in report.loaded_keys:
        targets[key]._is_hf_initialized = True  # transformers skips initialising these
    model.zerokit_load_report = report
    info = LoadStateDictInfo(missing_keys=set(report.missing_keys),
                             unexpected_keys=set(report.unexpected_keys),
                             mismatched_keys=set(report.mismatched_keys), error_msgs=[],
                             conversion_errors={}, skipped_pp_keys=set())
    return info, None


def _why_not_streamed(model, state_dict, checkpoint_files, load_config) -> str | None:
    """None to stream; "" to use transformers' path silently (not ours to take); else why not."""
    from transformers.core_model_loading import WeightConverter
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled() or load_config.is_quantized or state_dict is not None:
        return ""  # not ZeRO-3, quantized, or the values are in memory already
    if not any(unit_of(p) is not None for p in model.parameters()):
        return ""  # not built under zerokit's zero.Init (e.g. a real DeepSpeed's)
    if os.environ.get(OPT_OUT, "1").strip() == "0":
        return f"{OPT_OUT}=0"
    if not checkpoint_files:
        return "no checkpoint files"
    others = [f for f in checkpoint_files if not str(f).endswith(".safetensors")]
    if others:
        return f"{others[0]} is not safetensors"
    converters = [w for w in (load_config.weight_mapping or []) if isinstance(w, WeightConverter)]
    if converters:
        return (f"the model's weight conversions fuse or split tensors ({len(converters)} "
                f"WeightConverter(s), e.g. {converters[0].source_patterns})")
    return None


def _hf_rename(model, load_config) -> Callable[[str], str]:
    """Checkpoint key -> model key, as transformers' own loader renames (convert_and_load_
    state_dict_in_model): its WeightRenamings, then the base-model prefix added or stripped."""
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    from zerokit.pretrained import state_dict_targets

    renamings = [w for w in (load_config.weight_mapping or []) if isinstance(w, WeightRenaming)]
    keys: dict[str, Any] = dict.fromkeys(state_dict_targets(model), True)
    prefix = model.base_model_prefix

    def rename(key: str) -> str:
        renamed, _ = rename_source_key(key, renamings, [], prefix, keys)
        if renamed not in keys and key in keys:  # a key the renamings should not have touched
            renamed, _ = rename_source_key(key, [], [], prefix, keys)
        return renamed
    return rename


def _warn_rank0(message: str) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        log.warning(message)
