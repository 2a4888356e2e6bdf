"""The gather schedule of stages 0-2: the weights are always resident, so there is nothing to
gather ahead or release; a use only waits for a weight publish still in flight (see [Note:
weights in flight] in units/unit.py). It has the stage-3 scheduler's interface, so the engine's
hooks call one schedule whatever the stage."""
from __future__ import annotations

from typing import Any

from zerokit.units.unit import Unit


class ResidentSchedule:
    def start_iteration(self) -> None:
        """Nothing recorded: the order of uses does not matter when nothing is gathered."""

    def use(self, unit: Unit) -> None:
        unit.wait_weights()

    def use_in_backward(self, unit: Unit) -> None:
        unit.wait_weights()

    def after_forward(self, unit: Unit, output: Any) -> Any:
        return output

    def after_recompute(self, unit: Unit, output: Any) -> Any:
        return output

    def after_backward(self, unit: Unit) -> None:
        """The weights stay."""

    def end_backward(self) -> None:
        """Nothing to release."""

    def position(self) -> None:
        """Nothing to add to a failure report: no order of uses is kept (see start_iteration)."""
        return None

    def check_state_dict(self) -> None:
        """Every weight is resident: model.state_dict() reads them directly."""
