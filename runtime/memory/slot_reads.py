"""How reads of the expert slot pool are ordered against its loads (inference process, under the pool's lock).

`SlotReads` keeps the pool's books on readers: the loads a reader stream is already ordered after
(`ReadyOrder`: one stream wait per list of numbered loads), the published loads whose copies may still run
(readers that name no experts wait for them), the last pool-wide read fence, and the slot table. The slot table
([layers, experts] int64 on the device) says which slot holds each expert: a grouped GEMM that indexes it reads
an expert through the slot window, so a load needs no mapping of the expert's range before such a read. The
table is written on the reader's stream (`write_table`), in stream order with the kernels that read it; a host
copy says what the device holds, so an entry is written only when its slot changed (a layer's misses). Each
changed entry is one 8-byte host->device copy from a pinned array that holds every slot number, which never
changes: no staging buffer to recycle, no scatter kernel, no event (a Python scalar assigned into a CUDA tensor
would copy from pageable memory and wait for the stream). Never decides what to load or evict; never maps
anything.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tierplan.runtime.device import Device, Event


def add_reader(readers: dict[object, Event], key: object, event: Event) -> dict[object, Event]:
    """A slot's readers with `event` added, recorded on the stream `key` names (`Device.stream_key`) after the
    events passed for it before: on a GPU only the last event of each stream is kept (a stream's events end in
    order, so none is queried per read); on the CPU twin (key None: host events end in any order) each one until
    it is done, the done ones pruned when four pile up."""
    if key is not None:
        readers[key] = event
        return readers
    if len(readers) >= 4:
        readers = {k: r for k, r in readers.items() if not r.query()}
    readers[id(event)] = event
    return readers


class ReadyOrder:
    """Which loads a reader stream is already ordered after (the pool's `wait_ready`). The loads of one source (a
    loader's copies, issued on one link stream in the order it numbers them) complete in that order, so a stream
    ordered after load n of a source is ordered after every earlier one: per source, one event to wait for, and
    none for loads the stream already waited past. Loads without an order are waited for one by one."""

    def __init__(self) -> None:
        self._upto: dict[tuple[object, object], int] = {}  # (stream, source) -> highest n waited for

    def to_wait(self, stream: object, loads: list[tuple[Event, tuple[object, int] | None]]) -> list[Event]:
        """The events `stream` must wait for to be ordered after all of `loads` ((event, order) each); records
        them as waited for (the caller waits right away, under the pool's lock)."""
        out: list[Event] = []
        best: dict[object, tuple[int, Event]] = {}
        for ev, order in loads:
            if order is None:
                out.append(ev)
                continue
            src, n = order
            if n > self._upto.get((stream, src), -1) and n > best.get(src, (-1, ev))[0]:
                best[src] = (n, ev)
        for src, (n, ev) in best.items():
            self._upto[(stream, src)] = n
            out.append(ev)
        return out


class SlotReads:
    """The reader books of one pool (see the module docstring); the pool calls it under its lock, except
    `wait_published`'s first look and `write_table` (the engine thread alone writes the table)."""

    def __init__(self, device: Device, num_layers: int, num_experts: int, num_slots: int, table: bool) -> None:
        self.device = device
        self.fence: Event | None = None  # last record_read_all: work that may read any slot
        self.unsettled: list[Event] = []  # events of published loads whose copy may still run
        self.ready = ReadyOrder()
        self.ready_waits = 0  # stream waits made by wait_ready (one per list of ordered loads, at most)
        # The slot of each expert as the device's table says ([L, E] int64; -1 on the host: never written).
        self.table = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device.torch_device) \
            if table else None
        self._table_host = np.full((num_layers, num_experts), -1, dtype=np.int64)
        # Slot s's number at element s, the source of every entry's copy (read by copies still queued: never written).
        self._slot_ids = torch.arange(num_slots if table else 0, dtype=torch.int64, pin_memory=device.is_cuda)  # [S]
        self.table_writes = 0  # entries written

    def order_after(self, loads: list[tuple[Event, tuple[object, int] | None]], stream: Any = None) -> None:
        """Order `stream` after every load of `loads` ((event, order) each), skipping the ones it waited past."""
        for ev in self.ready.to_wait(self.device.stream_key(stream), loads):
            self.device.stream_wait(ev, stream)
            self.ready_waits += 1

    def published(self, event: Event) -> None:
        """A load was published while its copy may still run (done ones are dropped here too)."""
        self.unsettled = [ev for ev in (*self.unsettled, event) if not ev.query()]

    def unsettled_now(self) -> list[Event]:
        """The published loads' copies still running (pruned)."""
        self.unsettled = [ev for ev in self.unsettled if not ev.query()]
        return self.unsettled

    def fence_pending(self) -> list[Event]:
        """The last pool-wide read fence, if its work may still run (forgotten once done: queried once)."""
        if self.fence is not None and self.fence.query():
            self.fence = None
        return [self.fence] if self.fence is not None else []

    def write_table(self, layer: int, slots: list[tuple[int, int]]) -> None:
        """Make the device table say slot s for each (expert, s) of `layer`, on the current stream: after the
        kernels queued before (they read the old entries), before the ones queued next."""
        if self.table is None:
            raise RuntimeError("write_table: this pool has no slot table (it was made without a slot window)")
        host = self._table_host[layer]
        changed = [(e, s) for e, s in slots if host[e] != s]
        if not changed:
            return
        if not self.device.is_cuda:
            self.table[layer, [e for e, _s in changed]] = torch.tensor([s for _e, s in changed])
        else:
            stream, row = torch.cuda.current_stream(self.device.torch_device), layer * self.table.shape[1]
            for e, s in changed:
                self.device.copy_range(self.table, (row + e) * 8, self._slot_ids, s * 8, 8, stream, record=False)
        host[[e for e, _s in changed]] = [s for _e, s in changed]
        self.table_writes += len(changed)
