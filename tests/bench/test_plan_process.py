"""The live baselines' controller in a child process (bench/baselines/plan_process.py): the protocol's calls go
over a pipe, the child's errors come back as themselves, a child that dies is reported with its exit code, and
close leaves no process behind. The phase runner's path with the real controller: tests/bench/
test_baselines_measure.py (the live baselines plan in a child by default)."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from tierplan.bench.baselines.plan_process import ProcessPlanSource
from tierplan.bench.baselines.tierplan_live import TierplanLive


def test_the_childs_errors_come_back_as_themselves_and_close_leaves_nothing() -> None:
    src = ProcessPlanSource(dict, {"a": 1})  # a "controller" without the protocol's methods
    try:
        with pytest.raises(AttributeError, match="sync_from"):
            src.sync_from(None)
        assert src.history == []  # the child is still there after an error
    finally:
        src.close()
    src.close()  # twice is fine
    assert not mp.active_children()
    with pytest.raises(RuntimeError, match="closed"):
        src.step_next()


def test_a_controller_that_cannot_be_built_fails_its_first_call() -> None:
    src = ProcessPlanSource(int, "not a number")
    try:
        with pytest.raises(ValueError, match="invalid literal"):
            src.step_next()
    finally:
        src.close()


def test_a_child_that_dies_is_reported_with_its_exit_code() -> None:
    with pytest.raises(RuntimeError, match=r"ended while starting \(exit code 3\)"):
        ProcessPlanSource(os._exit, 3)
    assert not mp.active_children()


def test_the_planner_is_named_or_refused() -> None:
    assert TierplanLive().planner == "process" and TierplanLive(planner="thread").planner == "thread"
    with pytest.raises(ValueError, match="planner must be one of process, thread, got 'gpu'"):
        TierplanLive(planner="gpu")


def test_the_controller_is_built_before_the_constructor_returns(tmp_path) -> None:
    """The child's start-up (imports, the controller's set-up) is over before the run starts, never inside its
    first window: the factory has run once the constructor returns."""
    made = tmp_path / "built"
    src = ProcessPlanSource(os.mkdir, str(made))
    try:
        assert made.is_dir()
    finally:
        src.close()
