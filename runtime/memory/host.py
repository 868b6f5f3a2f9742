"""CPU twin of the CUDA VMM backend: memfd chunks mapped into reserved ranges with mmap (inference process).

A reserved range is an anonymous PROT_NONE mapping; mapping a chunk replaces part of it with MAP_FIXED |
MAP_SHARED of the chunk's memfd, unmapping puts PROT_NONE back. This is real virtual memory, so the CPU
tests exercise the same property the GPU relies on: the address is stable and the bytes follow the chunk.
Touching an unmapped page faults (SIGSEGV): a pool made with `poison_unmapped=True` maps a read-only poison
chunk there instead.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os

import torch

from tierplan.runtime.errors import ConfigError
from tierplan.runtime.memory.backend import LiveCounts

_PROT_NONE, _PROT_READ, _PROT_WRITE = 0, 1, 2
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value

@functools.cache
def _libc() -> ctypes.CDLL:
    """libc's mmap/munmap with their C signatures (bound on first use, not at import)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _mmap(addr: int | None, n: int, prot: int, flags: int, fd: int) -> int:
    got = _libc().mmap(addr, n, prot, flags, fd, 0)
    if got in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap({n} bytes) failed: {os.strerror(err)}")
    if addr is not None and got != addr:
        raise OSError(0, f"mmap placed {n} bytes at {got:#x}, wanted {addr:#x}")
    return got


class _Chunk:
    def __init__(self, num_bytes: int) -> None:
        self.num_bytes = num_bytes
        self.fd = os.memfd_create("tierplan-slot", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, num_bytes)


class HostBackend:
    """memfd + mmap implementation of `SlotBackend` (see module docstring)."""

    def __init__(self) -> None:
        self.granularity_bytes = mmap.PAGESIZE
        self._reservations: dict[int, int] = {}
        self._chunks: set[_Chunk] = set()
        self._mapped: dict[int, tuple[int, _Chunk]] = {}

    def _check(self, what: str, n: int) -> None:
        if n <= 0 or n % self.granularity_bytes:
            raise ConfigError(f"{what}: {n} bytes is not a positive multiple of {self.granularity_bytes}")

    def reserve(self, num_bytes: int) -> int:
        self._check("reserve", num_bytes)
        va = _mmap(None, num_bytes, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1)
        self._reservations[va] = num_bytes
        return va

    def _inside(self, va: int, n: int) -> tuple[int, int] | None:
        """The reservation holding [va, va+n), if any."""
        for base, size in self._reservations.items():
            if base <= va and va + n <= base + size:
                return base, size
        return None

    def free_reservation(self, va: int, num_bytes: int) -> None:
        if self._reservations.get(va) != num_bytes:
            raise ConfigError(f"free_reservation: {va:#x} is not a reservation of {num_bytes} bytes")
        if any(va <= m < va + num_bytes for m in self._mapped):
            raise ConfigError(f"free_reservation: {va:#x} still holds mappings; unmap them first")
        del self._reservations[va]
        if _libc().munmap(va, num_bytes) != 0:
            raise OSError(ctypes.get_errno(), "munmap failed")

    def create_physical(self, num_bytes: int) -> _Chunk:
        self._check("create_physical", num_bytes)
        c = _Chunk(num_bytes)
        self._chunks.add(c)
        return c

    def release_physical(self, phys: object) -> None:
        assert isinstance(phys, _Chunk)
        if phys not in self._chunks:
            raise ConfigError("release_physical: chunk already released")
        if any(c is phys for _, c in self._mapped.values()):
            raise ConfigError("release_physical: chunk is still mapped")
        self._chunks.remove(phys)
        os.close(phys.fd)

    def map(self, va: int, num_bytes: int, phys: object, read_only: bool = False) -> None:
        assert isinstance(phys, _Chunk)
        self._check("map", num_bytes)
        if self._inside(va, num_bytes) is None:
            raise ConfigError(f"map: [{va:#x}, +{num_bytes}) is not inside a reservation")
        for m, (n, _) in self._mapped.items():
            if m < va + num_bytes and va < m + n:
                raise ConfigError(f"map: {va:#x} is already mapped (by {m:#x}; a page maps at most one chunk)")
        if num_bytes > phys.num_bytes:
            raise ConfigError(f"map: {num_bytes} bytes exceed the chunk's {phys.num_bytes}")
        prot = _PROT_READ if read_only else _PROT_READ | _PROT_WRITE
        _mmap(va, num_bytes, prot, _MAP_SHARED | _MAP_FIXED, phys.fd)
        self._mapped[va] = (num_bytes, phys)

    def unmap(self, va: int, num_bytes: int) -> None:
        got = self._mapped.get(va)
        if got is None or got[0] != num_bytes:
            raise ConfigError(f"unmap: nothing of {num_bytes} bytes is mapped at {va:#x}")
        _mmap(va, num_bytes, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE, -1)
        del self._mapped[va]

    def tensor(self, va: int, num_bytes: int) -> torch.Tensor:
        return torch.frombuffer((ctypes.c_uint8 * num_bytes).from_address(va), dtype=torch.uint8)  # [N]

    def fill_physical(self, phys: object, value: int) -> None:
        assert isinstance(phys, _Chunk)
        with mmap.mmap(phys.fd, phys.num_bytes) as m:
            m.write(bytes([value]) * phys.num_bytes)

    def live(self) -> LiveCounts:
        return LiveCounts(len(self._reservations), len(self._chunks), len(self._mapped))

    def close(self) -> None:
        for va, (n, _) in list(self._mapped.items()):
            self.unmap(va, n)
        for c in list(self._chunks):
            self.release_physical(c)
        for va, n in list(self._reservations.items()):
            self.free_reservation(va, n)
