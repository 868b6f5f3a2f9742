"""Value types of the transfer engine: links, traffic classes, priorities, requests, statistics.

Shared by the engine and its callers in the inference process; plain data, no behaviour.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import TYPE_CHECKING

import torch

from tierplan.runtime.device import Event
from tierplan.runtime.nvme import FileRegion

if TYPE_CHECKING:
    from tierplan.runtime.transfer_handle import TransferHandle


class Link(Enum):
    H2D = "h2d"
    D2H = "d2h"
    DISK2H = "disk2h"
    H2DISK = "h2disk"


class TrafficClass(Enum):
    EXPERT = "expert"
    KV = "kv"


class Priority(IntEnum):
    """Lower pops first."""

    URGENT = 0
    HIGH = 1
    NORMAL = 2
    LOW = 3


Buffer = torch.Tensor | FileRegion


@dataclass(slots=True)  # not frozen: a frozen dataclass costs ~3 µs to build, and a prefetch list builds many
class TransferRequest:
    """Move `src` to `dst` whole, or with `num_bytes` set, that many bytes from `src_offset_bytes` of `src` to
    `dst_offset_bytes` of `dst` (a range of a big buffer without making a view of it per request), or with
    `segments` set, each (src_offset_bytes, dst_offset_bytes, num_bytes) range in list order: a prefetch list
    as one transfer, submitted in O(1) requests, with a callback per segment.

    A segment fails on its own when its `before_segment` hook raises (its chunks are skipped, the others go
    on); a failed copy fails the whole transfer (every segment not yet done reports that error)."""

    link: Link
    traffic: TrafficClass
    src: Buffer
    dst: Buffer
    priority: Priority = Priority.NORMAL
    deadline_s: float | None = None  # absolute, on the engine's clock
    after: Event | None = None  # work that must finish before the copy reads `src`
    before_issue: Callable[[], None] | None = None  # runs in the link's worker right before the first chunk
    on_done: Callable[[TransferHandle], None] | None = None  # on the link's worker or retire thread, before wait()
    num_bytes: int | None = None  # None: the whole of src and dst, which must be the same size
    src_offset_bytes: int = 0
    dst_offset_bytes: int = 0
    segments: list[tuple[int, int, int]] | None = None  # (src_offset_bytes, dst_offset_bytes, num_bytes) each
    # Memory links only, on the link's worker: right before segment i's first chunk is issued (e.g. a slot map).
    before_segment: Callable[[int], None] | None = None
    # Memory links only: events segment i's copy must follow (work still reading the bytes it overwrites, e.g. a
    # reused slot's old expert): the link's stream is ordered after them (on a CPU the worker waits) before it.
    segment_after: list[list[Event]] | None = None
    # Memory links only, on the link's worker: segment i's last chunk is issued; its event (None on a CPU) orders
    # a stream after all of segment i's bytes.
    on_segment_issued: Callable[[int, Event | None], None] | None = None
    # Segment i's chunks are all retired (done, or skipped after a failure: the error), in order, on the link's
    # retire thread or worker, before the transfer's on_done. Also called for a request without `segments` (i=0).
    on_segment_done: Callable[[int, BaseException | None], None] | None = None


@dataclass
class ClassStats:
    transfers: int = 0
    bytes: int = 0
    queue_delay_s_sum: float = 0.0
    queue_delay_s_max: float = 0.0
    latency_s_sum: float = 0.0
    latency_s_max: float = 0.0
    deadline_misses: int = 0
    failures: int = 0


@dataclass
class LinkStats:
    bytes: int = 0
    chunks: int = 0
    transfers: int = 0
    # Timing, not identity: left out of == so counts can be compared exactly.
    queue_delay_s_sum: float = field(default=0.0, compare=False)
    queue_delay_s_max: float = field(default=0.0, compare=False)
    # Where the link's worker spends its time (memory links): before_issue hooks (e.g. slot remaps), issuing
    # copies, blocked on the oldest copy, and retiring finished chunks (events, on_done callbacks).
    hook_s: float = field(default=0.0, compare=False)
    issue_s: float = field(default=0.0, compare=False)
    blocked_s: float = field(default=0.0, compare=False)
    retire_s: float = field(default=0.0, compare=False)
    idle_s: float = field(default=0.0, compare=False)  # running jobs queued with submit_idle (e.g. slot maps)
    idle_jobs: int = 0
    idle_job_errors: int = 0


