"""Expert slot pool: a stable virtual range per MoE layer, a fixed pool of physical slots (inference process).

Each layer owns one virtual range holding every expert at `expert * stride_bytes` (a grouped GEMM reads expert e
at a fixed address, resident or not); `num_slots` physical chunks are mapped to experts on demand (ranges.py).
Loading is two-phase: `prepare_load` reserves a free slot (and maps it, unless `map_now=False`: the copy's worker
then calls `map_reserved`, off the submitting thread), the caller moves the bytes, `complete_load(ok, event)`
publishes them. With `slot_window=True` every slot is also mapped at its own address in one extra range for the
pool's lifetime: `prepare_load(..., via_window=True)` returns that view, so the copy starts at once and the
expert's range is mapped beside it, or, with `maps_on_read=True`, not at all until a range reader asks
(`map_for_read`): kernels that find experts through the slot table (slot_reads.py) read the window, so only
readers through the ranges (eager layers, whole-step graphs, `expert_tensor`) need an expert's range mapped.

Invariants (each has a test in tests/runtime/test_slots.py):
  I1 stable address: `layer_tensor(l).data_ptr()` never changes between construction and close.
  I2 one page, one slot: an expert range maps at most one slot, and a slot backs at most one expert.
  I3 RAW: an expert is readable only after its load; `wait_ready` orders the compute stream after the
     load's event, and reading a LOADING or absent expert through `expert_tensor` raises. A load may be
     published while its copy still runs (its event pending): work that reads experts without naming them
     (an all-resident layer, a CUDA-graph replay) calls `wait_published` first. Readers through the slot table
     (slot_reads.py; pools with a slot window) may read a LOADING expert once its copy is issued
     (`note_issued`): `wait_ready(issued_ok=True)` orders them after the copy, before its range is mapped.
  I4 WAR: a slot is written again only after its reader events, its own load copy and the last pool-wide read
     fence (`record_read_all`) completed. `unmap` waits for them on the host; `release` (the engine's evictions)
     returns at once and hands them to the slot's next load (`load_guards`: the loader's copy waits for them on
     the device, `prepare_load` on the host; a failed load hands them back) and to the range, which stays mapped
     ("stale", ranges.py) at least until they are done.
  I5 never stale: an ABSENT expert's range shows the poison byte (or faults, poison off), never another
     expert's bytes, once it is unmapped. Poisoned pools unmap a released range at once when nothing reads it,
     else once its readers are done (`sweep_stale`); with poison off a released range stays mapped until it is
     mapped again, so a reload into its old slot needs no driver call, and it may show the slot's next
     expert meanwhile. Reads of absent or LOADING experts are refused by I3 throughout; `scrub_on_unmap`
     poisons a slot's old contents before reuse. With maps_on_read, a RESIDENT expert's range is unmapped (or
     still stale, showing its old slot) until `map_for_read` maps it: range readers call it first.
  I6 recycled: free + bound slots == num_slots at every step; close() releases every backend object.

Mechanism only: which expert to load or evict is the caller's decision (agent local policy).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from tierplan.runtime.device import Device, Event, completed_event
from tierplan.runtime.errors import BusyError, CapacityError, ConfigError, NotResidentError, PinnedError
from tierplan.runtime.memory.backend import SlotBackend
from tierplan.runtime.memory.ranges import POISON_BYTE, ExpertRanges
from tierplan.runtime.memory.slot_books import SlotBooks
from tierplan.runtime.memory.slot_reads import SlotReads, add_reader
from tierplan.runtime.memory.slot_types import ExpertLayout, ExpertState, _Entry


class ExpertSlotPool(SlotBooks):
    """See the module docstring for the contract and invariants (the books and their queries: slot_books.py)."""

    def __init__(self, backend: SlotBackend, device: Device, num_layers: int, num_experts: int, expert_bytes: int,
                 num_slots: int, poison_unmapped: bool = False, scrub_on_unmap: bool = False,
                 slot_window: bool = False, maps_on_read: bool = False) -> None:
        if maps_on_read and not slot_window:
            raise ConfigError("ExpertSlotPool(maps_on_read=True) needs slot_window=True (loads copy through the "
                              "window)")
        super().__init__(ExpertLayout(num_layers, num_experts, expert_bytes, backend.granularity_bytes), num_slots)
        self.backend, self.device = backend, device
        self.poison_unmapped, self.scrub_on_unmap = poison_unmapped, scrub_on_unmap
        self.ranges = ExpertRanges(backend, self.layout, num_slots, poison_unmapped, slot_window)  # chunks, mappings
        self._bases, self._tensors, self._slots = self.ranges.bases, self.ranges.tensors, self.ranges.slots
        self._poison, self._window = self.ranges.poison_chunk, self.ranges.window
        self.reads = SlotReads(device, num_layers, num_experts, num_slots, table=slot_window)  # RAW/WAR, slot table
        # Loads are published without their range mapped; range readers map what they read (`map_for_read`).
        self.maps_on_read = maps_on_read
        self.read_maps = 0  # ranges mapped by map_for_read

    def layer_tensor(self, layer: int) -> torch.Tensor:
        """The whole stable range of a layer: [E * stride_bytes] uint8. Non-resident parts are poison."""
        self._entry(layer, 0)
        return self._tensors[layer]

    def _view(self, layer: int, expert: int) -> torch.Tensor:
        off = expert * self.layout.stride_bytes
        return self._tensors[layer][off : off + self.layout.expert_bytes]  # [expert_bytes]

    def expert_tensor(self, layer: int, expert: int) -> torch.Tensor:
        """A checked view of a resident expert's bytes; raises NotResidentError otherwise (I3)."""
        st = self._entry(layer, expert).state  # single attribute reads need no lock (here and below)
        if st is not ExpertState.RESIDENT:
            raise NotResidentError(f"expert ({layer}, {expert}) is {st.value}, not resident")
        self.map_for_read(layer, [expert])
        return self._view(layer, expert)

    @property
    def slot_window(self) -> bool:  # every slot also mapped at its own address (copies need no remap first)
        return self._window is not None

    def prepare_load(self, layer: int, expert: int, map_now: bool = True, via_window: bool = False) -> torch.Tensor:
        """Reserve a free slot for the expert (and map it unless map_now=False); returns the view to fill: the
        expert's range, or with via_window=True the slot's window (needs slot_window=True). Waits for the work
        still reading the slot's previous expert (I4): the caller writes the slot as soon as this returns."""
        ((_t, off),) = self.prepare_loads(layer, [expert], via_window)
        if map_now and not self.mapped(layer, [expert])[0]:
            try:
                self.map_reserved(layer, expert)
            except BaseException:
                self.complete_load(layer, expert, ok=False)
                raise
        for g in self.load_guards(layer, [expert])[0]:
            g.synchronize()
        if via_window:
            return _t[off : off + self.layout.expert_bytes]  # [expert_bytes]
        return self._view(layer, expert)

    def prepare_loads(self, layer: int, experts: list[int], via_window: bool = False) -> list[tuple[torch.Tensor, int]]:
        """`prepare_load(map_now=False)` for several experts of one layer under one lock (a prefetch list): all
        are reserved or, if any is refused (out of range, repeated, not absent, too few free slots), none is.
        Returns where to write each, as (range, byte offset): the layer's range, or the slot window."""
        if via_window and self._window is None:
            raise ConfigError("prepare_loads(via_window=True) needs a pool made with slot_window=True")
        with self._lock:
            row = self._entries[layer] if 0 <= layer < self.layout.num_layers else None
            num_experts = self.layout.num_experts
            for e in experts:  # validate all first (range, repeats, then state): a refusal reserves nothing
                if row is None or not 0 <= e < num_experts:
                    self._entry(layer, e)  # raises the precise out-of-range error
            if row is None:  # no experts asked (a bad layer raised above)
                return []
            if len(set(experts)) != len(experts):
                raise ConfigError(f"prepare_loads: layer {layer} experts {experts} repeat an expert")
            for e in experts:
                if row[e].state is not ExpertState.ABSENT:
                    raise BusyError(f"prepare_loads: expert ({layer}, {e}) is {row[e].state.value}")
            if len(experts) > len(self._free):
                raise CapacityError(f"prepare_loads: {len(experts)} experts need slots, {len(self._free)} of "
                                    f"{self.num_slots} are free; unmap experts first")
            self.limits.check(layer, self._num_bound[layer], len(experts))
            slots = self._pick_slots_locked(layer, experts)
            for e, (slot, mapped) in zip(experts, slots, strict=True):
                self._bind_slot_locked(layer, e, row[e], slot, mapped)
        stride = self.layout.stride_bytes
        if via_window:
            assert self._window is not None
            return [(self._window, s * stride) for s, _m in slots]
        return [(self._tensors[layer], e * stride) for e in experts]

    def _pick_slots_locked(self, layer: int, experts: list[int]) -> list[tuple[int, bool]]:
        """A free slot for each expert and whether its range maps it already: with poison off, a released expert
        whose range still maps its old slot gets that slot back if free; the others take the last freed first."""
        picked: dict[int, int] = {}
        if self.ranges.poison is None and len(self.ranges):
            free = set(self._free)
            for e in experts:
                s = self.ranges.stale_slot(layer, e)
                if s is not None and s in free and s not in picked.values() and self.ranges.claim(layer, e, s):
                    picked[e] = s
        if taken := set(picked.values()):
            self._free = [s for s in self._free if s not in taken]
        return [(picked[e], True) if e in picked else (self._free.pop(), False) for e in experts]

    def map_reserved(self, layer: int, expert: int) -> None:
        """Map the slot reserved by `prepare_load(map_now=False)`; any thread may call it (the copy worker). The
        driver calls run outside the pool's lock: the engine thread's queries never wait behind them."""
        with self._lock:
            en = self._entry(layer, expert)
            if en.state is not ExpertState.LOADING or en.mapped:
                raise BusyError(f"map_reserved: expert ({layer}, {expert}) is {en.state.value}, mapped={en.mapped}")
            slot, en.mapped = en.slot, True  # claimed now: a second call is refused (a LOADING entry is its loader's)
        try:
            self.ranges.map(layer, expert, self._slots[slot])
        except BaseException:
            with self._lock:
                en.mapped = False
            raise

    def map_for_read(self, layer: int, experts: Iterable[int]) -> int:
        """Map the ranges of these resident experts that are not mapped yet (a pool with maps_on_read: its loads
        leave them unmapped), for a reader through the ranges that runs next; how many were mapped. Every id is
        checked before anything changes. The maps run under the pool's lock (which the link's worker also takes
        to release a load whose copy failed after publishing), so no expert is released between the check and
        its map; the cost is paid only by range readers of a maps_on_read pool. One lookup when nothing is
        unmapped."""
        if not self._unmapped:
            return 0
        experts = list(experts)
        num = 0
        with self._lock:
            entries = [self._entry(layer, e) for e in experts]  # validate all first: a refusal maps nothing
            for e, en in zip(experts, entries, strict=True):
                if en.state is not ExpertState.RESIDENT or en.mapped:
                    continue
                self.ranges.map(layer, e, self._slots[en.slot])  # type: ignore[index]  # raises: books unchanged
                en.mapped = True
                self._unmapped.discard((layer, e))
                num += 1
        self.read_maps += num
        return num

    def map_all_for_read(self) -> int:
        """`map_for_read` over every resident expert whose range is unmapped (a whole-step graph reads them all)."""
        if not self._unmapped:
            return 0
        with self._lock:
            keys = sorted(self._unmapped)
        layers: dict[int, list[int]] = {}
        for layer, e in keys:
            layers.setdefault(layer, []).append(e)
        return sum(self.map_for_read(layer, es) for layer, es in layers.items())

    def mapped(self, layer: int, experts: list[int]) -> list[bool]:
        """Per loading expert, whether its range maps its slot already (kept from `release`: no map needed)."""
        return [self._entry(layer, e).mapped for e in experts]

    def load_guards(self, layer: int, experts: list[int]) -> list[list[Event]]:
        """Per loading expert, the events of work still reading its slot's previous expert: its copy follows (I4)."""
        return [list(self._entry(layer, e).guards or ()) for e in experts]

    def complete_load(self, layer: int, expert: int, ok: bool, event: Event | None = None,
                      order: tuple[object, int] | None = None) -> None:
        """Publish a loaded expert (ok) with the event its copy recorded, or give the slot back (not ok). order:
        (source, n) when the source's loads complete in the order of n (`wait_ready` waits for a list's last)."""
        with self._lock:
            en = self._entry(layer, expert)
            if en.state is not ExpertState.LOADING:
                raise BusyError(f"complete_load: expert ({layer}, {expert}) is {en.state.value}, not loading")
            if ok and not en.mapped and not self.maps_on_read:
                raise BusyError(f"complete_load: expert ({layer}, {expert}) was never mapped (map_reserved)")
            if ok:
                if not en.mapped:
                    self._unmapped.add((layer, expert))
                en.state, en.load_event = ExpertState.RESIDENT, event or completed_event()
                en.load_order, en.guards = (order if event is not None else None), None
                self._num_resident[layer] += 1
                if event is not None:  # kept while still copying (wait_published)
                    self.reads.published(event)
                return
            self._release_locked(layer, expert, en)

    def _release_locked(self, layer: int, expert: int, en: _Entry) -> None:
        stride, slot = self.layout.stride_bytes, en.slot
        assert slot is not None
        if en.state in (ExpertState.RESIDENT, ExpertState.EVICTING):
            self._num_resident[layer] -= 1
        # A failed load's guards (readers of the slot's previous expert) go back to the slot: no scrub, no unmap
        # touches it before they end (I4).
        # A slot-table reader of the failed load (its copy was issued) counts as well.
        guards = [g for g in (*(en.guards or ()), *(en.readers or {}).values(),
                              *([en.load_event] if en.load_event else ()))
                  if not g.query()] if en.state is ExpertState.LOADING else []
        self._guards[slot] = [*self._guards.get(slot, ()), *guards]
        if guards and en.mapped and not self.scrub_on_unmap:
            self.ranges.defer_unmap(layer, expert, slot, guards)
            return self._free_slot_locked(layer, slot, en)
        for g in guards if self.scrub_on_unmap else ():
            g.synchronize()
        if self.scrub_on_unmap and (en.mapped or self._window is not None):  # a window load may not be mapped yet
            src = self._window[slot * stride : (slot + 1) * stride] if self._window is not None else \
                self._tensors[layer][expert * stride : (expert + 1) * stride]  # [stride_bytes]
            src.fill_(POISON_BYTE)
            self.device.synchronize()
        if en.mapped:
            self.ranges.unmap(layer, expert)
        self._free_slot_locked(layer, slot, en)

    def wait_ready(self, layer: int, experts: Iterable[int], stream: Any = None, issued_ok: bool = False) -> None:
        """Order `stream` after the loads of `experts` (RAW); raises NotResidentError for any not resident (nor,
        with issued_ok, LOADING with its copy issued: a slot-table reader). Loads numbered by their source
        (`complete_load(order=)`) cost one stream wait per list, none when the stream already waited past them;
        the others one each."""
        with self._lock:
            loads = [self._readable_locked(layer, e, issued_ok, "wait_ready") for e in experts]
            # Waited for under the lock: the books say the stream waited, so no other caller may skip it first.
            self.reads.order_after(loads, stream)  # type: ignore[arg-type]

    def _readable_locked(self, layer: int, expert: int, issued_ok: bool, what: str) -> tuple[Event | None, Any]:
        en = self._entry(layer, expert)
        if en.state is not ExpertState.RESIDENT and not (issued_ok and en.issued):
            raise NotResidentError(f"{what}: expert ({layer}, {expert}) is {en.state.value}")
        return en.load_event, en.load_order

    @property
    def ready_waits(self) -> int:  # stream waits made by wait_ready (one per list of ordered loads, at most)
        return self.reads.ready_waits

    def wait_published(self, stream: Any = None) -> None:
        """Order `stream` after every published load whose copy may still run (I3 for readers that name no
        experts: an all-resident layer, a graph replay). Cheap when none is: one lock, an empty list."""
        if not self.reads.unsettled:  # read without the lock: a load published meanwhile is not this reader's
            return
        with self._lock:
            pending = list(self.reads.unsettled_now())
        for ev in pending:
            self.device.stream_wait(ev, stream)

    def note_issued(self, layer: int, expert: int, event: Event | None, order: tuple[object, int] | None) -> None:
        """A LOADING expert's copy is issued (event: its end; None: done, on the CPU twin): slot-table readers
        may read it once ordered after the event (`wait_ready(issued_ok=True)`), before it is published."""
        with self._lock:
            en = self._entry(layer, expert)
            if en.state is not ExpertState.LOADING:
                raise BusyError(f"note_issued: expert ({layer}, {expert}) is {en.state.value}, not loading")
            en.issued, en.load_event = True, event or completed_event()
            en.load_order = order if event is not None else None

    def sync_table(self, layer: int, experts: Iterable[int]) -> None:
        """Make the slot table name the slots of `layer`'s `experts` (each resident, or loading with its copy
        issued) for the kernels queued next on the current stream (engine thread)."""
        with self._lock:
            pairs = []
            for e in experts:
                self._readable_locked(layer, e, True, "sync_table")
                pairs.append((e, self._entries[layer][e].slot))
        self.reads.write_table(layer, pairs)  # type: ignore[arg-type]

    def record_read(self, layer: int, experts: Iterable[int], event: Event, stream: Any = None) -> None:
        """Remember that work ending at `event`, recorded on `stream` (None: the current one) after the earlier
        events passed for that stream, reads these experts (WAR protection for their slots; `add_reader`)."""
        experts = list(experts)
        key = self.device.stream_key(stream)
        with self._lock:
            entries = [self._entry(layer, e) for e in experts]
            for e, en in zip(experts, entries, strict=True):  # validate all first: a refusal records nothing
                if en.state is not ExpertState.RESIDENT and not en.issued:  # issued: a slot-table reader's
                    raise NotResidentError(f"record_read: expert ({layer}, {e}) is {en.state.value}")
            for en in entries:
                en.readers = add_reader(en.readers or {}, key, event)

    def record_read_all(self, event: Event) -> None:
        """Work ending at `event` may read any resident expert (a step that skipped per-expert bookkeeping, a graph
        replay): no slot is reused before it ends."""
        with self._lock:  # an eviction checks then clears the fence under the lock: a new one must not slip between
            self.reads.fence = event

    def _evictable_locked(self, layer: int, expert: int, what: str) -> tuple[_Entry, list[Event]]:
        """The entry of a resident, unpinned expert and the events of the work that may still read its slot."""
        en = self._entry(layer, expert)
        if en.state is not ExpertState.RESIDENT:
            err = BusyError if en.state in (ExpertState.LOADING, ExpertState.EVICTING) else NotResidentError
            raise err(f"{what}: expert ({layer}, {expert}) is {en.state.value}")
        if en.pinned:
            raise PinnedError(f"{what}: expert ({layer}, {expert}) is pinned")
        # The load's own copy counts as in flight too: a slot is never reused under a running copy.
        pending = [*(en.readers or {}).values(), *([en.load_event] if en.load_event is not None else []),
                   *self.reads.fence_pending()]
        return en, [r for r in pending if not r.query()]

    def release(self, layer: int, expert: int) -> None:
        """Unbind a resident expert's slot at once, without waiting for the work reading it (I4 says who waits);
        with scrub_on_unmap this is `unmap` (the scrub overwrites the slot: its readers must be done)."""
        if self.scrub_on_unmap:
            self.unmap(layer, expert)
            return
        with self._lock:
            en, pending = self._evictable_locked(layer, expert, "release")
            slot = en.slot
            assert slot is not None
            self._num_resident[layer] -= 1
            self._guards[slot] = pending
            if en.mapped and (pending or self.ranges.poison is None):
                self.ranges.defer_unmap(layer, expert, slot, pending)
            elif en.mapped:  # poisoned (a debugging pool): nothing reads the range, so it shows poison from now on
                self.ranges.unmap(layer, expert)
            self._free_slot_locked(layer, slot, en)

    def sweep_stale(self, block: bool = False) -> int:
        """Unmap the ranges `release` left mapped whose readers are done (block: all, after them); how many. With
        poison off, those released in this or the last epoch (`ranges.epoch`) stay, for a reload to keep."""
        return self.ranges.sweep(block, None if block or self.poison_unmapped else self.ranges.epoch - 1)

    @property
    def num_stale(self) -> int:  # ranges `release` left mapped, not unmapped yet
        return len(self.ranges)

    def unmap(self, layer: int, expert: int, wait: bool = True) -> None:
        """Unbind a resident expert's slot after its readers finish (I4). wait=False refuses if they have not."""
        with self._lock:
            en, readers = self._evictable_locked(layer, expert, "unmap")
            if readers and not wait:
                raise BusyError(f"unmap: expert ({layer}, {expert}) has {len(readers)} reader(s) or copy in flight")
            en.state = ExpertState.EVICTING
        try:
            for r in readers:  # outside the lock: other experts stay usable while we wait
                r.synchronize()
        except BaseException:
            with self._lock:
                en.state = ExpertState.RESIDENT  # nothing was unmapped: the expert is still usable
            raise
        with self._lock:
            self._release_locked(layer, expert, en)

    def close(self) -> None:
        """Wait for readers, then release every mapping, slot and reservation (I6)."""
        self.sweep_stale(block=True)
        with self._lock:
            pending = [r for row in self._entries for en in row
                       for r in [*(en.readers or {}).values(), *([en.load_event] if en.load_event is not None else [])]]
        for r in pending:
            r.synchronize()
        self._tensors.clear()
        self.backend.close()
