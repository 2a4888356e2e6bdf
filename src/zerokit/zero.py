"""ZeRO-3 helpers users know from DeepSpeed: GatheredParameters (and Init, below),
load_pretrained_sharded (zerokit/pretrained.py): safetensors weights streamed into a model built
under Init, each rank reading only its shard, and TiledLinear / TiledEmbedding (zerokit/tiling.py):
layers split into tiles that are units of their own."""
from __future__ import annotations

import os
import weakref
from typing import Iterable

import torch
import torch.nn as nn

from zerokit.units.ds_attributes import attach_construction_views
from zerokit.units.leaf import get_leaf_modules, set_leaf_modules, unset_leaf_modules  # noqa: F401
from zerokit.units.unit import Unit, WeightState
from zerokit.units.registry import unit_of
from zerokit.policy import PlacementPolicy
from zerokit.tier_names import TierName
from zerokit.pretrained import LoadReport, load_pretrained_sharded  # noqa: F401  (public here)
from zerokit.tiling import TiledEmbedding, TiledLinear, TiledLinearReturnBias  # noqa: F401  (public here)

# DeepSpeed's names (deepspeed.utils.set_z3_leaf_modules ...): see [Note: leaf modules].
set_z3_leaf_modules, unset_z3_leaf_modules, get_z3_leaf_modules = (
    set_leaf_modules, unset_leaf_modules, get_leaf_modules)


class GatheredParameters:
    """Gather the full weights of `params` for reading or editing, on every rank.

        with zerokit.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
            if rank == 0:
                model.lm_head.weight.zero_()

    Every rank must enter with the same parameters (it is a collective). With `modifier_rank`,
    that rank's edits are broadcast on exit and written into the shards and the fp32 master;
    without it, edits are discarded. Units that were already gathered stay so.
    """

    def __init__(self, params: "nn.Parameter | Iterable[nn.Parameter]", modifier_rank: int | None = None,
                 fwd_module: nn.Module | None = None, enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.units: list[Unit] = []
        for p in params:
            unit = unit_of(p)
            if unit is not None and unit not in self.units:
                self.units.append(unit)
        self.units.sort(key=lambda u: u.index)  # the same order on every rank
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._gathered_here: list[Unit] = []
        # zero_optimization.enable_sanity_checks, as DeepSpeed: without modifier_rank an edit is
        # discarded, so one is an error on every rank (what each parameter was on entry).
        self._check = modifier_rank is None and any(u.sanity_checks for u in self.units)
        self._params = [s.param for u in self.units for s in u.slots]
        self._versions: list[tuple[int, int]] = []

    def __enter__(self) -> "GatheredParameters":
        if not self.enabled:
            return self
        for u in self.units:
            if u.state is WeightState.SHARDED:
                u.gather()
                self._gathered_here.append(u)
            u.wait_weights()
        if self._check:
            self._versions = [(p.data.data_ptr(), p._version) for p in self._params]
        return self

    def _edited_on_some_rank(self) -> bool:
        """Collective: DeepSpeed's test (a parameter's storage or version changed), any rank."""
        edited = any((p.data.data_ptr(), p._version) != v for p, v in zip(self._params, self._versions))
        return self.units[0].comm.max_flag(float(edited), "GatheredParameters sanity check") > 0

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        if self._check and exc[0] is None and self._edited_on_some_rank():
            for u in self.units:  # the edit is dropped: each unit's weights are its shards' again
                u.release(persistent_too=True)
                if u not in self._gathered_here:
                    u.gather()
                    u.wait_weights()
            self._gathered_here = []
            raise RuntimeError(
                "Detected in-place modification of ZeRO-3 parameters inside GatheredParameters with "
                "modifier_rank=None. Use modifier_rank=<rank> to broadcast updates across ranks. "
                "(zero_optimization.enable_sanity_checks; the edit is discarded)")
        try:
            if self.modifier_rank is not None and exc[0] is None:
                for u in self.units:  # the edits reach the shards an async save may be writing
                    u.lease.settle()
                for u in self.units:
                    u.comm.broadcast_(u.flat, src=self.modifier_rank, where=f"unit '{u.name}' (edit)")
                    u.absorb_edits()
        finally:
            for u in self._gathered_here:
                u.release()
            self._gathered_here = []


# Construction units made under Init, by module: initialize() adopts their values, then retires
# them. Weak keys, and units that do not reference their module (module=None): a model built
# under Init and dropped without initialize() takes its shards with it.
_CONSTRUCTED: "weakref.WeakKeyDictionary[nn.Module, Unit]" = weakref.WeakKeyDictionary()
INIT_DIR = "zerokit-init"  # zero.Init(remote_device="nvme")'s files, under offload_param.nvme_path
_INIT_TIERS: list = []  # its nvme tiers, closed once every construction unit is retired


class Init:
    """Build a model partitioned module by module, so it never exists whole on one rank.

        with zerokit.zero.Init(config=ds_config):
            model = MyModel()        # each module's weights are sharded as its __init__ returns
        engine, *_ = zerokit.initialize(model=model, config=ds_config)

    Per-rank memory while building is about total / N plus the module being built. Each
    module's initial values are rank 0's (broadcast before sharding), so every rank builds the
    same model. `module.apply(fn)` inside the context gathers each module's weights around fn
    (with rank 0's edits kept), which is how most models run their custom initialisation; code
    that writes to parameters of other, already built modules must use GatheredParameters.

    DeepSpeed's arguments, in DeepSpeed's order; each is honoured or refused by name:
    - module: partition this already-built model now, as if it had been built in the context.
    - config_dict_or_path / config (aliases): a dict, a JSON path or a ZeroKitConfig.
    - enabled: False makes the context do nothing.
    - dtype: torch.float32, float16 or bfloat16: parameters are cast to it before sharding.
      None keeps the dtype the model builds them in (DeepSpeed's None means the config's 16-bit
      dtype; zerokit keeps the built values so the fp32 master starts exact: pass dtype to halve
      the construction shards instead).
    - remote_device: None / "none" keeps each shard on the compute device, "cpu" on the host tier
      (as offload_param does; the default when the config's offload_param.device is "cpu"),
      "nvme" in files under the config's offload_param.nvme_path, one module at a time (host
      peak about one module; the default when offload_param.device is "nvme"). The construction
      files live in <nvme_path>/zerokit-init and are removed as initialize adopts the modules.
    - pin_memory: page-lock the host shards (with remote_device "cpu"; only where CUDA exists).
    - data_parallel_group / sequence_data_parallel_group / mpu: zerokit partitions over all
      ranks, so only a group (or an mpu data-parallel group) spanning every rank is accepted.
    - mem_efficient_linear: True is what zerokit always does; False is refused.
    - zero_param_parallel_group (hpZ), zero_quantized_weights / zero_quantized_nontrainable_weights
      (ZeRO++), param_swapper (NVMe), tensor_overrides: not implemented, refused when set.
    Any other keyword is a TypeError naming it (Python's own).
    """

    def __init__(self, module: nn.Module | None = None, data_parallel_group=None,
                 mem_efficient_linear: bool = True, remote_device: str | None = None,
                 pin_memory: bool = False, config_dict_or_path=None, config=None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu=None, zero_param_parallel_group=None,
                 zero_quantized_weights: bool = False, zero_quantized_nontrainable_weights: bool = False,
                 sequence_data_parallel_group=None, param_swapper=None, tensor_overrides=None):
        if module is not None and not isinstance(module, nn.Module):
            raise TypeError(f"zero.Init(module=...) must be a torch.nn.Module (got "
                            f"{type(module).__name__}); pass a config as config= or config_dict_or_path=")
        _check_refused(mem_efficient_linear=mem_efficient_linear, dtype=dtype,
                      zero_param_parallel_group=zero_param_parallel_group,
                      zero_quantized_weights=zero_quantized_weights,
                      zero_quantized_nontrainable_weights=zero_quantized_nontrainable_weights,
                      param_swapper=param_swapper, tensor_overrides=tensor_overrides)
        _check_groups(data_parallel_group, sequence_data_parallel_group, mpu)
        self.enabled = enabled
        self.config = _resolve_config(config, config_dict_or_path)
        self.shard_tier, self.pin_memory = _resolve_placement(remote_device, pin_memory, self.config)
        self.dtype = dtype
        self._patched: list[tuple[type, object]] = []
        self._saved_apply = None
        self._saved_init_subclass = None
        if module is not None and enabled:
            self._set_up()
            for m in _children_first(module):
                self._partition(m)

    def _set_up(self) -> None:
        from zerokit.comm.collectives import Comm
        from zerokit.policy import PartitionPolicy
        from zerokit.tiers import Ledger

        timeout = self.config.comm_timeout_s if self.config is not None else 1800.0
        self.comm = Comm.from_environment(timeout)
        self.policy = PartitionPolicy.for_stage(3)
        self.ledger = Ledger()
        self.nvme = None
        if self.shard_tier is TierName.NVME:
            import os

            from zerokit.tiers.nvme import NvmeTier

            # Construction shards under a root of their own, apart from the engines' swap files;
            # the root goes when initialize has adopted them all (retire_constructed).
            root = os.path.join(self.config.zero_optimization.offload_param.nvme_path, INIT_DIR)
            self.nvme = NvmeTier(self.ledger, root, rank=self.comm.rank,
                                 config=self.config.aio.engine_config())
            _INIT_TIERS.append(self.nvme)

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        self._set_up()
        for cls in _all_module_classes():
            self._wrap_init(cls)
        self._saved_init_subclass = nn.Module.__dict__.get("__init_subclass__")
        init = self

        def init_subclass(cls, **kwargs):  # classes defined inside the context are wrapped too
            super(nn.Module, cls).__init_subclass__(**kwargs)
            init._wrap_init(cls)
        nn.Module.__init_subclass__ = classmethod(init_subclass)
        self._saved_apply = nn.Module.apply

        def apply(module: nn.Module, fn):
            for child in module.children():
                child.apply(fn)
            with GatheredParameters(list(module.parameters(recurse=False)), modifier_rank=0):
                fn(module)
            return module
        nn.Module.apply = apply
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        for cls, original in reversed(self._patched):
            cls.__init__ = original
        self._patched = []
        nn.Module.apply = self._saved_apply
        if self._saved_init_subclass is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = self._saved_init_subclass

    def _wrap_init(self, cls: type) -> None:
        if "__init__" not in cls.__dict__ or getattr(cls.__init__, "_zerokit_wrapped", False):
            return
        original = cls.__init__
        init = self

        def __init__(module, *args, **kwargs):
            original(module, *args, **kwargs)
            # Partition once the most-derived __init__ is done (a subclass may still edit weights).
            owner = next(c for c in type(module).__mro__ if "__init__" in c.__dict__)
            if owner is cls:
                init._partition(module)
        __init__._zerokit_wrapped = True
        __init__.__wrapped__ = original
        cls.__init__ = __init__
        self._patched.append((cls, original))

    def _partition(self, module: nn.Module) -> None:
        params = [(name, p) for name, p in module.named_parameters(recurse=False) if unit_of(p) is None]
        if not params:
            return
        if self.dtype is not None:
            for _, p in params:
                p.data = p.data.to(self.dtype)
        placement = PlacementPolicy(params_on_host=self.shard_tier is TierName.HOST,
                                    param_pin_memory=self.pin_memory,
                                    params_on_nvme=self.shard_tier is TierName.NVME)
        unit = Unit(f"{type(module).__name__}@{id(module):x}", params, module=None, trainable=False,
                    group_index=-1, comm=self.comm, policy=self.policy,
                    compute_dtype=params[0][1].dtype, reduce_dtype=params[0][1].dtype,
                    bucket_numel=1 << 62, ledger=self.ledger, placement=placement, nvme=self.nvme)
        unit.sanity_checks = self.config is not None and self.config.zero_optimization.enable_sanity_checks
        _CONSTRUCTED[module] = unit
        attach_construction_views([p for _, p in params])


def adopt_constructed(model: nn.Module, params: list[nn.Parameter]) -> list[Unit]:
    """Gather the construction units holding `params` so their values can be read (initialize)."""
    units = []
    for p in params:
        u = unit_of(p)
        if u is not None and u not in units and u.group_index == -1:
            u.gather()
            u.wait_weights()
            units.append(u)
    return units


def retire_laid_out(gathered: list[Unit]) -> list[Unit]:
    """Retire the construction units none of whose parameters still reads their buffer (each was
    laid out into an engine unit); return the others, whose buffer must stay."""
    still = []
    for u in gathered:
        if any(unit_of(s.param) is u for s in u.slots):
            still.append(u)
        else:
            u.retire()
    return still


def constructed_host_bytes(model: nn.Module) -> int:
    """Host bytes the construction units of `model` hold (zero.Init shards in host memory):
    initialize frees them as it lays out the model's units, so its host check counts them as
    available (a model built into host memory would otherwise be refused for its own shards)."""
    total = 0
    for m in model.modules():
        u = _CONSTRUCTED.get(m)
        if u is not None and u.nvme_shard is None and u.shard is not None and u.shard.device.type == "cpu":
            total += u.shard.numel() * u.shard.element_size()
    return total


def constructed_nvme_files(model: nn.Module) -> tuple[int, int, str | None]:
    """(bytes, largest unit's bytes, folder) of the weight files zero.Init(remote_device="nvme")
    wrote for `model`. initialize removes each construction unit's file once the unit that
    adopts its parameters is laid out, so its disk check counts them as space to come back, all
    but the largest one (alive while its successor's files are being allocated)."""
    sizes, folder = [], None
    for m in model.modules():
        u = _CONSTRUCTED.get(m)
        if u is not None and u.nvme_shard is not None:
            sizes.append(u.nvme_shard.file.nbytes)
            folder = u.nvme_shard.nvme.root
    return sum(sizes), max(sizes, default=0), folder


def retire_constructed(model: nn.Module) -> None:
    """Free every construction unit of this model's modules (adopted or orphaned by tying)."""
    for m in model.modules():
        unit = _CONSTRUCTED.pop(m, None)
        if unit is not None:
            unit.retire()
    for tier in list(_INIT_TIERS):  # zero.Init(remote_device="nvme"): its files are all gone
        if not tier.owners():
            _INIT_TIERS.remove(tier)
            tier.close()
            try:
                os.rmdir(tier.root)
            except OSError:
                pass


def _children_first(module: nn.Module) -> list[nn.Module]:
    """Modules in the order their __init__s return when built: every child before its parent."""
    order: list[nn.Module] = []
    seen: set[int] = set()

    def visit(m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        for child in m.children():
            visit(child)
        order.append(m)
    visit(module)
    return order


def _all_module_classes() -> list[type]:
    seen, stack = [], [nn.Module]
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.append(sub)
                stack.append(sub)
    return seen


# ---- zero.Init's DeepSpeed arguments -----------------------------------------------------------
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_refused(*, mem_efficient_linear: bool, dtype, zero_param_parallel_group,
                   zero_quantized_weights: bool, zero_quantized_nontrainable_weights: bool,
                   param_swapper, tensor_overrides) -> None:
    """The arguments whose only accepted value is the one that asks for nothing zerokit lacks."""
    if mem_efficient_linear is not True:
        raise ValueError(
            f"zero.Init(mem_efficient_linear={mem_efficient_linear!r}) cannot be honoured: zerokit "
            f"always frees released weights under autograd's saved tensors (they view the unit's "
            f"buffer, freed on release and gathered again for backward), which is what DeepSpeed's "
            f"memory-efficient linear provides; it cannot be turned off: leave the argument out")
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"zero.Init(dtype={dtype}): allowed {', '.join(map(str, _DTYPES))}, or None "
                         f"(parameters keep the dtype the model builds them in)")
    not_implemented = {
        "zero_param_parallel_group": (zero_param_parallel_group is not None,
                                      "hierarchical partitioning (ZeRO++ hpZ)"),
        "zero_quantized_weights": (zero_quantized_weights, "quantized weight all-gathers (ZeRO++ qwZ)"),
        "zero_quantized_nontrainable_weights": (zero_quantized_nontrainable_weights,
                                                "quantized frozen weights (ZeRO++)"),
        "param_swapper": (param_swapper is not None,
                          "NVMe parameter swapping (ZeRO-Infinity, issue #16)"),
        "tensor_overrides": (tensor_overrides is not None, "tensor overrides"),
    }
    for name, (asked, what) in not_implemented.items():
        if asked:
            raise NotImplementedError(f"zero.Init({name}=...): {what} is not implemented in zerokit; "
                                      f"leave the argument out")


def _check_groups(data_parallel_group, sequence_data_parallel_group, mpu) -> None:
    """zerokit partitions over every rank: a group is honoured only if it is all of them."""
    import torch.distributed as dist

    if data_parallel_group is not None and sequence_data_parallel_group is not None:
        raise ValueError("zero.Init: data_parallel_group and sequence_data_parallel_group were both "
                         "given; DeepSpeed takes one of them")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def size(group) -> int | None:
        try:
            return dist.get_world_size(group)
        except Exception:  # not a process group, or no process group exists
            return None
    for name, group in (("data_parallel_group", data_parallel_group),
                        ("sequence_data_parallel_group", sequence_data_parallel_group)):
        if group is not None and size(group) != world:
            raise NotImplementedError(
                f"zero.Init({name}=...): zerokit partitions across all {world} rank(s); a group "
                f"of {size(group) or 'unknown size'} is not supported (pass None)")
    if mpu is not None:
        dp = getattr(mpu, "get_data_parallel_world_size", None)
        if dp is None or dp() != world:
            raise NotImplementedError(
                f"zero.Init(mpu=...): zerokit has no model parallelism and partitions across all "
                f"{world} rank(s); an mpu is accepted only when its data-parallel group is every rank")


def _resolve_config(config, config_dict_or_path):
    """DeepSpeed's `config` is a deprecated alias of `config_dict_or_path`; loaded here, so a bad
    config fails where Init is called."""
    from zerokit.config import load_config

    if config is not None and config_dict_or_path is not None and config is not config_dict_or_path:
        raise ValueError("zero.Init: config and config_dict_or_path are aliases and both were given; "
                         "pass one")
    chosen = config if config is not None else config_dict_or_path
    return load_config(chosen) if chosen is not None else None


def _resolve_placement(remote_device, pin_memory: bool, config) -> tuple[TierName, bool]:
    """(the tier each construction shard lives on, pin)."""
    param = config.zero_optimization.offload_param if config is not None else None
    if remote_device is None and param is not None and param.device in ("cpu", "nvme"):
        remote_device, pin_memory = param.device, pin_memory or param.pin_memory  # DeepSpeed's default
    device = {"none": TierName.DEVICE, None: TierName.DEVICE, "cpu": TierName.HOST,
              "nvme": TierName.NVME}.get(remote_device)
    if device is None:
        raise ValueError(f"zero.Init(remote_device={remote_device!r}): allowed None or 'none' (the "
                         f"compute device), 'cpu' (the host tier), 'nvme' (files)")
    if device is TierName.NVME and (param is None or not param.nvme_path):
        raise ValueError("zero.Init(remote_device='nvme') puts the weights under "
                         "zero_optimization.offload_param.nvme_path: pass a config that sets it "
                         "(config=... or config_dict_or_path=...)")
    if pin_memory and device is TierName.DEVICE:
        raise ValueError("zero.Init(pin_memory=True) pins host shards: it needs remote_device='cpu' "
                         "(or 'nvme', whose shards pass through host buffers)")
    return device, pin_memory
