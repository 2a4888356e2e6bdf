"""What every config section shares: unknown keys refused, strict values, DeepSpeed's whole floats."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict


class Section(BaseModel):
    # strict: pydantic's lax mode turns "yes", "on" and 1 into True and "10" into 10, so a quoted
    # or mistyped value would silently mean something. JSON ints stay valid for float fields.
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True, strict=True)


def _whole_float_to_int(value: Any) -> Any:
    """5e8 is how DeepSpeed configs write bucket sizes, and JSON makes it a float: a whole-number
    float becomes that int; anything else goes on to the strict int check (and is refused)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Every int field: strict (no "10", no true), but 5e8 is 500000000.
Int = Annotated[int, BeforeValidator(_whole_float_to_int)]
