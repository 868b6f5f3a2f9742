"""Every bench test leaves no controller process behind (bench/baselines/plan_process.py): a child still running
once the test's garbage is collected (a source held past its run, never closed) fails the test that started it,
and is killed. A source dropped unclosed is stopped by its `__del__`: the runs close theirs explicitly."""

from __future__ import annotations

import gc
import multiprocessing as mp
from collections.abc import Iterator

import pytest


def controllers_running() -> list[mp.Process]:
    """The controller processes (plan_process.py names them) this test process still runs."""
    return [p for p in mp.active_children() if p.name == "tierplan-controller"]


@pytest.fixture(autouse=True)
def no_controller_left() -> Iterator[None]:
    yield
    gc.collect()
    left = controllers_running()
    for p in left:
        p.kill()
        p.join()
    assert not left, f"{len(left)} controller process(es) left running by this test"
