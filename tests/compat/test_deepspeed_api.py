"""zerokit.compat.deepspeed: every mirrored module path and name, and the engine's DeepSpeed API.

World size 1 in this process (zerokit needs no process group there). The training checks are
scale-sensitive (SGD, no momentum) against plain torch.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import math

import pytest
import torch

from reference import SEQ, global_batches, tiny_gpt

MIRRORED = {
    "zerokit.compat.deepspeed": ["initialize", "add_config_arguments", "init_distributed", "DeepSpeedEngine",
                                 "get_accelerator", "__version__", "zero", "comm", "ops", "runtime", "utils"],
    "zerokit.compat.deepspeed.accelerator": ["get_accelerator"],
    "zerokit.compat.deepspeed.accelerator.real_accelerator": ["get_accelerator"],
    "zerokit.compat.deepspeed.comm": ["init_distributed", "is_initialized", "get_rank", "get_world_size",
                                      "get_local_rank", "barrier", "all_reduce", "broadcast", "all_gather",
                                      "all_gather_into_tensor", "reduce_scatter_tensor", "ReduceOp"],
    "zerokit.compat.deepspeed.comm.comm": ["init_distributed", "get_rank"],
    "zerokit.compat.deepspeed.ops.adam": ["FusedAdam", "DeepSpeedCPUAdam"],
    "zerokit.compat.deepspeed.ops.adagrad": ["DeepSpeedCPUAdagrad"],
    "zerokit.compat.deepspeed.ops.lion": ["DeepSpeedCPULion"],
    "zerokit.compat.deepspeed.runtime.zero": ["Init", "GatheredParameters", "register_external_parameter",
                                              "ZeroParamStatus"],
    "zerokit.compat.deepspeed.runtime.zero.partition_parameters": [
        "ZeroParamStatus", "zero_wrapper_for_fp_tensor_constructor", "_orig_torch_arange", "Init",
        "GatheredParameters", "get_accelerator"],
    "zerokit.compat.deepspeed.runtime.engine": ["DeepSpeedEngine"],
    "zerokit.compat.deepspeed.runtime.zero.stage_1_and_2": ["estimate_zero2_model_states_mem_needs_all_live"],
    "zerokit.compat.deepspeed.runtime.zero.stage3": ["estimate_zero3_model_states_mem_needs_all_live"],
    "zerokit.compat.deepspeed.runtime.lr_schedules": ["VALID_LR_SCHEDULES", "WarmupLR", "WarmupDecayLR",
                                                      "WarmupCosineLR"],
    "zerokit.compat.deepspeed.checkpoint.utils": ["clone_tensors_for_torch_save"],
    "zerokit.compat.deepspeed.utils": ["logger", "zero_to_fp32", "set_z3_leaf_modules", "groups"],
    "zerokit.compat.deepspeed.utils.groups": ["_get_data_parallel_group", "_get_data_parallel_world_size",
                                              "_get_data_parallel_rank"],
    "zerokit.compat.deepspeed.utils.zero_to_fp32": ["get_fp32_state_dict_from_zero_checkpoint",
                                                    "load_state_dict_from_zero_checkpoint",
                                                    "convert_zero_checkpoint_to_fp32_state_dict"],
    "zerokit.compat.deepspeed.moe.utils": ["split_params_into_different_moe_groups_for_optimizer"],
    "zerokit.compat.deepspeed.compression.helper": ["recursive_getattr", "recursive_setattr"],
}

@pytest.fixture(autouse=True, scope="module")
def _no_group_left_behind():
    """deepspeed.initialize forms a world-of-one process group, as DeepSpeed does: end it here."""
    had_group = torch.distributed.is_initialized()
    yield
    if not had_group and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


ENGINE_API = ["forward", "backward", "step", "train", "eval", "zero_grad", "module", "local_rank", "config",
              "bfloat16_enabled", "fp16_enabled", "gradient_accumulation_steps", "train_batch_size",
              "train_micro_batch_size_per_gpu", "set_gradient_accumulation_boundary", "get_global_grad_norm",
              "zero_gather_16bit_weights_on_model_save", "_zero3_consolidated_16bit_state_dict", "tput_timer",
              "save_checkpoint", "load_checkpoint", "overflow", "global_steps"]


@pytest.mark.parametrize("path", sorted(MIRRORED))
def test_mirrored_paths_import_and_names_exist(path):
    module = importlib.import_module(path)
    missing = [n for n in MIRRORED[path] if not hasattr(module, n)]
    assert not missing, f"{path} lacks {missing}"


def test_version_and_no_real_deepspeed():
    """In a fresh interpreter (other tests in this process may import transformers, which may
    import the real DeepSpeed installed by the bench extra): importing every mirrored module
    leaves no real `deepspeed` in sys.modules."""
    import subprocess
    import sys

    import zerokit.compat.deepspeed as ds

    assert ds.__version__ == f"{ds.DEEPSPEED_API_VERSION}+zerokit"
    code = ("import sys, pkgutil, importlib, zerokit.compat.deepspeed as ds\n"
            "for m in pkgutil.walk_packages(ds.__path__, 'zerokit.compat.deepspeed.'):\n"
            "    importlib.import_module(m.name)\n"
            "real = sys.modules.get('deepspeed')\n"
            "print('real deepspeed imported' if real is not None and real is not ds else 'ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "ok", "the compatibility layer imported a real DeepSpeed"


def _config(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "zero_optimization": {"stage": 2}, **extra}


def _engine(config: dict, lr: float = 0.5):
    import zerokit.compat.deepspeed as deepspeed

    model = tiny_gpt()
    return deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
                                config_params=config)


def test_engine_answers_the_deepspeed_api():
    engine, optimizer, _, _ = _engine(_config(gradient_clipping=1e6))
    missing = [n for n in ENGINE_API if not hasattr(engine, n)]
    assert not missing
    assert engine.config.get("zero_optimization", {}).get("stage") == 2  # the HF Trainer's read
    assert engine.config.gradient_clipping == 1e6  # zerokit's typed view
    assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps()) == (4, 2, 2)
    assert not engine.bfloat16_enabled() and not engine.fp16_enabled()
    assert engine.local_rank == 0 and engine.zero_optimization_stage() == 2
    assert engine.transformer is engine.module.transformer  # forwarded to the wrapped module
    with pytest.raises(AttributeError, match="no_such_thing"):
        engine.no_such_thing
    # As DeepSpeed: engine.optimizer is the wrapper initialize returned, the torch one inside it.
    assert optimizer is engine.optimizer and optimizer.overflow is False
    assert isinstance(optimizer.optimizer, torch.optim.SGD)
    assert optimizer.param_groups is optimizer.optimizer.param_groups
    assert "exclude_frozen_parameters" in inspect.signature(engine.save_checkpoint).parameters
    assert engine.zero_gather_16bit_weights_on_model_save() is False
    engine.destroy()


def test_scale_wrt_gas_and_grad_norm_after_step():
    """The HF Trainer divides the loss by the accumulation steps itself and passes
    scale_wrt_gas=False, then asks get_global_grad_norm() after step(): SGD without momentum
    makes both scale-sensitive."""
    lr = 0.5
    engine, _, _, _ = _engine(_config(gradient_clipping=1e6), lr=lr)
    (x, y), = global_batches(1, 4)
    for micro in range(2):
        loss = engine(x[2 * micro:2 * micro + 2], y[2 * micro:2 * micro + 2])
        engine.backward(loss / 2, scale_wrt_gas=False)
        engine.step()
    assert engine.global_steps == 1
    ref = tiny_gpt()
    ref(x, y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")).item()
    with torch.no_grad():
        for p in ref.parameters():
            p -= lr * p.grad
    assert math.isclose(engine.get_global_grad_norm(), ref_norm, rel_tol=1e-5)
    got = engine.consolidated_fp32_state_dict()
    for name, w in ref.named_parameters():
        torch.testing.assert_close(got[name], w.detach(), rtol=1e-5, atol=1e-6)
    engine.destroy()


def test_set_gradient_accumulation_boundary_overrides_the_count():
    engine, _, _, _ = _engine(_config())
    (x, y), = global_batches(1, 2)
    engine.set_gradient_accumulation_boundary(False)
    engine.backward(engine(x, y))
    engine.step()
    assert engine.global_steps == 0
    engine.set_gradient_accumulation_boundary(True)  # Accelerate's sync_gradients
    engine.backward(engine(x, y))
    engine.step()
    engine.backward(engine(x, y))
    engine.step()
    assert engine.global_steps == 2  # each boundary steps, whatever gradient_accumulation_steps says
    engine.destroy()


def test_tput_timer_counts_after_warmup():
    engine, _, _, _ = _engine(_config(gradient_accumulation_steps=1, train_micro_batch_size_per_gpu=2))
    for x, y in global_batches(4, 2):
        engine.backward(engine(x, y))
        engine.step()
    t = engine.tput_timer
    assert t.global_step_count == 4 and t.batch_size == 2
    assert 0 < t.avg_samples_per_sec() < math.inf
    engine.destroy()


def test_stage3_ds_views_and_gathered_edit():
    """ds_* read the unit; a resize_token_embeddings-style slice assignment under
    GatheredParameters(modifier_rank=0) reaches the shards and the fp32 master."""
    import zerokit.compat.deepspeed as deepspeed
    from zerokit.compat.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    engine, _, _, _ = _engine(_config(zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0}))
    w = engine.module.transformer.wte.weight
    assert w.ds_numel == w.numel() and w.ds_shape == w.shape
    # world 1: the whole parameter is this rank's shard, and that shard is the weights the forward
    # reads ([Note: one rank's shard is its weights]): always available, never released
    assert w.ds_status is ZeroParamStatus.AVAILABLE
    assert w.ds_tensor.numel() == w.numel() and w.ds_tensor.data_ptr() == w.data_ptr()
    ids = [p.ds_id for p in engine.module.parameters()]
    assert ids == list(range(len(ids)))
    with pytest.raises(AttributeError):
        w.ds_numel = 3  # read-only
    with deepspeed.zero.GatheredParameters([w], modifier_rank=0):
        assert w.ds_status is ZeroParamStatus.AVAILABLE
        w.data[:3, :] = 0.25
    assert w.ds_status is ZeroParamStatus.AVAILABLE
    fp32 = engine.consolidated_fp32_state_dict()
    assert torch.equal(fp32["transformer.wte.weight"][:3], torch.full((3, w.shape[1]), 0.25))
    sd16 = engine._zero3_consolidated_16bit_state_dict()
    assert set(sd16) >= {n for n, _ in engine.module.named_parameters(remove_duplicate=False)}
    for name, v in sd16.items():
        if name in fp32:
            assert torch.equal(v, fp32[name].to(v.dtype)), name
    engine.destroy()


def _ds_status_with_ranks(rank: int, world: int) -> list[str]:
    import zerokit.compat.deepspeed as deepspeed
    from zerokit.compat.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    engine, _, _, _ = _engine(_config(zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0}))
    w = engine.module.transformer.wte.weight
    seen = [w.ds_status, 0 < w.ds_tensor.numel() < w.numel()]  # its part of this rank's shard
    with deepspeed.zero.GatheredParameters([w], modifier_rank=0):
        seen.append(w.ds_status)
    seen.append(w.ds_status)
    engine.destroy()
    return [str(x) for x in seen]


def test_stage3_ds_status_with_ranks_is_released_between_uses():
    """Two ranks: a rank's shard is half the parameter, gathered only while in use."""
    from harness import run_world

    for seen in run_world(_ds_status_with_ranks, 2):
        assert seen == ["ZeroParamStatus.NOT_AVAILABLE", "True", "ZeroParamStatus.AVAILABLE",
                        "ZeroParamStatus.NOT_AVAILABLE"], seen


def test_args_deepspeed_config_and_one_config_only(tmp_path):
    import json

    import zerokit.compat.deepspeed as deepspeed

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_config()))
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    model = tiny_gpt()
    engine, *_ = deepspeed.initialize(args=args, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert engine.gradient_accumulation_steps() == 2 and engine.config["zero_optimization"] == {"stage": 2}
    engine.destroy()
    with pytest.raises(ValueError, match="2 times"):
        deepspeed.initialize(args=args, model=tiny_gpt(), config=_config())
    with pytest.raises(NotImplementedError, match="mpu"):
        deepspeed.initialize(model=tiny_gpt(), config=_config(), mpu=object())


def test_ops_signatures_follow_deepspeed():
    from zerokit.compat.deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from zerokit.compat.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from zerokit.compat.deepspeed.ops.lion import DeepSpeedCPULion

    params = [torch.nn.Parameter(torch.zeros(3))]
    assert FusedAdam(params).param_groups[0]["decoupled_weight_decay"] is True
    assert FusedAdam(params, adam_w_mode=False).param_groups[0]["decoupled_weight_decay"] is False
    cpu_adam = DeepSpeedCPUAdam(params, 1e-3, False)  # DeepSpeed's positional order: lr, bias_correction
    assert cpu_adam.param_groups[0]["bias_correction"] is False and cpu_adam.param_groups[0]["adamw_mode"]
    assert DeepSpeedCPULion(params).param_groups[0]["betas"] == (0.9, 0.999)  # DeepSpeed's defaults
    assert DeepSpeedCPUAdagrad(params).param_groups[0]["lr"] == 1e-2
    # fp32_optimizer_states=False: moments in the parameters' dtype (engine/bf16_state.py)
    assert DeepSpeedCPUAdam(params, fp32_optimizer_states=False).fp32_optimizer_states is False
    assert DeepSpeedCPULion(params, fp32_optimizer_states=False).defaults["fp32_optimizer_states"] is False
    with pytest.raises(ValueError, match="fp32_optimizer_states='no' must be a bool"):
        DeepSpeedCPUAdagrad(params, fp32_optimizer_states="no")


def test_accelerator_comm_and_utils_on_one_process():
    from zerokit.compat.deepspeed import comm
    from zerokit.compat.deepspeed.accelerator import get_accelerator
    from zerokit.compat.deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    from zerokit.compat.deepspeed.compression.helper import recursive_getattr, recursive_setattr
    from zerokit.compat.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from zerokit.compat.deepspeed.utils import set_z3_leaf_modules

    acc = get_accelerator()
    assert acc.device_name() in ("cpu", "cuda")
    for fn in (acc.memory_allocated, acc.max_memory_allocated, acc.memory_reserved, acc.max_memory_reserved):
        assert isinstance(fn(), int) and fn() >= 0
    acc.reset_peak_memory_stats()
    acc.manual_seed_all(3)
    assert (comm.get_rank(), comm.get_world_size()) == (0, 1)
    model = tiny_gpt()
    assert recursive_getattr(model, "transformer.h.1") is model.transformer.h[1]
    recursive_setattr(model, "transformer.h.1", torch.nn.Identity())
    assert isinstance(model.transformer.h[1], torch.nn.Identity)
    big = torch.arange(10.0)
    cloned = clone_tensors_for_torch_save({"a": [big[:2]]})
    assert cloned["a"][0].untyped_storage().nbytes() == 2 * 4
    groups = split_params_into_different_moe_groups_for_optimizer({"params": model.parameters(), "lr": 0.1})
    assert len(groups) == 1 and groups[0]["lr"] == 0.1
    from zerokit.compat.deepspeed.utils import get_z3_leaf_modules, unset_z3_leaf_modules

    marked = set_z3_leaf_modules(model, [torch.nn.LayerNorm])  # zerokit/units/leaf.py
    assert marked and get_z3_leaf_modules(model) == marked
    assert unset_z3_leaf_modules(model, ["LayerNorm"]) == marked and not get_z3_leaf_modules(model)
    with pytest.raises(ValueError, match="Conv2d"):
        set_z3_leaf_modules(model, [torch.nn.Conv2d])
