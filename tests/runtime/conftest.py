"""Fixtures and helpers of the transfer engine's tests (test_transfer*.py): a CPU engine with 2 MiB chunks, with
finished chunks retired inline or on the retire thread, and gates that hold a link's worker; and the mixed-dtype
expert format of the store and loader tests."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from runtime.device import Device, HostEvent
from runtime.transfer import (
    ClassStats,
    Link,
    LinkStats,
    TrafficClass,
    TransferEngine,
    TransferRequest,
)
from runtime.weights.format import ExpertFormat

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
