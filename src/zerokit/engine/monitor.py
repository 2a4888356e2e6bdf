"""`engine.monitor`: DeepSpeed's MonitorMaster, as far as zerokit has one.

DeepSpeed writes events to TensorBoard, Weights & Biases, CSV or Comet when the config's
`tensorboard` / `wandb` / `csv_monitor` / `comet` section is enabled, and scripts write their own
through `engine.monitor.write_events([(name, value, step), ...])`. zerokit writes no monitor
events (those keys are accepted, ignored and reported at start-up). Without any of them enabled
the monitor answers as DeepSpeed's disabled one (`enabled` False, no writers, write_events does
nothing); with one enabled, reading the monitor raises NotImplementedError naming the section,
so a script never believes its events were written.
"""
from __future__ import annotations

from typing import Any

SECTIONS = ("tensorboard", "wandb", "csv_monitor", "comet")
_WRITERS = {"tensorboard": "tb_monitor", "wandb": "wandb_monitor", "csv_monitor": "csv_monitor",
            "comet": "comet_monitor"}


class Monitor:
    def __init__(self, ignored_raw: dict[str, Any]):
        self._requested = [s for s in SECTIONS
                           if isinstance(ignored_raw.get(s), dict) and ignored_raw[s].get("enabled")]

    def _refuse(self, what: str) -> None:
        if self._requested:
            raise NotImplementedError(
                f"engine.monitor.{what}: zerokit writes no monitor events, so the config's "
                f"{', '.join(repr(s) for s in self._requested)} section (enabled) is not acted on; "
                f"log from the training loop (the HF Trainer's report_to does)")

    @property
    def enabled(self) -> bool:
        self._refuse("enabled")
        return False

    def write_events(self, event_list: list) -> None:
        self._refuse("write_events")

    def __getattr__(self, name: str) -> Any:
        if name in _WRITERS.values():  # tb_monitor, wandb_monitor, csv_monitor, comet_monitor
            self._refuse(name)
            return None
        raise AttributeError(f"engine.monitor has no attribute {name!r} (zerokit's monitor provides "
                             f"enabled, write_events and the writers {sorted(_WRITERS.values())})")
