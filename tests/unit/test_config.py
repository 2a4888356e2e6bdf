"""Bad configurations are refused with a message naming the key, the value and what is allowed."""
from __future__ import annotations

import json

import pytest
import torch

from zerokit.config import ConfigError, ZeroKitConfig, load_config, resolve_auto

BASE = {"train_micro_batch_size_per_gpu": 2}

BAD = [
    # (config, world size for the batch rule, fragments the message must contain)
    ({**BASE, "zero_optimization": {"stgae": 2}}, 1, ["zero_optimization.stgae", "did you mean 'stage'"]),
    ({**BASE, "train_batchsize": 8}, 1, ["train_batchsize", "train_batch_size"]),
    ({**BASE, "zero_optimization": {"stage": 4}}, 1, ["zero_optimization.stage", "less than or equal to 3", "4"]),
    ({**BASE, "zero_optimization": {"stage": -1}}, 1, ["zero_optimization.stage", "greater than or equal to 0"]),
    ({**BASE, "optimizer": {"type": "Adamx"}}, 1, ["optimizer.type", "'AdamW'", "Adamx"]),
    # DeepSpeed matches torch class names exactly: "sgd" is refused there too
    ({**BASE, "optimizer": {"type": "sgd"}}, 1, ["optimizer.type", "'SGD'", "sgd"]),
    ({**BASE, "optimizer": {"type": "AdamW", "params": {"lrr": 1e-3}}}, 1, ["lrr", "did you mean 'lr'"]),
    ({**BASE, "optimizer": {"type": "SGD", "params": {"lr": -1.0}}}, 1, ["optimizer.params.lr", "-1.0"]),
    ({**BASE, "optimizer": {"params": {"lr": 1e-3}}}, 1, ["optimizer.type", "Field required"]),
    ({**BASE, "scheduler": {"type": "WarmupCosineLR", "params": {}}}, 1, ["WarmupCosineLR", "total_num_steps"]),
    ({**BASE, "scheduler": {"type": "OneCycle"}}, 1, ["scheduler.type", "WarmupLR", "OneCycle"]),
    ({**BASE, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, 1, ["fp16.enabled", "bf16.enabled", "contradict"]),
    ({**BASE, "fp16": {"enabled": True, "loss_scale": -2}}, 1, ["fp16.loss_scale", "-2"]),
    ({**BASE, "fp16": {"enabled": True, "loss_scale_windw": 10}}, 1, ["fp16.loss_scale_windw", "loss_scale_window"]),
    ({**BASE, "gradient_clipping": -1.0}, 1, ["gradient_clipping", "-1.0"]),
    ({**BASE, "zero_optimization": {"reduce_bucket_size": 0}}, 1, ["reduce_bucket_size", "greater than 0"]),
    ({**BASE, "communication_data_type": "fp8"}, 1, ["communication_data_type", "fp8", "'fp32'"]),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, 2,
     ["train_batch_size=10", "train_micro_batch_size_per_gpu=2", "gradient_accumulation_steps=2", "world_size=2", "= 8"]),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, 2, ["train_batch_size=10", "not a multiple"]),
    ({"gradient_accumulation_steps": 4}, 1, ["train_batch_size", "train_micro_batch_size_per_gpu"]),
    ({**BASE, "zero_optimization": {"stage": "two"}}, 1, ["zero_optimization.stage", "two"]),
    ({**BASE, "bf16": {"enabled": "maybe"}}, 1, ["bf16.enabled", "maybe"]),
]


@pytest.mark.parametrize("config,world,fragments", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_config_is_a_clear_error(config, world, fragments) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(config).resolve_batch(world)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from: {message}"


@pytest.mark.parametrize("given,world,expected", [
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}, 2, (16, 4, 2)),
    ({"train_batch_size": 16, "gradient_accumulation_steps": 2}, 2, (16, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
    ({"train_batch_size": 8}, 4, (8, 2, 1)),
    ({"train_micro_batch_size_per_gpu": 3}, 1, (3, 3, 1)),
    ({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, 2, (12, 3, 2)),
])
def test_batch_rule_any_two_give_the_third(given, world, expected) -> None:
    assert load_config(given).resolve_batch(world) == expected


def test_config_from_json_path_and_model(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**BASE, "zero_optimization": {"stage": 2}}))
    cfg = load_config(str(path))
    assert cfg.zero_optimization.stage == 2
    assert load_config(cfg) is cfg
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "missing.json"))
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(str(tmp_path / "broken.json"))
    with pytest.raises(ConfigError, match="must be a dict"):
        load_config(42)


def test_config_surface_is_locked() -> None:
    """Adding or renaming a key is a decision: this list changes with it, in the same commit."""
    assert sorted(ZeroKitConfig.model_fields) == sorted([
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
        "optimizer", "scheduler", "fp16", "bf16", "gradient_clipping", "zero_optimization",
        "communication_data_type", "steps_per_print", "wall_clock_breakdown", "comm_timeout_s",
        "checkpoint", "prescale_gradients", "gradient_predivide_factor",
        "preemption", "nonfinite",  # issue #19: preemption, nonfinite
        "activation_checkpointing",  # issue #18
        "aio",  # issue #16: the I/O engine of offload_optimizer device 'nvme'
        "gradient_allreduce_op",  # issue #25: DeepSpeed's 'sum'
        "memory"])  # issue #28: budgets per tier, enforced by the ledger


def test_memory_budget_keys() -> None:
    """The memory section: sizes as bytes or '20GiB'; 'auto' for host only; errors name the key."""
    import torch

    from zerokit.config.schema import MemoryConfig, parse_size

    assert sorted(MemoryConfig.model_fields) == ["device", "host", "nvme", "rss_margin"]
    cfg = load_config({**BASE, "memory": {"host": "auto", "device": "1.5GiB", "nvme": 10**9}})
    assert parse_size(cfg.memory.device, "memory.device") == int(1.5 * 2**30)
    assert cfg.memory.host == "auto"  # resolved at initialize (engine/host_budget.py budgets)
    with pytest.raises(ConfigError, match=r"memory\.device must be a positive number of bytes"):
        load_config({**BASE, "memory": {"device": "lots"}})
    with pytest.raises(ConfigError, match=r'memory\.device="auto"'):  # only host has an "auto"
        resolve_auto(load_config({**BASE, "memory": {"device": "auto"}}), torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="did you mean 'host'"):
        load_config({**BASE, "memory": {"hots": "1GiB"}})


def test_nvme_optimizer_keys_surface() -> None:
    """offload_optimizer's nvme keys and the aio section: every DeepSpeed key declared."""
    from zerokit.config.schema import AioSection, OffloadOptimizerConfig

    assert {"nvme_path", "buffer_count", "pipeline_read", "pipeline_write", "fast_init",
            "max_in_cpu"} <= set(OffloadOptimizerConfig.model_fields)
    assert sorted(AioSection.model_fields) == sorted([
        "block_size", "queue_depth", "thread_count", "intra_op_parallelism", "single_submit",
        "overlap_events", "use_gds"])
    cfg = load_config({**BASE, "aio": {"block_size": 65536, "intra_op_parallelism": 3,
                                       "thread_count": 2}})
    engine = cfg.aio.engine_config()
    assert (engine.block_size, engine.thread_count) == (65536, 3)
    with pytest.raises(ConfigError, match="use_gds"):
        load_config({**BASE, "aio": {"use_gds": True}})


# Strict types: pydantic's lax mode would turn "yes"/"on"/1 into True and "10" into 10, so a typo'd
# or templated value silently meant something. JSON ints for float fields, and whole-number
# floats such as 5e8 for int fields (DeepSpeed configs write bucket sizes so), stay accepted.
STRICT = [
    ({**BASE, "zero_optimization": {"overlap_comm": "yes"}}, ["zero_optimization.overlap_comm", "'yes'"]),
    ({**BASE, "zero_optimization": {"contiguous_gradients": 1}}, ["zero_optimization.contiguous_gradients", "1"]),
    ({**BASE, "zero_optimization": {"reduce_scatter": "on"}}, ["zero_optimization.reduce_scatter", "'on'"]),
    ({**BASE, "zero_optimization": {"reshard_after_forward": "false"}}, ["reshard_after_forward", "'false'"]),
    ({**BASE, "fp16": {"enabled": "on"}}, ["fp16.enabled", "'on'"]),
    ({**BASE, "fp16": {"enabled": True, "auto_cast": "true"}}, ["fp16.auto_cast", "'true'"]),
    ({**BASE, "fp16": {"enabled": True, "consecutive_hysteresis": 0}}, ["fp16.consecutive_hysteresis", "0"]),
    ({**BASE, "bf16": {"enabled": 1}}, ["bf16.enabled", "1"]),
    ({**BASE, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": "yes"}}},
     ["zero_optimization.offload_param.pin_memory", "'yes'"]),
    ({**BASE, "zero_optimization": {"stage": 1, "offload_optimizer": {
        "device": "cpu", "delayed_update": {"enabled": "yes"}}}},
     ["zero_optimization.offload_optimizer.delayed_update.enabled", "'yes'"]),
    ({**BASE, "checkpoint": {"async_save": "false"}}, ["checkpoint.async_save", "'false'"]),
    ({**BASE, "wall_clock_breakdown": "yes"}, ["wall_clock_breakdown", "'yes'"]),
    ({**BASE, "zero_optimization": {"stage": "1"}}, ["zero_optimization.stage", "'1'"]),
    ({**BASE, "zero_optimization": {"stage": True}}, ["zero_optimization.stage", "True"]),
    ({**BASE, "steps_per_print": "10"}, ["steps_per_print", "'10'"]),
    ({**BASE, "zero_optimization": {"allgather_bucket_size": 2.5}}, ["allgather_bucket_size", "2.5"]),
    ({"train_micro_batch_size_per_gpu": "2"}, ["train_micro_batch_size_per_gpu", "'2'"]),
    ({**BASE, "gradient_clipping": "1.0"}, ["gradient_clipping", "'1.0'"]),
    ({**BASE, "fp16": {"enabled": True, "loss_scale": True}}, ["fp16.loss_scale", "True"]),
    ({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": True}}}, ["optimizer.params.lr", "True"]),
    ({**BASE, "optimizer": {"type": "AdamW", "params": {"amsgrad": "yes"}}}, ["optimizer.params.amsgrad", "'yes'"]),
    ({**BASE, "optimizer": {"type": "SGD", "params": {"momentum": "0.9"}}}, ["optimizer.params.momentum", "'0.9'"]),
    ({**BASE, "optimizer": {"type": "AdamW", "params": {"betas": [0.9, "0.95"]}}}, ["optimizer.params.betas"]),
    ({**BASE, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "10"}}},
     ["scheduler.params.warmup_num_steps", "'10'"]),
]


@pytest.mark.parametrize("config,fragments", STRICT, ids=[f"strict{i}" for i in range(len(STRICT))])
def test_values_are_not_coerced(config, fragments) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(config)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from: {message}"


def test_json_numbers_that_mean_the_same_are_accepted() -> None:
    cfg = load_config({**BASE, "gradient_clipping": 1, "comm_timeout_s": 60,
                       "fp16": {"enabled": True, "loss_scale": 0, "min_loss_scale": 1},
                       "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8,
                                             "allgather_bucket_size": 2e8}})
    assert cfg.gradient_clipping == 1.0 and isinstance(cfg.gradient_clipping, float)
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert isinstance(cfg.zero_optimization.reduce_bucket_size, int)


def test_keys_accepted_and_ignored_are_listed_with_their_reason() -> None:
    from zerokit.config import IGNORED, ignored_settings

    cfg = load_config({**BASE, "zero_optimization": {
        "stage": 2, "contiguous_gradients": False, "reduce_scatter": False,
        "allgather_bucket_size": 1000, "overlap_comm": False}})
    found = {path: (value, reason) for path, value, reason in ignored_settings(cfg)}
    assert sorted(found) == ["zero_optimization.allgather_bucket_size",
                             "zero_optimization.contiguous_gradients", "zero_optimization.reduce_scatter"]
    assert found["zero_optimization.allgather_bucket_size"] == (
        1000, IGNORED["zero_optimization.allgather_bucket_size"].reason)
    assert found["zero_optimization.contiguous_gradients"][0] is False
    # What zerokit always does is not reported; neither is a key the config does not set.
    assert ignored_settings(load_config({**BASE, "zero_optimization": {
        "contiguous_gradients": True, "reduce_scatter": True, "overlap_comm": False}})) == []
    assert ignored_settings(load_config(BASE)) == []


def test_an_ignored_key_is_one_table_line(monkeypatch) -> None:
    """#17 lists DeepSpeed's sections zerokit has no use for: one line each, any value accepted."""
    from zerokit.config import IGNORED, Ignored, ignored_settings

    monkeypatch.setitem(IGNORED, "tensorboard", Ignored("zerokit writes no TensorBoard events"))
    monkeypatch.setitem(IGNORED, "zero_optimization.round_robin_gradients", Ignored("no effect here"))
    raw = {**BASE, "tensorboard": {"enabled": True, "output_path": "tb/"},
           "zero_optimization": {"stage": 1, "round_robin_gradients": True}}
    cfg = load_config(raw)
    assert cfg.zero_optimization.stage == 1
    assert raw["zero_optimization"] == {"stage": 1, "round_robin_gradients": True}  # not mutated
    assert sorted(ignored_settings(cfg), key=str) == sorted([  # in the table's order
        ("tensorboard", {"enabled": True, "output_path": "tb/"}, "zerokit writes no TensorBoard events"),
        ("zero_optimization.round_robin_gradients", True, "no effect here")], key=str)
    with pytest.raises(ConfigError, match="did you mean 'tensorboard'"):
        load_config({**BASE, "tensorbaord": {}})


@pytest.mark.parametrize("given,expected", [("adamw", "AdamW"), ("ADAM", "Adam"), ("adagrad", "Adagrad"),
                                            ("lion", "Lion"), ("AdamW", "AdamW"), ("SGD", "SGD")])
def test_optimizer_type_matches_deepspeed_names_in_any_case(given, expected) -> None:
    """DeepSpeed lower-cases its own optimizer names (runtime/config.py), its tests write "adamw"."""
    assert load_config({**BASE, "optimizer": {"type": given}}).optimizer.type == expected


def test_the_nvme_stream_pipelines_unless_the_config_says_not_to() -> None:
    """zerokit's default (DeepSpeed's is off): read ahead and write behind, same buffer sets."""
    from zerokit.engine.byte_plan import stream_settings
    from zerokit.policy import PlacementPolicy

    def settings(**keys):
        off = {"device": "nvme", "nvme_path": "/tmp", **keys}
        cfg = load_config({**BASE, "zero_optimization": {"stage": 2, "offload_optimizer": off}})
        return stream_settings(cfg, PlacementPolicy(), [])

    default = settings()
    assert (default.pipeline_read, default.pipeline_write, default.read_ahead) == (True, True, 2)
    serial = settings(pipeline_read=False, pipeline_write=False)
    assert (serial.pipeline_read, serial.pipeline_write, serial.read_ahead) == (False, False, 0)


def test_nvme_gradients_says_where_the_nvme_parts_gradients_wait() -> None:
    """offload_optimizer.nvme_gradients (zerokit): 'file' (DeepSpeed's swapped gradients) or
    'host' (held in RAM: no gradient file, the stream reads none); 'auto' holds them only while
    stepping in backward; 'host' with the delayed update is refused, naming both keys."""
    from zerokit.engine.byte_plan import stream_settings
    from zerokit.policy import PartitionPolicy, PlacementPolicy
    from zerokit.policy.layout import plan_layout

    def placement(**keys):
        off = {"device": "nvme", "nvme_path": "/tmp", "step_in_backward": False, **keys}
        cfg = load_config({**BASE, "zero_optimization": {"stage": 2, "offload_optimizer": off}})
        p = PlacementPolicy.from_config(cfg.zero_optimization)
        layout = plan_layout(10_000, 1, 0, PartitionPolicy.for_stage(2), p, torch.float32,
                             torch.float32, trainable=True)
        return p, stream_settings(cfg, p, [layout])

    for keys, held in (({}, False), ({"nvme_gradients": "file"}, False),
                       ({"nvme_gradients": "host"}, True), ({"step_in_backward": True}, True)):
        p, settings = placement(**keys)
        assert p.holds_nvme_gradients == held and settings.gradients_in_files == (not held), keys
        assert ("gradient + optimizer state" in p.describe()) == (not held), p.describe()
    assert "nvme_gradients 'host'" in placement(nvme_gradients="host")[0].describe()
    with pytest.raises(ValueError, match=r"nvme_gradients 'host' with delayed_update"):
        load_config({**BASE, "zero_optimization": {"stage": 2, "offload_optimizer": {
            "device": "nvme", "nvme_path": "/tmp", "nvme_gradients": "host",
            "delayed_update": {"enabled": True}}}})
    with pytest.raises(ValueError, match=r"nvme_gradients"):
        load_config({**BASE, "zero_optimization": {"stage": 2, "offload_optimizer": {
            "device": "nvme", "nvme_path": "/tmp", "nvme_gradients": "disk"}}})


def test_nvme_gradients_max_in_cpu_holds_whole_parts_first_units_first() -> None:
    """offload_optimizer.nvme_gradients_max_in_cpu (zerokit): with nvme_gradients 'host', the
    first nvme parts that fit hold their gradients in RAM, the rest get gradient files; the host
    need counts the held ones only; step_in_backward 'auto' turns off, true and 'file' are
    refused naming the keys."""
    import torch.nn as nn

    from zerokit.engine.byte_plan import plan_layouts, planned_host_need, stream_settings
    from zerokit.policy import PartitionPolicy, PlacementPolicy

    units = [("a", None, 0, True, [("w", nn.Parameter(torch.zeros(4096)))]),
             ("b", None, 0, True, [("w", nn.Parameter(torch.zeros(8192)))]),
             ("c", None, 0, True, [("w", nn.Parameter(torch.zeros(4096)))])]

    def plan(**keys):
        off = {"device": "nvme", "nvme_path": "/tmp", "nvme_gradients": "host", **keys}
        cfg = load_config({**BASE, "zero_optimization": {"stage": 2, "offload_optimizer": off}})
        p = PlacementPolicy.from_config(cfg.zero_optimization)
        layouts = plan_layouts(units, 1, 0, False, PartitionPolicy.for_stage(2), torch.float32,
                               torch.float32, 4, p)
        return cfg, p, layouts

    # 'a' (4096) fits, 'b' (8192) does not with 6000 left, 'c' (4096) does
    cfg, p, layouts = plan(nvme_gradients_max_in_cpu=10_000)
    assert not p.step_in_backward and not p.holds_nvme_gradients
    assert [lay.has("nvme_grad0") for lay in layouts] == [False, True, False]
    assert [lay.held_nvme_numel for lay in layouts] == [4096, 0, 4096]
    assert stream_settings(cfg, p, layouts).gradients_in_files
    assert planned_host_need(cfg, p, layouts, "adam").grads == 4 * 8192
    assert "up to 10,000 elements per rank" in p.describe()
    cfg, every, layouts = plan()  # left out: every part's, and stepping in backward ('auto')
    assert every.holds_nvme_gradients and every.step_in_backward
    cfg, none, layouts = plan(nvme_gradients_max_in_cpu=0, step_in_backward=False)
    assert all(lay.has("nvme_grad0") for lay in layouts)
    assert planned_host_need(cfg, none, layouts, "adam").grads == 0
    with pytest.raises(ValueError, match=r"nvme_gradients_max_in_cpu=5 .* needs offload_optimizer"
                                         r"\.nvme_gradients 'host' \(got 'file'\)"):
        plan(nvme_gradients="file", nvme_gradients_max_in_cpu=5)
    with pytest.raises(ValueError, match=r"nvme_gradients_max_in_cpu=5 with offload_optimizer"
                                         r"\.step_in_backward true"):
        plan(nvme_gradients_max_in_cpu=5, step_in_backward=True)


@pytest.mark.parametrize("key", ["nvme_gradients", "gradient_dtype", "step_in_backward"])
def test_zerokits_own_offload_autos_given_explicitly(key) -> None:
    """A config that writes out a zerokit key's default "auto" resolves as if it left it out
    (config/auto.py NATIVE_AUTO); before, nvme_gradients and gradient_dtype were refused as an
    "auto" only the HF Trainer fills."""
    import torch

    off = {"device": "nvme", "nvme_path": "/tmp", key: "auto"}
    cfg = resolve_auto(load_config({**BASE, "zero_optimization": {"stage": 3, "offload_optimizer": off}}),
                       torch.nn.Linear(2, 2))
    assert getattr(cfg.zero_optimization.offload_optimizer, key) == "auto"
