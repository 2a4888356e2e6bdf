"""DeepSpeed's top-level API over zerokit: change `import deepspeed` to
`import zerokit.compat.deepspeed as deepspeed`, or install the `deepspeed` compatibility
distribution (compat/deepspeed/ in the repository) so that `import deepspeed` is this.

Every module under this package mirrors a DeepSpeed module path and only re-exports or adapts
zerokit's own API (docs/deepspeed.md lists what is supported, ignored and different). It never
imports a real DeepSpeed.
"""
from __future__ import annotations

import argparse
from typing import Any

from zerokit.compat.deepspeed import (accelerator, checkpoint, checkpointing, comm, compression, moe, ops,
                                      runtime, utils)
from zerokit.compat.deepspeed.accelerator import get_accelerator
from zerokit.compat.deepspeed.comm import init_distributed
from zerokit.compat.deepspeed.runtime import zero
from zerokit.compat.deepspeed.runtime.engine import DeepSpeedEngine
from zerokit.compat.deepspeed.utils import logger
from zerokit.compat.deepspeed.version import DEEPSPEED_API_VERSION, __version__
from zerokit.config import ConfigError as DeepSpeedConfigError  # what a refused config raises

version = __version__
__git_hash__ = None
__git_branch__ = None
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500

__all__ = ["DEEPSPEED_API_VERSION", "DeepSpeedConfigError", "DeepSpeedEngine", "__version__", "accelerator", "add_config_arguments",
           "checkpoint", "checkpointing", "comm", "compression", "get_accelerator", "init_distributed", "initialize", "logger",
           "moe", "ops", "runtime", "utils", "zero"]


def initialize(args: Any = None, model: Any = None, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Any = None, config: Any = None,
               mesh_param: Any = None, config_params: Any = None):
    """deepspeed.initialize: returns (engine, optimizer, training_dataloader, lr_scheduler).

    The config comes from exactly one of `config`, `config_params` (the legacy name) and
    `args.deepspeed_config` (`--deepspeed_config`, see add_config_arguments). Like DeepSpeed it
    first joins (or, alone, forms) the process group: see comm.init_distributed. mpu and
    mesh_param (model / sequence parallelism) are not implemented.
    """
    from zerokit.config.deepspeed_defaults import with_deepspeed_defaults
    from zerokit.engine.assemble import initialize as zerokit_initialize
    from zerokit.engine.deepspeed_api import DeepSpeedOptimizerView

    if model is None:
        raise ValueError("deepspeed.initialize requires model=")
    if mpu is not None or mesh_param is not None:
        raise NotImplementedError(f"deepspeed.initialize: {'mpu' if mpu is not None else 'mesh_param'}= "
                                  f"(model or sequence parallelism) is not implemented; zerokit is data "
                                  f"parallel only")
    # DeepSpeed's defaults where zerokit's differ (gradient_clipping 1.0): a script computes here
    # what it computes under DeepSpeed (zerokit/config/deepspeed_defaults.py).
    config = with_deepspeed_defaults(_one_config(args, config, config_params))
    # As DeepSpeed: a process group always exists after initialize (the HF Trainer then calls
    # torch.distributed directly, even at world size 1).
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    engine, opt, loader, scheduler = zerokit_initialize(
        model=model, optimizer=optimizer, model_parameters=model_parameters, config=config,
        lr_scheduler=lr_scheduler, training_data=training_data, collate_fn=collate_fn)
    engine.deepspeed_api = True  # load_checkpoint answers as DeepSpeed's
    # As DeepSpeed's, engine.optimizer is the wrapper initialize returns (cur_scale, overflow,
    # ...), its `.optimizer` the torch optimizer; the engine's own uses go through the wrapper.
    engine.optimizer = DeepSpeedOptimizerView(engine, opt)
    return engine, engine.optimizer, loader, scheduler


def _one_config(args: Any, config: Any, config_params: Any) -> Any:
    given = {"config": config, "config_params": config_params}
    for name in ("deepspeed_config", "deepscale_config"):  # deepscale_config: DeepSpeed's old name
        value = getattr(args, name, None)
        if value is not None:
            given[f"args.{name}"] = value
    present = {k: v for k, v in given.items() if v is not None}
    if len(present) > 1:
        raise ValueError(f"deepspeed.initialize: the config was given {len(present)} times "
                         f"({', '.join(present)}); pass exactly one")
    if not present:
        raise ValueError("deepspeed.initialize: no config; pass config= (a dict or a JSON path), "
                         "config_params=, or args with --deepspeed_config")
    return next(iter(present.values()))


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line arguments: --deepspeed, --deepspeed_config (and the deprecated
    --deepscale, --deepscale_config)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (a flag for the user's code; no effect on the engine)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help="Deprecated: --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated: --deepspeed_config")
    return parser
