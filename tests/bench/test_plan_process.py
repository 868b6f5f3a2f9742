"""The live baselines' controller in a child process (bench/baselines/plan_process.py): the protocol's calls go
over a pipe, the child's errors come back as themselves, a child that dies is reported with its exit code, and
close leaves no process behind. The phase runner's path with the real controller: tests/bench/
test_baselines_measure.py (the live baselines plan in a child by default)."""

from __future__ import annotations

import os

import pytest

from tests.bench.conftest import controllers_running
from tierplan.bench.baselines.plan_process import ProcessPlanSource, portable
from tierplan.bench.baselines.tierplan_live import TierplanLive


def test_the_childs_errors_come_back_as_themselves_and_close_leaves_nothing() -> None:
    src = ProcessPlanSource(dict, {"a": 1})  # a "controller" without the protocol's methods
    try:
        with pytest.raises(AttributeError, match="sync_from"):
            src.sync_from(None)
        assert src.history == []  # the child is still there after an error
        assert src.controller_stats is None  # no stats() there: none, and no error
    finally:
        assert src.close() is None
    src.close()  # twice is fine
    assert not controllers_running()
    with pytest.raises(RuntimeError, match="closed"):
        src.step_next()


class _Counting(dict):
    """A "controller" with the counters a real one reports (`Controller.stats`)."""

    def stats(self) -> dict[str, int]:
        return {"windows_quiet": len(self)}


def test_the_controllers_stats_come_back_and_are_kept_once_closed() -> None:
    src = ProcessPlanSource(_Counting, {"a": 1, "b": 2})
    try:
        assert src.controller_stats == {"windows_quiet": 2}
    finally:
        assert src.close() is None
    assert src.controller_stats == {"windows_quiet": 2}  # what it had when closed
    assert not controllers_running()


def test_a_controller_that_cannot_be_built_fails_its_first_call() -> None:
    src = ProcessPlanSource(int, "not a number")
    try:  # a RuntimeError every call, never a ValueError (the loop would count it as refused telemetry)
        with pytest.raises(RuntimeError, match="building the controller failed: ValueError: invalid literal"):
            src.step_next()
        with pytest.raises(RuntimeError, match="building the controller failed"):
            src.sync_from(None)
    finally:
        src.close()


def test_a_child_that_dies_is_reported_with_its_exit_code() -> None:
    with pytest.raises(RuntimeError, match=r"start: the controller's process ended \(exit code 3\)"):
        ProcessPlanSource(os._exit, 3)
    assert not controllers_running()


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


class _Refused(ValueError):
    """A ValueError whose constructor takes more than its message (as the controller's TelemetryRejected): it
    pickles but does not unpickle."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")


def test_an_error_that_does_not_unpickle_keeps_its_kind() -> None:
    """The loop counts refused telemetry by ValueError: a stand-in must stay one, and name the original."""
    err = portable(_Refused("malformed", "stale window"))
    assert type(err) is ValueError and str(err) == "_Refused: malformed: stale window"
    assert type(portable(KeyError("x"))) is KeyError  # one that survives the pipe comes back as itself
    assert type(portable(_Unpicklable())) is RuntimeError


class _Unpicklable(Exception):
    def __reduce__(self):  # type: ignore[override]
        raise TypeError("no")


class _Stub:
    """A controller stand-in built in the child (this module is importable there: spawn passes sys.path)."""

    def __init__(self, how: str) -> None:
        self.how = how

    def sync_from(self, telemetry: object) -> None:
        if self.how == "hang":
            import time

            time.sleep(3600)
        raise _Refused("malformed", "stale window")


def test_a_refusal_that_does_not_unpickle_still_arrives_as_a_value_error() -> None:
    src = ProcessPlanSource(_Stub, "refuse")
    try:
        with pytest.raises(ValueError, match="_Refused: malformed: stale window"):
            src.sync_from(None)
    finally:
        assert src.close() is None


def test_a_call_with_no_answer_times_out_and_the_child_is_killed() -> None:
    src = ProcessPlanSource(_Stub, "hang")
    src.timeout_s = 1.0  # after the start: a loaded box may take longer than that to spawn the child
    with pytest.raises(TimeoutError, match="no answer within 1 s"):
        src.sync_from(None)
    assert not controllers_running()
    with pytest.raises(RuntimeError, match="closed"):
        src.step_next()
    assert src.close() == "sync_from: no answer within 1 s (killed)"  # the run's planner errors count it
    assert src.close() is None


def test_concurrent_calls_each_get_their_own_reply() -> None:
    """Calls from two threads (the loop's outbox and a closing run) are serialised: no reply is swapped."""
    import threading

    src = ProcessPlanSource(dict, {})
    errors: list[BaseException] = []

    def hammer() -> None:
        try:
            for _ in range(200):
                assert src.history == []
                with pytest.raises(AttributeError):
                    src.step_next()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=hammer) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    src.close()
    assert errors == []
    # this side's work on each call, a refused one too: the send, then the reply's receipt
    assert len(src.host_spans) >= 3 * 200 * 2 * 2 and all(a <= b for a, b in src.host_spans)
    assert len(src.solve_spans) >= 3 * 200 * 2 and all(a <= b and cpu >= 0 for a, b, cpu in src.solve_spans)


def test_a_factory_that_does_not_pickle_fails_at_once_and_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """No child starts, and the half-built source has nothing to close: its `__del__` must not call `close`, which
    would wait the whole timeout for an answer from a child that never ran."""
    import gc

    closes: list[object] = []
    monkeypatch.setattr(ProcessPlanSource, "close", lambda self: closes.append(self))
    with pytest.raises(Exception, match="pickle"):
        ProcessPlanSource(lambda c: c, None, timeout_s=3600)
    gc.collect()
    assert closes == [] and not controllers_running()


class _Echo:
    """Keeps what it is sent: the child's view of a message (built in the child, as `_Stub`)."""

    def __init__(self, _: object) -> None:
        self.seen: list[object] = []

    def sync_from(self, telemetry: object) -> None:
        self.seen.append(telemetry)

    def step_next(self) -> object:
        return self.seen[-1]


def test_protocol_messages_cross_as_json_and_are_validated_in_the_child() -> None:
    """A Telemetry goes over the pipe as its JSON and arrives equal (validated there); one whose parts were made
    without validation and break a rule is refused by the child with the rule, as a ValueError (the loop counts
    it as refused telemetry)."""
    from tests.controller.test_protocol_predictor import telemetry_v2
    from tierplan.bench.baselines.plan_process import _Json, _pack
    from tierplan.controller.protocol import LayerUnions, Telemetry

    tel = Telemetry.model_validate(telemetry_v2())
    assert isinstance(_pack(tel), _Json) and _pack({"a": 1}) == {"a": 1}
    src = ProcessPlanSource(_Echo, None)
    try:
        src.sync_from(tel)
        back = src.step_next()
        assert type(back) is Telemetry and back == tel
        bad = tel.model_copy(update={"step_unions": (LayerUnions.model_construct(
            layer=0, batch_tokens=(1,), unions=((2, 2),)),)})
        with pytest.raises(ValueError, match="repeats"):
            src.sync_from(bad)
    finally:
        assert src.close() is None


class _Probe:
    """A "controller" that answers step_next with where its process runs: CPUs, niceness, the demand model's
    thread count."""

    def __init__(self, config: object) -> None:
        pass

    def step_next(self) -> tuple[list[int], int, int]:
        from tierplan.controller.demand import _usable_cpus

        return sorted(os.sched_getaffinity(0)), os.nice(0), _usable_cpus()

    def blas_threads(self) -> list[int]:
        import numpy  # noqa: F401  (threadpoolctl lists the BLAS libraries loaded)
        from threadpoolctl import threadpool_info

        return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]

    def threads(self) -> dict[int, tuple[list[int], int]]:
        """Every thread of the process: its CPUs and niceness (Linux keeps both per thread)."""
        return {int(t): (sorted(os.sched_getaffinity(int(t))), os.getpriority(os.PRIO_PROCESS, int(t)))
                for t in os.listdir("/proc/self/task")}


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux's")
def test_the_child_runs_confined_to_its_cpus_below_the_engines_priority() -> None:
    from tierplan.bench.baselines.plan_process import CHILD_NICE, cpu_share

    allowed = sorted(os.sched_getaffinity(0))
    assert cpu_share(0) == tuple(allowed) == cpu_share(len(allowed) + 3)  # 0 or more than there are: all
    assert cpu_share(1) == (allowed[-1],)
    mine = os.nice(0)
    for cores, want in ((1, [allowed[-1]]), (0, allowed)):
        src = ProcessPlanSource(_Probe, None, cores=cores)
        try:
            assert src.cpus == tuple(want) and src.confine_error is None
            cpus, nice, threads = src.step_next()
            assert cpus == want and threads == len(want)
            assert nice == min(19, mine + CHILD_NICE)  # the engine's thread wins a contended core
            # numpy's BLAS pool starts its threads at import, before the child confines itself (spawn imports the
            # factory's module to unpickle it): every thread is confined, not the calling one only
            threads = src._call("threads")
            assert len(threads) > 1 and all(v == (want, nice) for v in threads.values()), threads
            assert set(src._call("blas_threads")) == {1}  # its small products never wake a pool that spins after them
        finally:
            assert src.close() is None
    assert os.nice(0) == mine and sorted(os.sched_getaffinity(0)) == allowed  # the engine's process is untouched


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="CPU affinity is Linux's, and the engine keeps a CPU of its own only beside another")
def test_the_engines_threads_leave_the_planners_cpus_and_get_them_back() -> None:
    """`engine_confined`: every thread of the engine's process, those running before too, on the CPUs the planner's
    child does not get; the child still gets its share of the machine (not of the engine's rest); after, every
    thread runs where it did."""
    import threading

    from tierplan.bench.baselines.plan_process import cpu_share, engine_confined, engine_share

    allowed = sorted(os.sched_getaffinity(0))
    stop = threading.Event()
    before = threading.Thread(target=stop.wait, daemon=True)  # a pool thread started before the sweep
    before.start()

    def masks() -> dict[int, list[int]]:
        return {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}

    try:
        assert engine_share(0) == () == engine_share(len(allowed))  # the planner on every CPU: the engine keeps all
        with engine_confined(1) as cpus:
            assert cpus == tuple(allowed[:-1]) == engine_share(1)
            assert all(m == allowed[:-1] for m in masks().values()), masks()
            assert cpu_share(1) == (allowed[-1],)  # cut from the machine, not from the engine's rest
            src = ProcessPlanSource(_Probe, None, cores=1)
            try:
                assert src.step_next()[0] == [allowed[-1]]
            finally:
                assert src.close() is None
            with engine_confined(1) as again:  # nested: nothing more to give up
                assert again == ()
        assert all(m == allowed for m in masks().values()), masks()
        with engine_confined(0) as cpus:
            assert cpus == () and all(m == allowed for m in masks().values())
    finally:
        stop.set()
        before.join()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux's")
def test_cpus_the_system_refuses_leave_the_child_running_on_all_and_say_why(monkeypatch) -> None:
    from tierplan.bench.baselines import plan_process

    monkeypatch.setattr(plan_process, "cpu_share", lambda cores: (10**6,))  # no such CPU
    src = ProcessPlanSource(_Probe, None, cores=1)
    try:
        assert src.confine_error is not None and "CPUs [1000000] refused" in src.confine_error
        assert sorted(src.step_next()[0]) == sorted(os.sched_getaffinity(0)) == list(src.cpus)
    finally:
        assert src.close() is None


def test_the_planner_cores_are_the_sweeps_unless_given_and_bad_ones_are_refused() -> None:
    from tierplan.bench.phase import sweep_grid

    assert sweep_grid(quick=True)[0].planner_cores == 4
    assert sweep_grid(quick=True, planner_cores=0)[0].planner_cores == 0
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="--planner-cores must be an integer >= 0"):
            sweep_grid(quick=True, planner_cores=bad)


def test_cpu_ranges_read_as_a_person_writes_them() -> None:
    from tierplan.bench.baselines.tierplan_live import _ranges

    assert _ranges((12, 13, 14, 15)) == "12-15" and _ranges((0, 2, 3, 7)) == "0,2-3,7" and _ranges((5,)) == "5"
