"""Checkpoints: sharded save/load, exact resume, resharding, consolidation.

    engine.save_checkpoint(dir)                     # -> dir/global_step{N}, dir/latest
    path, client_state = engine.load_checkpoint(dir)
    zerokit convert dir out/                        # one safetensors model (see consolidate.py)

See docs/checkpoint.md and [Note: checkpoint layout] in metadata.py.
"""
from __future__ import annotations

from zerokit.checkpoint.load import IncompleteCheckpointError, load_checkpoint
from zerokit.checkpoint.save import save_checkpoint, settle_checkpoint, wait_for_checkpoint
from zerokit.checkpoint.interface import Checkpointable, FileRange, LoadPiece, SavePiece
from zerokit.checkpoint.storage import CheckpointWriteError

__all__ = ["save_checkpoint", "load_checkpoint", "wait_for_checkpoint", "settle_checkpoint", "IncompleteCheckpointError",
           "CheckpointWriteError", "Checkpointable", "FileRange", "LoadPiece", "SavePiece"]
