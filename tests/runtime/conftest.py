"""Fixtures and helpers of the runtime's tests: for the transfer engine (test_transfer*.py) a CPU engine with 2 MiB
chunks, with finished chunks retired inline or on the retire thread, and gates that hold a link's worker; the
mixed-dtype expert format of the store and loader tests; and for the slot pool (test_slots*.py) pools on the memfd
twin with the helpers that check a refusal changed nothing."""
from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tierplan.runtime.device import Device, HostEvent
from tierplan.runtime.memory.backend import LiveCounts
from tierplan.runtime.memory.host import HostBackend
from tierplan.runtime.memory.slots import POISON_BYTE, ExpertSlotPool, ExpertState
from tierplan.runtime.nvme import align_up
from tierplan.runtime.transfer import (
    ClassStats,
    Link,
    LinkStats,
    TrafficClass,
    TransferEngine,
    TransferRequest,
)
from tierplan.runtime.weights.format import ExpertFormat

MiB = 1 << 20
CHUNK = 2 * MiB
T = 10.0  # bound on every wait: a hang fails the test instead of freezing the suite
# An expert of every dtype a store must move byte-exactly: bf16, fp8, packed fp4 bytes, fp32 scales.
MIXED = ExpertFormat.from_shapes(
    [("w_bf16", (24, 40), "bfloat16"), ("w_fp8", (40, 24), "float8_e4m3fn"), ("w_fp4_packed", (24, 20), "uint8"),
     ("scale", (3,), "float32")]
)


@pytest.fixture(params=[False, True], ids=["inline-retire", "retire-thread"])
def retire_thread(request: pytest.FixtureRequest) -> bool:
    """Finished chunks accounted on the link's worker, or in order on the link's retire thread."""
    return request.param


@pytest.fixture
def engine(cpu: Device, retire_thread: bool) -> Iterator[TransferEngine]:
    eng = TransferEngine(cpu, chunk_bytes=CHUNK, retire_thread=retire_thread)
    yield eng
    eng.close()


@pytest.fixture
def gate(engine: TransferEngine) -> Iterator[Callable[[], HostEvent]]:
    """Unsignalled events that hold a worker; all set at teardown (before the engine closes), so no hang."""
    made: list[HostEvent] = []

    def make() -> HostEvent:
        made.append(HostEvent())
        return made[-1]

    yield make
    for ev in made:
        ev.set()


def class_stats(eng: TransferEngine, tc: TrafficClass) -> ClassStats:
    return ClassStats(**eng.stats()["classes"][tc.value])


def link_stats(eng: TransferEngine, link: Link) -> LinkStats:
    return LinkStats(**eng.stats()["links"][link.value])


def req(link: Link, src, dst, **kw) -> TransferRequest:
    return TransferRequest(link, kw.pop("traffic", TrafficClass.EXPERT), src, dst, **kw)


def fail_copy_at(monkeypatch: pytest.MonkeyPatch, device: Any, n: int, error: BaseException) -> list[int]:
    """Make `device.copy_range`'s n-th call (1-based) raise `error`, the others copy; the list of calls made."""
    real, calls = device.copy_range, []

    def copy_range(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == n:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(device, "copy_range", copy_range)
    return calls


# ---- slot pool (test_slots*.py) ---------------------------------------------------------------------
L, E, EB, S = 2, 6, 5000, 4  # layers, experts per layer, expert bytes (not a page multiple), slots
STRIDE = align_up(EB, mmap.PAGESIZE)
ALL = [(layer, e) for layer in range(L) for e in range(E)]
ABSENT, LOADING, RESIDENT, EVICTING = (ExpertState.ABSENT, ExpertState.LOADING, ExpertState.RESIDENT,
                                       ExpertState.EVICTING)


class Env:
    def __init__(self, device: Device) -> None:
        self.device = device
        self.pools: list[ExpertSlotPool] = []
        self.events: list[HostEvent] = []

    def pool(self, **kw) -> ExpertSlotPool:
        # The invariant tests read absent ranges, which fault on the CPU twin unless poisoned: poison unless told.
        kw.setdefault("poison_unmapped", True)
        self.pools.append(ExpertSlotPool(HostBackend(), self.device, L, E, EB, S, **kw))
        return self.pools[-1]

    def event(self) -> HostEvent:
        self.events.append(HostEvent())
        return self.events[-1]


@pytest.fixture
def env(cpu):
    en = Env(cpu)
    yield en
    for ev in en.events:  # unblock anything a failed test left waiting, then close
        ev.set()
    for p in en.pools:
        p.close()
        assert p.backend.live() == LiveCounts(0, 0, 0)


@pytest.fixture
def pool(env) -> ExpertSlotPool:
    return env.pool()


def load(pool: ExpertSlotPool, layer: int, e: int, data: torch.Tensor, event=None) -> None:
    pool.prepare_load(layer, e).copy_(data)
    pool.complete_load(layer, e, True, event)


def snapshot(pool: ExpertSlotPool) -> tuple:
    return (tuple((pool.state(*k), pool.slot_of(*k), pool.is_pinned(*k)) for k in ALL), pool.num_free_slots,
            pool.remaps)


def refused(pool: ExpertSlotPool, exc: type[BaseException], call) -> None:
    before = snapshot(pool)
    with pytest.raises(exc):
        call()
    assert snapshot(pool) == before, f"refused call changed state ({exc.__name__})"
    pool.check_invariants()


def stride_view(pool: ExpertSlotPool, layer: int, e: int) -> torch.Tensor:
    return pool.layer_tensor(layer)[e * STRIDE : (e + 1) * STRIDE]  # [STRIDE], read without the checked API


def is_poison(t: torch.Tensor) -> bool:
    return bool((t == POISON_BYTE).all())
