"""Checkpoints: sharded save/load, exact resume, resharding, consolidation."""
from __future__ import annotations


def save_checkpoint(engine, save_dir, tag=None, client_state=None, save_latest=True):
    raise NotImplementedError("engine.save_checkpoint is not implemented yet (issue: checkpoints)")


def load_checkpoint(engine, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                    load_lr_scheduler_states=True, load_module_only=False):
    raise NotImplementedError("engine.load_checkpoint is not implemented yet (issue: checkpoints)")
