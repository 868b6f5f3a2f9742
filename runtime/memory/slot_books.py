"""The books of the expert slot pool (inference process): each expert's entry, the free slots, who owns each slot,
the per-layer counts and limits, and the queries and pins over them, all under one lock. `ExpertSlotPool`
(slots.py) builds on these books with the operations that move an expert between states (loads, evictions,
reads); the `_locked` helpers here are for it, called with the lock held. Never maps memory or moves bytes.
"""

from __future__ import annotations

import threading

from tierplan.runtime.device import Event
from tierplan.runtime.errors import ConfigError, NotResidentError
from tierplan.runtime.memory.slot_types import ExpertLayout, ExpertState, LayerLimits, _Entry, check_books


class SlotBooks:
    """Entries and slots of `num_slots` slots over `layout` (see the module docstring)."""

    def __init__(self, layout: ExpertLayout, num_slots: int) -> None:
        if not num_slots > 0:
            raise ConfigError(f"num_slots must be > 0, got {num_slots}")
        num_layers, num_experts = layout.num_layers, layout.num_experts
        self.layout, self.num_slots = layout, num_slots
        self._lock = threading.Lock()
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._slot_owner: list[tuple[int, int] | None] = [None] * num_slots
        self._entries = [[_Entry() for _ in range(num_experts)] for _ in range(num_layers)]
        self._num_resident = [0] * num_layers  # RESIDENT or EVICTING experts per layer (O(1) queries)
        self._num_bound = [0] * num_layers  # experts holding a slot (LOADING too): what a layer limit bounds
        self._num_pinned = [0] * num_layers  # pinned experts per layer (a pinned one is resident: never evicted)
        self.limits = LayerLimits(num_layers)  # the agent sets a plan's caps; every prepare_load(s) checks them
        self.remaps = 0
        self._guards: dict[int, list[Event]] = {}  # released slot -> work that may still read its old expert
        self._unmapped: set[tuple[int, int]] = set()  # resident experts whose range is not mapped (maps_on_read)

    def _entry(self, layer: int, expert: int) -> _Entry:
        if not (0 <= layer < self.layout.num_layers and 0 <= expert < self.layout.num_experts):
            raise ConfigError(f"expert ({layer}, {expert}) out of range: layers 0..{self.layout.num_layers - 1}, "
                              f"experts 0..{self.layout.num_experts - 1}")
        return self._entries[layer][expert]

    def state(self, layer: int, expert: int) -> ExpertState:
        return self._entry(layer, expert).state

    def is_resident(self, layer: int, expert: int) -> bool:
        return self.state(layer, expert) is ExpertState.RESIDENT

    def resident_experts(self, layer: int) -> list[int]:
        with self._lock:
            self._entry(layer, 0)
            return [e for e, en in enumerate(self._entries[layer]) if en.state is ExpertState.RESIDENT]

    def num_resident(self, layer: int) -> int:
        """Experts of the layer that hold a loaded slot (resident, or resident and being evicted)."""
        self._entry(layer, 0)
        return self._num_resident[layer]

    def slot_of(self, layer: int, expert: int) -> int | None:
        return self._entry(layer, expert).slot

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def num_bound(self, layer: int) -> int:
        """Slots the layer's experts hold: loading, resident or being evicted (its real footprint in slots)."""
        self._entry(layer, 0)
        return self._num_bound[layer]

    def check_invariants(self) -> None:
        """Raise AssertionError if I2 or I6 does not hold (cheap; tests and self-checks call it)."""
        with self._lock:
            check_books(self._entries, self._free, self._slot_owner, self._num_resident, self._num_bound,
                        self._num_pinned, self.num_slots)
            unmapped = {(l_, e) for l_, row in enumerate(self._entries) for e, en in enumerate(row)
                        if en.state is ExpertState.RESIDENT and not en.mapped}
            # Only maps_on_read pools publish loads unmapped; each such expert is listed for map_for_read.
            assert self._unmapped == unmapped, "the experts listed for map_for_read are not the resident unmapped ones"

    def _bind_slot_locked(self, layer: int, expert: int, en: _Entry, slot: int, mapped: bool) -> None:
        """Give the expert `slot` (taken off the free list), which becomes LOADING (the caller checked it may)."""
        self._slot_owner[slot] = (layer, expert)
        en.state, en.slot, en.readers, en.mapped, en.issued = ExpertState.LOADING, slot, {}, mapped, False
        en.guards = [g for g in self._guards.pop(slot, ()) if not g.query()]
        self._num_bound[layer] += 1
        self.remaps += 1

    def _free_slot_locked(self, layer: int, slot: int, en: _Entry) -> None:
        owner = self._slot_owner[slot]
        if owner is not None:
            self._unmapped.discard(owner)
        self._slot_owner[slot] = None
        self._num_bound[layer] -= 1
        self._free.append(slot)
        en.state, en.slot, en.load_event, en.readers, en.mapped = ExpertState.ABSENT, None, None, None, False
        en.load_order = en.guards = None
        en.issued = False

    def pin(self, layer: int, expert: int) -> None:
        with self._lock:
            en = self._entry(layer, expert)
            if en.state is not ExpertState.RESIDENT:
                raise NotResidentError(f"pin: expert ({layer}, {expert}) is {en.state.value}")
            self._num_pinned[layer] += not en.pinned
            en.pinned = True

    def unpin(self, layer: int, expert: int) -> None:
        with self._lock:
            en = self._entry(layer, expert)
            if not en.pinned:
                raise ConfigError(f"unpin: expert ({layer}, {expert}) is not pinned")
            en.pinned = False
            self._num_pinned[layer] -= 1

    def is_pinned(self, layer: int, expert: int) -> bool:
        return self._entry(layer, expert).pinned  # one attribute read: no lock needed

    def num_pinned(self, layer: int) -> int:
        """Pinned experts of the layer (O(1): the engine asks per list)."""
        self._entry(layer, 0)
        return self._num_pinned[layer]
