"""The interface every slot-pool memory backend implements (inference process).

A backend reserves virtual ranges, creates physical chunks, and maps/unmaps chunks into ranges; it decides
nothing. `CudaVmmBackend` does this with the CUDA driver's VMM calls, `HostBackend` with memfd + mmap, so
both have the property the pool relies on: the bytes of a physical chunk appear at whatever virtual
address it is mapped to, and a virtual address stays valid (stable) across remaps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tierplan.runtime.device import Device, DeviceKind


@dataclass
class LiveCounts:
    """What a backend still holds; all zero after `close()`."""

    reservations: int = 0
    physical: int = 0
    mappings: int = 0


class SlotBackend(Protocol):
    granularity_bytes: int

    def reserve(self, num_bytes: int) -> int:
        """Reserve a virtual range; returns its base address."""
        ...

    def free_reservation(self, va: int, num_bytes: int) -> None: ...

    def create_physical(self, num_bytes: int) -> object:
        """Create a physical chunk; returns an opaque handle."""
        ...

    def release_physical(self, phys: object) -> None: ...

    def map(self, va: int, num_bytes: int, phys: object, read_only: bool = False) -> None: ...

    def unmap(self, va: int, num_bytes: int) -> None: ...

    def tensor(self, va: int, num_bytes: int) -> torch.Tensor:
        """A uint8 tensor over `num_bytes` at `va` (the address never changes)."""
        ...

    def fill_physical(self, phys: object, value: int) -> None:
        """Set every byte of a physical chunk to `value` (used for poison)."""
        ...

    def live(self) -> LiveCounts: ...

    def close(self) -> None: ...


def make_backend(device: Device) -> SlotBackend:
    """The backend for a device: CUDA VMM on a GPU, the memfd + mmap twin on the CPU (imported lazily)."""
    if device.kind is DeviceKind.CUDA:
        from tierplan.runtime.memory.cuda_vmm import CudaVmmBackend

        return CudaVmmBackend(device.index)
    from tierplan.runtime.memory.host import HostBackend

    return HostBackend()
