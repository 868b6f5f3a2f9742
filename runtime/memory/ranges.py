"""The mappings under the expert slot pool's ranges (inference process, called by `ExpertSlotPool` under its lock).

`ExpertRanges` maps a slot's physical chunk under an expert's range and unmaps it again (with the poison chunk
put back where the pool poisons absent experts). A range whose slot the pool gave back before the work reading
it finished (`ExpertSlotPool.release`, the engine's evictions) stays mapped, "stale", with the events of that
work: `sweep` unmaps the stale ranges whose events are done (the loader runs it on the link worker, beside its
copies, so the ~20-30 µs driver call per eviction leaves the engine thread), and a stale range is unmapped, after
its events, before it is mapped again. A stale range is never read: its expert is absent, and readers are refused
(the pool's I3) until a new load maps it afresh. Never decides what to map.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from tierplan.runtime.device import Event
from tierplan.runtime.memory.backend import SlotBackend
from tierplan.runtime.memory.slot_types import ExpertLayout

Key = tuple[int, int]  # (layer, expert)
POISON_BYTE = 0xFF  # NaN in bf16, fp16, fp32 and fp8-e4m3: a stale read shows up in any output


class ExpertRanges:
    """The mapping calls of one pool (see the module docstring); not thread-safe: the pool's lock guards it.
    Built with every layer's range (each absent expert poisoned, or unmapped), `num_slots` slot chunks and, with
    `slot_window`, one more range mapping every slot at its own address for the pool's lifetime."""

    def __init__(self, backend: SlotBackend, layout: ExpertLayout, num_slots: int, poison_unmapped: bool,
                 slot_window: bool) -> None:
        self.backend, self.stride_bytes = backend, layout.stride_bytes
        stride = layout.stride_bytes
        self.bases: list[int] = []
        self.tensors: list[torch.Tensor] = []
        self.slots: list[Any] = []
        self.window: torch.Tensor | None = None
        try:
            self.poison_chunk = backend.create_physical(stride)
            backend.fill_physical(self.poison_chunk, POISON_BYTE)
            for _ in range(layout.num_layers):
                base = backend.reserve(layout.layer_bytes)
                self.bases.append(base)
                for e in range(layout.num_experts):
                    backend.map(base + e * stride, stride, self.poison_chunk, read_only=True)
                # Made while everything is mapped: torch may query the pointer's attributes.
                self.tensors.append(backend.tensor(base, layout.layer_bytes))  # [E*stride]
                if not poison_unmapped:
                    for e in range(layout.num_experts):
                        backend.unmap(base + e * stride, stride)
            for _ in range(num_slots):
                self.slots.append(backend.create_physical(stride))
            if slot_window:  # every slot at a fixed address too: copies need no remap first
                base = backend.reserve(num_slots * stride)  # released with the rest by backend.close()
                for i, phys in enumerate(self.slots):
                    backend.map(base + i * stride, stride, phys)
                self.window = backend.tensor(base, num_slots * stride)  # [num_slots * stride]
        except Exception:
            backend.close()
            raise
        # The read-only chunk mapped under absent ranges, or None: absent ranges are unmapped.
        self.poison = self.poison_chunk if poison_unmapped else None
        # Two locks, never the pool's: `_calls` around every driver call (a range is mapped or unmapped by one
        # thread at a time), `_books` around the stale books alone, so `defer_unmap` (the engine thread) never
        # waits behind a driver call on the link's worker. Order: `_calls`, then `_books`.
        self._calls, self._books = threading.Lock(), threading.Lock()
        # range -> (slot it maps, work that may still read it, epoch of its release)
        self._stale: dict[Key, tuple[int, list[Event], int]] = {}
        self._unmapping: dict[Key, tuple[int, list[Event], int]] = {}  # taken by a sweep, its unmap not done yet
        self.epoch = 0  # the caller's clock for `sweep(older_than=)` (the engine counts decode steps)
        self.num_deferred = 0  # ranges whose unmap was deferred (release)
        self.num_swept = 0  # deferred unmaps done by sweep
        self.num_forced = 0  # deferred unmaps done (after waiting for their events) because the range was remapped
        self.num_kept = 0  # stale ranges claimed by a load into the slot they map (no driver call at all)

    def _va(self, layer: int, expert: int) -> int:
        return self.bases[layer] + expert * self.stride_bytes

    def _take_stale(self, key: Key) -> list[Event] | None:
        with self._books:
            stale = self._stale.pop(key, None)
            stale = stale if stale is not None else self._unmapping.pop(key, None)
            return None if stale is None else stale[1]

    def stale_slot(self, layer: int, expert: int) -> int | None:
        """The slot a stale range still maps (None: the range is not stale)."""
        with self._books:
            got = self._stale.get((layer, expert))
            return None if got is None else got[0]

    def claim(self, layer: int, expert: int, slot: int) -> bool:
        """A load of the expert into `slot` takes its stale mapping over (the range maps that slot already);
        False if the range is no longer stale there (a sweep took it)."""
        with self._books:
            got = self._stale.get((layer, expert))
            if got is None or got[0] != slot:
                return False
            del self._stale[(layer, expert)]
            self.num_kept += 1
            return True

    def map(self, layer: int, expert: int, phys: object) -> None:
        """Map `phys` under the expert's range (a stale mapping of the range goes first, once its readers are done:
        rare, an expert asked for again right after its eviction)."""
        va, n = self._va(layer, expert), self.stride_bytes
        with self._calls:
            stale = self._take_stale((layer, expert))
            if stale is not None:
                for ev in stale:
                    ev.synchronize()
                self.backend.unmap(va, n)
                self.num_forced += 1
            elif self.poison is not None:
                self.backend.unmap(va, n)
            try:
                self.backend.map(va, n, phys)
            except Exception:
                if self.poison is not None:
                    self.backend.map(va, n, self.poison, read_only=True)
                raise

    def unmap(self, layer: int, expert: int) -> None:
        """Unmap the expert's range now (its readers are done), poison behind it where the pool poisons."""
        with self._calls:
            self._unmap_calls(layer, expert)

    def _unmap_calls(self, layer: int, expert: int) -> None:
        va, n = self._va(layer, expert), self.stride_bytes
        self.backend.unmap(va, n)
        if self.poison is not None:
            self.backend.map(va, n, self.poison, read_only=True)

    def defer_unmap(self, layer: int, expert: int, slot: int, events: list[Event]) -> None:
        """The range (mapping `slot`) stays mapped until `events` (the work that may read it) are done and then
        until `sweep` unmaps it, it is mapped again, or a load of the expert into `slot` claims it."""
        with self._books:
            self._stale[(layer, expert)] = (slot, events, self.epoch)
            self.num_deferred += 1

    def sweep(self, block: bool = False, older_than: int | None = None) -> int:
        """Unmap every stale range whose events are done (block=True: all of them, waiting for their events), or
        only those released before epoch `older_than`; returns how many."""
        with self._books:
            done = [k for k, (_s, evs, ep) in self._stale.items() if (older_than is None or ep < older_than)
                    and (block or all(ev.query() for ev in evs))]
            for k in done:
                self._unmapping[k] = self._stale.pop(k)
        num = 0
        for k in done:
            with self._calls:
                with self._books:
                    got = self._unmapping.pop(k, None)
                if got is None:  # mapped again meanwhile: `map` unmapped it first
                    continue
                for ev in got[1]:
                    ev.synchronize()  # block=True only: the others are done
                self._unmap_calls(*k)
                num += 1
        with self._books:
            self.num_swept += num
        return num

    def __len__(self) -> int:
        with self._books:
            return len(self._stale) + len(self._unmapping)
