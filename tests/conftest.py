"""Shared fixtures for the runtime tests: a seeded random-byte factory and the CPU device twin."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest
import torch

from runtime.device import Device

if not torch.cuda.is_available():
    # Without a GPU, Triton kernels run in Triton's interpreter; it reads this when a kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _few_attention_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a GPU, Triton's interpreter runs every program in Python: fewer context splits per (sequence,
    head) keep the paged-attention tests fast (still several splits, so the reduce is exercised)."""
    if not torch.cuda.is_available():
        import runtime.engine.kernels.paged_attention as pa

        monkeypatch.setattr(pa, "TARGET_PROGRAMS", 8)


@pytest.fixture
def rand() -> Callable[[int], torch.Tensor]:
    """`rand(n)` -> n random uint8 bytes from a per-test seeded generator (never zeros: stale reads show)."""
    gen = torch.Generator().manual_seed(1234)

    def make(n: int) -> torch.Tensor:
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)  # [N]

    return make


@pytest.fixture
def cpu() -> Device:
    return Device("cpu")


class FakeClock:
    """A clock the test moves by hand (`now_s`); pass it as `clock=` wherever a component reads time."""

    def __init__(self, now_s: float = 0.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def host_copy(device: Device, data: torch.Tensor) -> torch.Tensor:
    """`data` copied into fresh page-aligned host memory (what O_DIRECT needs)."""
    buf = device.alloc_host(data.numel()).tensor  # [N]
    buf.copy_(data)
    return buf


def wait_until(pred: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition") -> None:
    """Poll `pred` until true; fail (never hang) after `timeout_s`. Used for ordering, not for timing."""
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        time.sleep(0.001)


def start_thread(target: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    """Run `target` in a daemon thread; exceptions land in the returned list instead of vanishing."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, errors
