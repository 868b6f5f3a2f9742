"""The expert loader's settings (inference process): where experts load from (`StoreKind`), when the link's
worker maps a loading expert's range (`MapIn`) and when a load is published (`Publish`); runtime/weights/loader.py
says what each value does. Values and their checks only.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal, get_args


class StoreKind(Enum):
    PINNED = "pinned"
    NVME = "nvme"


MapIn = Literal["beside_copy", "before_copy", "on_read"]
WINDOWED: tuple[str, ...] = ("beside_copy", "on_read")  # copies go through the slot window
MAP_IN: tuple[str, ...] = get_args(MapIn)  # the values, for checks and messages


def pool_modes(map_in: str) -> dict[str, bool]:
    """The `ExpertSlotPool` arguments a loader with this `map_in` needs: the slot window its copies go through,
    and whether its loads are published unmapped (`maps_on_read`)."""
    return {"slot_window": map_in in WINDOWED, "maps_on_read": map_in == "on_read"}
_OLD_MAP_IN = {"link": "beside_copy", "worker": "before_copy"}  # old names: refused, naming the new ones
Publish = Literal["done", "issued"]
PUBLISH: tuple[str, ...] = get_args(Publish)


def map_in_error(where: str, value: object) -> str | None:
    """Why `value` is not a `map_in` (None when it is one); `where` names the setting in the message (may be "").
    The old names get a message naming their new ones, so a user's config fails loudly instead of meaning
    something else."""
    if value in MAP_IN:
        return None
    names = list(map(repr, MAP_IN))
    expected, head = f"{', '.join(names[:-1])} or {names[-1]}", f"{where} " if where else ""
    if isinstance(value, str) and value in _OLD_MAP_IN:
        return (f"{head}{value!r} is an old name, no longer accepted: use {_OLD_MAP_IN[value]!r} "
                f"(expected {expected})")
    return f"{head}must be one of {expected}, got {value!r}"
