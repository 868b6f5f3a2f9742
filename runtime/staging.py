"""One pool of page-aligned host staging buffers for every byte mover that stages through host memory
(inference process): the expert loader's NVMe reads and the KV handler's GPU <-> NVMe hops and block I/O.

A user takes a buffer for the bytes it needs (`take(num_bytes)` lends a whole buffer, seen through a view
of that many bytes) and gives it back when its copies are done; `take` waits for one to be free. A user
that owns the pool closes it; a user given a shared pool only gives its buffers back. Page-aligned is what
O_DIRECT needs, pinned (on a GPU) what asynchronous copies need. Never decides what moves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierplan.runtime.device import AlignedHostBuffer, Device
from tierplan.runtime.errors import BusyError, ConfigError


class StagingClosed(Exception):
    """`take` gave up: the pool is closed, or the taker's own `refuse()` became true (its owner is closing)."""


@dataclass(frozen=True)
class StagingLease:
    buffer: AlignedHostBuffer
    tensor: torch.Tensor  # [num_bytes] the first bytes of the buffer: what the taker asked for


class StagingPool:
    """`count` buffers of `buffer_bytes` each; thread-safe."""

    def __init__(self, device: Device, buffer_bytes: int, count: int) -> None:
        for name, v in (("buffer_bytes", buffer_bytes), ("count", count)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"StagingPool: {name} must be an int >= 1, got {v!r}")
        self.buffer_bytes, self.count = buffer_bytes, count
        self._all = [device.alloc_host(buffer_bytes) for _ in range(count)]
        self._free = list(self._all)
        self._cv = threading.Condition()
        self._closed = False

    def take(self, num_bytes: int, refuse: Callable[[], bool] | None = None) -> StagingLease:
        """A free buffer seen as [num_bytes]; waits for one. StagingClosed once the pool closes or `refuse()`."""
        if num_bytes > self.buffer_bytes:
            raise ConfigError(f"StagingPool.take: {num_bytes} bytes asked, the buffers hold {self.buffer_bytes}")
        with self._cv:
            while not self._free and not self._closed and not (refuse is not None and refuse()):
                self._cv.wait()
            if self._closed or (refuse is not None and refuse()):
                raise StagingClosed
            buf = self._free.pop()
        return StagingLease(buf, buf.tensor[:num_bytes])

    def give(self, lease: StagingLease) -> None:
        with self._cv:
            self._free.append(lease.buffer)
            self._cv.notify_all()

    def wake(self) -> None:
        """Wake every waiting `take` to look at its `refuse()` again (its owner just started closing)."""
        with self._cv:
            self._cv.notify_all()

    @property
    def num_free(self) -> int:
        with self._cv:
            return len(self._free)

    def close(self) -> None:
        """Release the buffers; BusyError (nothing released) while some are still lent out."""
        with self._cv:
            if len(self._free) < len(self._all):
                raise BusyError(f"StagingPool.close: {len(self._all) - len(self._free)} buffer(s) still lent out")
            self._closed = True
            self._cv.notify_all()
            bufs, self._all, self._free = self._all, [], []
        for buf in bufs:
            buf.close()
