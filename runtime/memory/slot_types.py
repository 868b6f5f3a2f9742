"""Value types of the expert slot pool (inference process): an expert's state, the layout of experts in a
layer's range, the pool's entry per expert, and its per-layer slot limits. Plain data; `runtime.memory.slots`
holds the behaviour. Mechanism only: who sets a limit (the agent, from a plan's caps) is not decided here.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from tierplan.runtime.device import Event
from tierplan.runtime.errors import CapacityError, ConfigError
from tierplan.runtime.nvme import align_up


class ExpertState(Enum):
    ABSENT = "absent"
    LOADING = "loading"
    RESIDENT = "resident"
    EVICTING = "evicting"


@dataclass(frozen=True)
class ExpertLayout:
    """How many experts of what size, and the slot stride the backend's granularity gives them."""

    num_layers: int
    num_experts: int
    expert_bytes: int
    granularity_bytes: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_experts", "expert_bytes", "granularity_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"ExpertLayout.{name} must be > 0, got {getattr(self, name)}")

    @property
    def stride_bytes(self) -> int:
        return align_up(self.expert_bytes, self.granularity_bytes)

    @property
    def layer_bytes(self) -> int:
        return self.num_experts * self.stride_bytes


@dataclass
class _Entry:
    state: ExpertState = ExpertState.ABSENT
    slot: int | None = None
    pinned: bool = False
    load_event: Event | None = None
    # Work reading the slot, as the last reader event recorded on each stream (a stream's events complete in order).
    readers: dict[object, Event] | None = None
    mapped: bool = False  # the slot is mapped under the expert's range (LOADING may be reserved only)
    load_order: tuple[object, int] | None = None  # (source, n): the load's place in its source's issue order
    guards: list[Event] | None = None  # LOADING: work still reading the slot's previous expert (the copy follows it)
    issued: bool = False  # LOADING: its copy is issued (load_event set): slot-table readers may order after it


def check_books(entries: list[list[_Entry]], free: list[int], slot_owner: list[tuple[int, int] | None],
                num_resident: list[int], num_bound: list[int], num_pinned: list[int], num_slots: int) -> None:
    """AssertionError if the pool's books break I2 or I6 (`ExpertSlotPool.check_invariants`, under its lock)."""
    bound = [(l_, e) for l_, row in enumerate(entries) for e, en in enumerate(row) if en.slot is not None]
    assert len(bound) + len(free) == num_slots, "I6: slots leaked or double-counted"
    slots = [entries[l_][e].slot for l_, e in bound]
    assert len(set(slots)) == len(slots), "I2: a slot backs two experts"
    assert not set(slots) & set(free), "I2: a bound slot is also free"
    for (l_, e), s in zip(bound, slots, strict=True):
        assert slot_owner[s] == (l_, e), "I2: slot owner table disagrees"  # type: ignore[index]
    for l_, row in enumerate(entries):
        n = sum(en.state in (ExpertState.RESIDENT, ExpertState.EVICTING) for en in row)
        assert num_resident[l_] == n, "resident counter disagrees with the entries"
        assert num_bound[l_] == sum(en.slot is not None for en in row), "bound counter disagrees"
        assert num_pinned[l_] == sum(en.pinned for en in row), "pinned counter disagrees"
        assert all(en.state is ExpertState.RESIDENT for en in row if en.pinned), "a pinned expert is not resident"


class LayerLimits:
    """The most slots each layer may hold (loading, resident or being evicted); a layer not listed has no limit.

    The pool checks every reservation against it (`check`, under the pool's lock); the agent replaces the
    whole set when a plan applies (`set`), and evicts what a lower limit leaves over on its own."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._lock = threading.Lock()
        self._limits: dict[int, int] = {}

    def set(self, limits: Mapping[int, int] | None) -> None:
        """Replace every limit (None or {} lifts them all); ConfigError, changing nothing, for a bad entry."""
        new = dict(limits or {})
        for layer, n in new.items():
            if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
                raise ConfigError(f"layer limits: layer {layer!r} is not one of 0..{self.num_layers - 1}")
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ConfigError(f"layer limits: layer {layer}: expected an int >= 0 slots, got {n!r}")
        with self._lock:
            self._limits = new

    def get(self, layer: int) -> int | None:
        with self._lock:
            return self._limits.get(layer)

    def as_dict(self) -> dict[int, int]:
        """Every limit now, by layer (a copy: `set` of it restores them)."""
        with self._lock:
            return dict(self._limits)

    def check(self, layer: int, num_bound: int, num_new: int) -> None:
        """CapacityError if `num_new` more slots would take `layer` past its limit."""
        limit = self.get(layer)
        if limit is not None and num_bound + num_new > limit:
            raise CapacityError(f"prepare_load: layer {layer} holds {num_bound} slot(s) and its limit is {limit} "
                                f"(the applied plan's cap); {num_new} more would pass it: evict one of its experts")
