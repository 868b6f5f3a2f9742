"""Device abstraction: buffers, streams, events and copies on CUDA, with a CPU twin (inference process).

The CPU twin keeps the same contract so CI can test every ordering rule: copies are done by the caller's
thread, events are `HostEvent`s that a test may leave unsignalled to model an in-flight kernel.
Never imports anything of ours above `runtime`, never decides policy.
"""

from __future__ import annotations

import mmap
import threading
from enum import Enum
from typing import Any, Protocol

import torch

from tierplan.runtime.errors import AlignmentError, ConfigError, CudaError

HOST_ALIGN_BYTES = 4096


def _driver() -> Any:
    """cuda-python's driver bindings, or None without them (the `gpu` extra): copies then go through torch."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    return driver


def byte_range(t: torch.Tensor, offset_bytes: int, num_bytes: int) -> torch.Tensor:
    """Bytes [offset, offset + num) of a contiguous tensor as a uint8 view; the tensor itself when it already
    is exactly that (no view op)."""
    if offset_bytes == 0 and t.dim() == 1 and t.dtype == torch.uint8 and t.numel() == num_bytes:
        return t
    return t.reshape(-1).view(torch.uint8)[offset_bytes : offset_bytes + num_bytes]  # [num_bytes]


class DeviceKind(Enum):
    CPU = "cpu"
    CUDA = "cuda"


class Event(Protocol):
    """A point in a stream's work: `query()` is non-blocking, `synchronize()` blocks the host."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class HostEvent:
    """CPU twin of a CUDA event. Created unsignalled; `set()` marks the work done."""

    def __init__(self, done: bool = False) -> None:
        self._flag = threading.Event()
        if done:
            self._flag.set()

    def set(self) -> None:
        self._flag.set()

    def query(self) -> bool:
        return self._flag.is_set()

    def synchronize(self, timeout_s: float | None = None) -> None:
        if not self._flag.wait(timeout_s):
            raise TimeoutError(f"host event not signalled within {timeout_s} s")


def completed_event() -> HostEvent:
    return HostEvent(done=True)


class AlignedHostBuffer:
    """Page-aligned host memory (anonymous mmap), registered as pinned with CUDA when a GPU is used.

    Page alignment is what O_DIRECT needs; pinning is what async host<->device copies need.
    """

    def __init__(self, num_bytes: int, pin: bool) -> None:
        if num_bytes <= 0:
            raise ConfigError(f"AlignedHostBuffer: num_bytes must be > 0, got {num_bytes}")
        self.num_bytes = num_bytes
        self._map = mmap.mmap(-1, num_bytes)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)  # [N]
        if self.tensor.data_ptr() % HOST_ALIGN_BYTES:
            raise AlignmentError(f"anonymous mmap returned an address not aligned to {HOST_ALIGN_BYTES}")
        self.pinned = False
        if pin:
            rc = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), num_bytes, 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister({num_bytes} bytes) failed with code {int(rc)}")
            self.pinned = True

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        # The mmap stays alive as long as views of `tensor` do; dropping our reference is enough.


class Device:
    """One compute device (a CUDA GPU, or the CPU twin) and its stream/event primitives."""

    def __init__(self, kind: DeviceKind | str = DeviceKind.CPU, index: int = 0) -> None:
        self.kind = DeviceKind(kind)
        self.index = index
        if self.kind is DeviceKind.CUDA:
            if not torch.cuda.is_available():
                raise ConfigError("device 'cuda' requested but torch.cuda.is_available() is False")
            self.torch_device = torch.device("cuda", index)
            torch.cuda.init()
            torch.empty(1, device=self.torch_device)  # create the primary context before any driver call
        else:
            self.torch_device = torch.device("cpu")
        self._cu = _driver() if self.kind is DeviceKind.CUDA else None  # None: copies go through torch
        self._cu_streams: dict[int, Any] = {}  # raw stream handle -> the driver's CUstream for it

    @property
    def is_cuda(self) -> bool:
        return self.kind is DeviceKind.CUDA

    def alloc(self, num_bytes: int) -> torch.Tensor:
        """Device memory (HBM on CUDA, plain host memory on the CPU twin)."""
        return torch.empty(num_bytes, dtype=torch.uint8, device=self.torch_device)  # [N]

    def alloc_host(self, num_bytes: int) -> AlignedHostBuffer:
        """Page-aligned host memory, pinned when the device is a GPU."""
        return AlignedHostBuffer(num_bytes, pin=self.is_cuda)

    def bind_thread(self, stream: Any = None) -> None:
        """Make this device current on the calling thread (driver calls from worker threads need it) and,
        given one, `stream` the thread's current stream (its copies then need no stream switch)."""
        if self.is_cuda:
            torch.cuda.set_device(self.torch_device)
            if stream is not None:
                torch.cuda.set_stream(stream)

    def new_stream(self, priority: int = 0) -> Any:
        """A CUDA stream (None on the CPU twin); priority < 0 is scheduled ahead of default streams."""
        return torch.cuda.Stream(device=self.torch_device, priority=priority) if self.is_cuda else None

    def record_event(self, stream: Any = None) -> Event:
        if not self.is_cuda:
            return completed_event()
        ev = torch.cuda.Event()
        ev.record(stream if stream is not None else torch.cuda.current_stream(self.torch_device))
        return ev

    def stream_key(self, stream: Any = None) -> object:
        """A hashable name of `stream` (None: the current one), for books kept per stream; None on the CPU twin
        (its waits block the host, which then is the one stream)."""
        if not self.is_cuda:
            return None
        return (stream if stream is not None else torch.cuda.current_stream(self.torch_device)).cuda_stream

    def stream_wait(self, event: Event, stream: Any = None) -> None:
        """Order `stream` after `event` without blocking the host (CUDA); block the host on the CPU twin."""
        if self.is_cuda and isinstance(event, torch.cuda.Event):
            (stream if stream is not None else torch.cuda.current_stream(self.torch_device)).wait_event(event)
        else:
            event.synchronize()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any = None, stream_is_current: bool = False) -> Event:
        """Copy `src` into `dst` on `stream`; returns the event that marks the copy done. A caller that knows
        `stream` is its thread's current one (a link worker, see `bind_thread`) says so and skips the check."""
        if dst.numel() != src.numel() or dst.dtype != src.dtype:
            raise ConfigError(
                f"copy: shape/dtype mismatch dst={tuple(dst.shape)}/{dst.dtype} src={tuple(src.shape)}/{src.dtype}"
            )
        if not self.is_cuda:
            dst.copy_(src)
            return completed_event()
        if stream_is_current or stream is None or stream == torch.cuda.current_stream(self.torch_device):
            dst.copy_(src, non_blocking=True)  # no stream switch needed
        else:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        return self.record_event(stream)

    def copy_range(self, dst: torch.Tensor, dst_offset_bytes: int, src: torch.Tensor, src_offset_bytes: int,
                   num_bytes: int, stream: Any = None, stream_is_current: bool = False, record: bool = True) -> Event:
        """Copy `num_bytes` from byte `src_offset_bytes` of `src` to byte `dst_offset_bytes` of `dst` (both
        contiguous; the caller checked the ranges). On a GPU with cuda-python this is one driver call by address
        (cuMemcpyAsync, a third of the host time of torch's copy_: bench/results/design_notes.md), no tensor
        views; otherwise byte views and `copy`. record=False (with cuda-python): no event is recorded (one driver
        call less; the caller orders by stream), and a completed one is returned."""
        if self._cu is None:
            return self.copy(byte_range(dst, dst_offset_bytes, num_bytes), byte_range(src, src_offset_bytes,
                             num_bytes), stream, stream_is_current)
        cu = self._cu
        if stream is None:
            stream = torch.cuda.current_stream(self.torch_device)
        raw = stream.cuda_stream
        cu_stream = self._cu_streams.get(raw)
        if cu_stream is None:
            cu_stream = self._cu_streams.setdefault(raw, cu.CUstream(raw))
        err = cu.cuMemcpyAsync(cu.CUdeviceptr(dst.data_ptr() + dst_offset_bytes),
                               cu.CUdeviceptr(src.data_ptr() + src_offset_bytes), num_bytes, cu_stream)[0]
        if err != cu.CUresult.CUDA_SUCCESS:
            raise CudaError(f"cuMemcpyAsync of {num_bytes} bytes failed: {err}")
        return self.record_event(stream) if record else completed_event()

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.torch_device)
