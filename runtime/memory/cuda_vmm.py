"""CUDA virtual memory backend for the expert slot pool (inference process, GPU only).

Uses the driver API through `cuda.bindings.driver`: cuMemAddressReserve for stable virtual ranges,
cuMemCreate for physical chunks in HBM, cuMemMap + cuMemSetAccess to map, cuMemUnmap to unmap. Every
CUresult is checked and turned into a `CudaError` naming the call; a half-done map is rolled back, and
`close()` releases every mapping, chunk and reservation (also after an error). Grouped GEMMs read experts
through the stable range, so kernels never see an address change when experts move.
"""

from __future__ import annotations

from typing import Any

import torch

from tierplan.runtime.errors import ConfigError, CudaError
from tierplan.runtime.memory.backend import LiveCounts


def _load_driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # pragma: no cover - depends on the extra
        raise ConfigError("CudaVmmBackend needs cuda-python: pip install 'tierplan[gpu]'") from exc
    return driver


def _check(cu: Any, result: Any, what: str) -> Any:
    err = result[0] if isinstance(result, tuple) else result
    if err != cu.CUresult.CUDA_SUCCESS:
        name = cu.cuGetErrorName(err)
        raise CudaError(f"{what} failed: {name[1].decode() if name[0] == cu.CUresult.CUDA_SUCCESS else err}")
    if isinstance(result, tuple) and len(result) > 1:
        return result[1] if len(result) == 2 else result[1:]
    return None


class _CudaArray:
    """Exposes a raw device range to torch through `__cuda_array_interface__` (no copy, no ownership)."""

    def __init__(self, va: int, num_bytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (num_bytes,),
            "typestr": "|u1",
            "data": (va, False),
            "version": 3,
            "strides": None,
        }


class CudaVmmBackend:
    """`SlotBackend` over CUDA VMM on one device."""

    def __init__(self, device_index: int = 0) -> None:
        cu = self._cu = _load_driver()
        self.device_index = device_index
        self.torch_device = torch.device("cuda", device_index)
        torch.empty(1, device=self.torch_device)  # the primary context must exist before driver calls
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device_index
        self._prop = prop
        gran = _check(
            cu,
            cu.cuMemGetAllocationGranularity(
                prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            ),
            "cuMemGetAllocationGranularity",
        )
        self.granularity_bytes = int(gran)
        self._access: dict[bool, Any] = {}
        for ro in (False, True):
            desc = cu.CUmemAccessDesc()
            desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = device_index
            desc.flags = (
                cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
                if ro
                else cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            )
            self._access[ro] = desc
        self.read_only_fallbacks = 0  # maps asked read-only that the driver only granted read-write
        self._read_only_refused = False
        self._reservations: dict[int, int] = {}
        self._physical: dict[int, tuple[Any, int]] = {}  # id -> (handle, bytes)
        self._mapped: dict[int, tuple[int, int]] = {}  # va -> (bytes, phys id)

    def _aligned(self, what: str, n: int) -> None:
        if n <= 0 or n % self.granularity_bytes:
            raise ConfigError(f"{what}: {n} bytes is not a positive multiple of {self.granularity_bytes}")

    def reserve(self, num_bytes: int) -> int:
        self._aligned("reserve", num_bytes)
        cu = self._cu
        ptr = _check(cu, cu.cuMemAddressReserve(num_bytes, self.granularity_bytes, 0, 0), "cuMemAddressReserve")
        va = int(ptr)
        self._reservations[va] = num_bytes
        return va

    def free_reservation(self, va: int, num_bytes: int) -> None:
        if self._reservations.pop(va, None) is None:
            raise ConfigError(f"free_reservation: {va:#x} is not a reservation")
        _check(self._cu, self._cu.cuMemAddressFree(self._cu.CUdeviceptr(va), num_bytes), "cuMemAddressFree")

    def create_physical(self, num_bytes: int) -> int:
        self._aligned("create_physical", num_bytes)
        handle = _check(self._cu, self._cu.cuMemCreate(num_bytes, self._prop, 0), f"cuMemCreate({num_bytes})")
        key = int(handle)
        self._physical[key] = (handle, num_bytes)
        return key

    def release_physical(self, phys: object) -> None:
        assert isinstance(phys, int)
        if phys not in self._physical:
            raise ConfigError("release_physical: chunk already released")
        if any(p == phys for _, p in self._mapped.values()):
            raise ConfigError("release_physical: chunk is still mapped")
        handle, _ = self._physical.pop(phys)
        _check(self._cu, self._cu.cuMemRelease(handle), "cuMemRelease")

    def map(self, va: int, num_bytes: int, phys: object, read_only: bool = False) -> None:
        assert isinstance(phys, int)
        self._aligned("map", num_bytes)
        if va in self._mapped:
            raise ConfigError(f"map: {va:#x} is already mapped (a page maps at most one chunk)")
        handle, size = self._physical[phys]
        if num_bytes > size:
            raise ConfigError(f"map: {num_bytes} bytes exceed the chunk's {size}")
        cu = self._cu
        ptr = cu.CUdeviceptr(va)
        _check(cu, cu.cuMemMap(ptr, num_bytes, 0, handle, 0), "cuMemMap")
        try:
            ro = read_only and not self._read_only_refused
            res = cu.cuMemSetAccess(ptr, num_bytes, [self._access[ro]], 1)
            if ro and res[0] != cu.CUresult.CUDA_SUCCESS:
                self._read_only_refused = True  # asked once; every later poison map goes read-write directly
                res = cu.cuMemSetAccess(ptr, num_bytes, [self._access[False]], 1)
            if read_only and self._read_only_refused:
                self.read_only_fallbacks += 1
            _check(cu, res, "cuMemSetAccess")
        except Exception:
            cu.cuMemUnmap(ptr, num_bytes)
            raise
        self._mapped[va] = (num_bytes, phys)

    def unmap(self, va: int, num_bytes: int) -> None:
        got = self._mapped.get(va)
        if got is None or got[0] != num_bytes:
            raise ConfigError(f"unmap: nothing of {num_bytes} bytes is mapped at {va:#x}")
        _check(self._cu, self._cu.cuMemUnmap(self._cu.CUdeviceptr(va), num_bytes), "cuMemUnmap")
        del self._mapped[va]

    def tensor(self, va: int, num_bytes: int) -> torch.Tensor:
        return torch.as_tensor(_CudaArray(va, num_bytes), device=self.torch_device)  # [N]

    def fill_physical(self, phys: object, value: int) -> None:
        assert isinstance(phys, int)
        _, size = self._physical[phys]
        va = self.reserve(size)
        try:
            self.map(va, size, phys)
            try:
                self.tensor(va, size).fill_(value)
                torch.cuda.synchronize(self.torch_device)
            finally:
                self.unmap(va, size)
        finally:
            self.free_reservation(va, size)

    def live(self) -> LiveCounts:
        return LiveCounts(len(self._reservations), len(self._physical), len(self._mapped))

    def close(self) -> None:
        torch.cuda.synchronize(self.torch_device)
        errors: list[Exception] = []
        for va, (n, _) in list(self._mapped.items()):
            try:
                self.unmap(va, n)
            except Exception as exc:
                errors.append(exc)
        for p in list(self._physical):
            try:
                self.release_physical(p)
            except Exception as exc:
                errors.append(exc)
        for va, n in list(self._reservations.items()):
            try:
                self.free_reservation(va, n)
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise CudaError(f"close released what it could; {len(errors)} call(s) failed, first: {errors[0]}")
