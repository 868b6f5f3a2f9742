"""A plan source whose controller runs in a child process, as a deployed controller runs beside the engine.

Bench driver code. The engine's process keeps a pipe and a child process (`spawn`: the engine's CUDA context is
never forked); the child builds the controller from `factory(config)` (both picklable: a module-level function
and the controller's config) and answers `sync_from`, `step_next` and `record_ack` with the protocol's messages
(controller/protocol.py). The phase runner's live policies plan on the outbox thread of the engine's process
(`InProcessLoop(wait_for_plans=False)`): a controller in that process holds the GIL for its whole solve, which
the engine thread then waits out between its kernel launches; over the pipe the outbox thread waits in a system
call instead. The protocol's messages cross the pipe as their JSON (`_pack`): pickling a window's pydantic objects
took 20-60 ms a window with thousands of cross-layer pairs, on the outbox thread and under the GIL, where
pydantic-core writes the JSON in 2-5 ms; the child validates it whole, as any process boundary of the protocol
does. The constructor returns once the child has built the controller (its imports are no window's delay).
The child yields the CPU to the engine: it runs at a lower priority (CHILD_NICE) and, given `cores`, on that
many of the engine's CPUs only (H100 phase runs 69-73: a live planner's solves kept 2-4 cores busy, in bursts of
up to 16 threads, and the engine's decode forward was 1-5 ms slower at the steps they fell on;
bench/results/phase_h200.md, session 38).
Calls are serialised (one lock: a reply never goes to another thread's call).

Nothing is lost silently: an exception the child raises comes back and is raised here as itself, or, if it does
not survive pickling, as a ValueError (a ValueError's kind: the loop counts refused telemetry by it) or a
RuntimeError naming its type; a call that gets no answer within `timeout_s` kills the child and raises
TimeoutError; a child that died is reported with its exit code; `close` returns why it could not stop the child
cleanly (None when it did). `host_spans` keeps when this side worked on each call and `solve_spans` when the
child did, with its CPU time (the phase runner lays them over its steps: `StepRecord.outbox_ms`, `planner_ms`,
`planner_cpu_ms`). The child stops by itself once its parent is gone. `history` (the controller's decisions) is
fetched on read, and at `close`. It must never build a plan itself.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

PARENT_CHECK_S = 2.0  # how often an idle child looks whether its parent is still there
CHILD_NICE = 5  # the child's priority below the engine's: where both want a core, the engine's thread gets it


# The CPUs this process had before `engine_confined` gave a planner's share up; () outside it. `cpu_share` cuts the
# planner's CPUs from these, not from the engine's rest, so the two never overlap.
_MACHINE_CPUS: tuple[int, ...] = ()


def _machine_cpus() -> list[int]:
    """The CPUs the planner's and the engine's shares are cut from (sorted; needs `os.sched_getaffinity`)."""
    return sorted(_MACHINE_CPUS or os.sched_getaffinity(0))


def cpu_share(cores: int) -> tuple[int, ...]:
    """The CPUs a child confined to `cores` of them runs on: the last `cores` of those this process may use (all of
    them for `cores` <= 0 or at least their number; () where the platform cannot tell, as on macOS)."""
    if not hasattr(os, "sched_getaffinity"):
        return ()
    allowed = _machine_cpus()
    return tuple(allowed[-cores:]) if 0 < cores < len(allowed) else tuple(allowed)


def engine_share(cores: int) -> tuple[int, ...]:
    """The CPUs the engine's process keeps beside a child confined to `cpu_share(cores)`: the others, or () where
    none is left (the child then runs on every CPU) or the platform cannot tell."""
    if not hasattr(os, "sched_getaffinity"):
        return ()
    child = set(cpu_share(cores))
    rest = tuple(c for c in _machine_cpus() if c not in child)
    return rest if child and rest else ()


@contextlib.contextmanager
def engine_confined(cores: int) -> Iterator[tuple[int, ...]]:
    """For the block, every thread of this process on `engine_share(cores)` (threads started inside inherit it),
    so a live planner's child on `cpu_share(cores)` never takes a core the engine's threads run on; yields those
    CPUs (() where the engine keeps them all: too few CPUs, no affinity, the system refused, or already
    confined). After the block every thread of the process runs on the CPUs it had. Why: session 38 confined the
    planner and left the engine anywhere; at H100 b32 16K 56 GiB (runs 69-83) a decode step's host time was
    4.4-6.7 ms while tierplan's planner worked on its 4 CPUs and 1.8-3.9 ms while it idled, the same context."""
    global _MACHINE_CPUS
    cpus = engine_share(cores)
    if not cpus or _MACHINE_CPUS:
        yield ()
        return
    machine = tuple(_machine_cpus())
    try:
        _each(_threads(), os.sched_setaffinity, cpus)
    except OSError:
        _each(_threads(), os.sched_setaffinity, machine)
        yield ()
        return
    _MACHINE_CPUS = machine
    try:
        yield cpus
    finally:
        _MACHINE_CPUS = ()
        _each(_threads(), os.sched_setaffinity, machine)


def _confine(cpus: tuple[int, ...]) -> tuple[tuple[int, ...], str | None]:
    """The child, before it builds the controller: run on `cpus` only, at CHILD_NICE; the CPUs it got, and why
    not `cpus` where the system refused them (it then runs on all it had). Every thread is set, those started
    before this call too (`_threads`: until session 40 only the calling one was, and numpy's BLAS pool, one thread
    per CPU of the machine, ran anywhere at the engine's priority); the thread pools started later (the demand
    model's curves: controller/demand.py sizes its pool by these CPUs) inherit the calling thread's."""
    why = None
    tids = _threads()
    if cpus and hasattr(os, "sched_setaffinity"):
        had = os.sched_getaffinity(0)
        try:
            _each(tids, os.sched_setaffinity, cpus)
        except OSError as exc:
            why = f"CPUs {list(cpus)} refused: {exc}"
            _each(tids, os.sched_setaffinity, had)  # one rule for every thread: all back where they were
    if (blas := _one_blas_thread()) is not None:
        why = f"{why}; {blas}" if why else blas
    if hasattr(os, "setpriority"):
        _each(tids, lambda tid, nice: os.setpriority(os.PRIO_PROCESS, tid, nice),
              min(19, os.getpriority(os.PRIO_PROCESS, 0) + CHILD_NICE))
    else:
        os.nice(CHILD_NICE)
    return (tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()), why


def _one_blas_thread() -> str | None:
    """numpy's BLAS on one thread in this process; why not, where it could not be set (None: it was). The
    planner's products are small (a curve's [C] @ [C, E + 1]), and OpenBLAS's pool spins after each call before
    it sleeps: here, after three 300 x 300 products, 0.10 s of CPU in the next idle 0.5 s on one worker; a
    16-CPU host has 15 of them, every one at the engine's priority until `_confine` set each thread. (Suspected
    for tierplan's slow prefills at H100 b256 4K 56 GiB, runs 74-75; runs 78-79 showed those were the first run's
    place at the point, with this change in: bench/phase_grid.py `warmup_policies`.)"""
    # A BLAS library loaded later (scipy's, at the controller's first use of it) reads its thread count from the
    # environment as it loads; those loaded already are set through threadpoolctl.
    os.environ["OPENBLAS_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return "threadpoolctl missing: numpy's BLAS keeps its threads"
    threadpool_limits(limits=1, user_api="blas")
    return None


def _each(tids: list[int], call: Callable[[int, Any], Any], value: Any) -> None:
    """`call(tid, value)` for every thread in `tids`, skipping one that ended meanwhile."""
    for tid in tids:
        try:
            call(tid, value)
        except ProcessLookupError:
            continue


def _threads() -> list[int]:
    """This process's threads (Linux: /proc/self/task), the calling one first; [0] (the calling thread) where the
    platform cannot list them. Linux keeps a CPU mask and a niceness per thread, and a thread started before
    `_confine` (numpy's BLAS pool starts at import, and spawn imports the factory's module to unpickle it before
    `_serve` runs: one thread per CPU) keeps the whole machine at the engine's priority unless each is set."""
    try:
        others = sorted(int(t) for t in os.listdir("/proc/self/task") if int(t) != threading.get_native_id())
    except (OSError, ValueError):
        return [0]
    return [0, *others]


def portable(exc: BaseException) -> BaseException:
    """`exc` if it survives a pickle round trip (what the pipe does), else a stand-in of the same broad kind."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        kind = ValueError if isinstance(exc, ValueError) else RuntimeError
        return kind(f"{type(exc).__name__}: {exc}")


class _Json(NamedTuple):
    """A message of controller/protocol.py on the pipe: its class name and its JSON."""

    kind: str
    text: str


def _pack(value: Any) -> Any:
    """A protocol message as `_Json`, anything else as it is (pickled by the pipe)."""
    from pydantic import BaseModel

    from tierplan.controller import protocol

    if isinstance(value, BaseModel) and getattr(protocol, type(value).__name__, None) is type(value):
        return _Json(type(value).__name__, value.model_dump_json())
    return value


def _unpack(value: Any) -> Any:
    """The message a `_Json` carries, validated (a ValueError if it is not valid); anything else as it is."""
    if isinstance(value, _Json):
        from tierplan.controller import protocol

        return getattr(protocol, value.kind).model_validate_json(value.text)
    return value


def _serve(conn: Any, factory: Callable[[Any], Any], config: Any, parent_pid: int,
           cpus: tuple[int, ...] = ()) -> None:
    """The child: confine itself to `cpus` (`_confine`), build the controller, say so with the CPUs it runs on,
    then answer (name, arguments) requests until told to stop or its parent is gone."""
    got, why = _confine(cpus)
    try:
        source = factory(config)
    except BaseException as exc:  # every request gets it: never a ValueError (that would read as refused telemetry)
        source, failed = None, RuntimeError(f"building the controller failed: {type(exc).__name__}: {exc}")
    else:
        failed = None
    conn.send(("ready", (got, why)))
    while True:
        try:
            if not conn.poll(PARENT_CHECK_S):
                if os.getppid() != parent_pid:  # orphaned (the parent was killed): nobody will ask again
                    return
                continue
            name, args = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if name == "stop":
            conn.send(("ok", None))
            return
        cpu0 = time.process_time()  # every thread of this process: how many cores the call kept busy
        try:
            if failed is not None:
                raise failed
            if name == "history":
                result = list(getattr(source, "history", []))
            else:
                result = getattr(source, name)(*(_unpack(a) for a in args))
                result = None if name == "sync_from" else result  # the loop ignores it; it need not pickle
            reply = ("ok", _pack(result))
        except BaseException as exc:
            reply = ("err", portable(exc))
        conn.send((*reply, time.process_time() - cpu0))


class ProcessPlanSource:
    """A `PlanSource` (agent/closed_loop.py) over a controller in a child process (see the module docstring)."""

    def __init__(self, factory: Callable[[Any], Any], config: Any, timeout_s: float = 120.0, cores: int = 0) -> None:
        """cores: how many of this process's CPUs the child may run on (`cpu_share`; 0: all of them); it runs at
        CHILD_NICE either way. `cpus` tells which it got, `confine_error` why not those asked for (None: they were
        granted)."""
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.cpus: tuple[int, ...] = ()
        self.confine_error: str | None = None
        self._proc = ctx.Process(target=_serve, args=(child, factory, config, os.getpid(), cpu_share(cores)),
                                 name="tierplan-controller", daemon=True)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._history: list[Any] = []
        self._stats: dict[str, Any] | None = None
        self._closed = True  # until the child has answered: a failed start leaves nothing for close to do
        self._stopped_why: str | None = None  # why the child was killed (a call with no answer), for close
        # (start, end) perf_counter of this side's work per call, the wait for the child left out: packing and
        # sending, receiving and validating (pydantic-core holds the GIL throughout, beside the engine thread).
        self.host_spans: deque[tuple[float, float]] = deque(maxlen=8192)
        # (sent, answered, child CPU s) per call: the child's work from the request's send to its reply, and the
        # CPU time its threads spent on it (over the wall: the cores it kept busy beside the engine).
        self.solve_spans: deque[tuple[float, float, float]] = deque(maxlen=8192)
        try:
            self._proc.start()
        except BaseException:  # e.g. a factory that does not pickle: nothing runs, nothing is left open
            child.close()
            self._conn.close()
            raise
        child.close()
        try:  # built before the run starts: the controller's imports and set-up are no window's delay
            got, self.confine_error = self._answer("start")
            self.cpus = tuple(got)
        except BaseException:
            self._stop(kill=True)
            raise
        self._closed = False

    def _answer(self, name: str, sent_s: float | None = None) -> Any:
        """The child's reply to the request just sent at `sent_s` (under the lock): its value, or its error raised."""
        if not self._conn.poll(self.timeout_s):
            self._stop(kill=True)
            self._stopped_why = f"{name}: no answer within {self.timeout_s:g} s (killed)"
            raise TimeoutError(f"{name}: the controller's process gave no answer within {self.timeout_s:g} s "
                               "(killed)")
        t0 = time.perf_counter()
        try:
            try:
                status, value, *cpu_s = self._conn.recv()  # a call's reply carries the child's CPU time
            except (EOFError, OSError) as exc:
                self._proc.join(timeout=5.0)
                raise RuntimeError(f"{name}: the controller's process ended (exit code {self._proc.exitcode})") from exc
            if sent_s is not None and cpu_s:
                self.solve_spans.append((sent_s, t0, float(cpu_s[0])))
            if status == "err":
                raise value
            return _unpack(value)
        finally:
            self.host_spans.append((t0, time.perf_counter()))

    def _call(self, name: str, *args: Any) -> Any:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{name}: the controller's process was closed")
            t0 = time.perf_counter()
            try:
                self._conn.send((name, tuple(_pack(a) for a in args)))
                sent_s = time.perf_counter()
                self.host_spans.append((t0, sent_s))
            except (BrokenPipeError, ConnectionResetError, OSError) as exc:
                self._proc.join(timeout=5.0)
                raise RuntimeError(f"{name}: the controller's process ended (exit code "
                                   f"{self._proc.exitcode})") from exc
            return self._answer(name, sent_s)

    def sync_from(self, telemetry: Any) -> None:
        self._call("sync_from", telemetry)

    def step_next(self) -> Any:
        return self._call("step_next")

    def record_ack(self, ack: Any) -> None:
        self._call("record_ack", ack)

    @property
    def history(self) -> list[Any]:
        """The controller's decisions so far (those it had when closed, once closed)."""
        if not self._closed and self._proc.is_alive():
            self._history = self._call("history")
        return list(self._history)

    @property
    def controller_stats(self) -> dict[str, Any] | None:
        """The controller's `stats()` (those it had when closed, once closed); None where it has none."""
        if not self._closed and self._proc.is_alive():
            try:
                self._stats = self._call("stats")
            except (AttributeError, TypeError):  # a controller without stats() (the child said so): none
                self._stats = None
        return None if self._stats is None else dict(self._stats)

    def _stop(self, kill: bool = False) -> None:
        self._closed = True
        self._conn.close()
        if not kill:
            self._proc.join(timeout=10.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()

    def close(self) -> str | None:
        """Fetch the history and stats, stop the child and wait for it (killed if it does not stop within 10 s). Returns
        why it could not do so cleanly (the child had died, or was killed for a call with no answer), None when it
        did; that reason is returned once."""
        if self._closed:
            why, self._stopped_why = self._stopped_why, None
            return why
        error = None
        try:
            _ = self.history
            _ = self.controller_stats
            self._call("stop")
        except Exception as exc:  # the child died or hung: what is left to report
            error = f"{type(exc).__name__}: {exc}"
        finally:
            if not self._closed:
                self._stop()
        return error

    def __del__(self) -> None:  # a run that failed before its close: never leave the child behind
        if not getattr(self, "_closed", True):
            self.close()
