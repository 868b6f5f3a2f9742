"""A plan source whose controller runs in a child process, as a deployed controller runs beside the engine.

Bench driver code. The engine's process keeps a pipe and a child process (`spawn`: the engine's CUDA context is
never forked); the child builds the controller from `factory(config)` (both picklable: a module-level function
and the controller's config) and answers `sync_from`, `step_next` and `record_ack` with the protocol's messages
(controller/protocol.py). The phase runner's live policies plan on the outbox thread of the engine's process
(`InProcessLoop(wait_for_plans=False)`): a controller in that process holds the GIL for its whole solve, which
the engine thread then waits out between its kernel launches; over the pipe the outbox thread waits in a system
call instead. The constructor returns once the child has built the controller (its imports are no window's
delay). An exception the child raises comes back and is raised here (unpicklable ones as RuntimeError
with their type name), so the loop counts it as it would the controller's own; a child that died is reported
with its exit code. `history` (the controller's decisions) is fetched on read, and at `close`, which stops the
child. It must never build a plan itself.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
from collections.abc import Callable
from typing import Any


def _serve(conn: Any, factory: Callable[[Any], Any], config: Any) -> None:
    """The child: build the controller, say so, then answer (name, argument) requests until told to stop."""
    try:
        source = factory(config)
    except BaseException as exc:  # the parent's first request gets it
        source, failed = None, exc
    else:
        failed = None
    conn.send(("ready", None))
    while True:
        try:
            name, arg = conn.recv()
        except EOFError:  # the parent is gone
            return
        if name == "stop":
            conn.send(("ok", None))
            return
        try:
            if failed is not None:
                raise failed
            if name == "history":
                result = list(getattr(source, "history", []))
            else:
                result = getattr(source, name)(*(() if arg is None else (arg,)))
                result = None if name == "sync_from" else result  # the loop ignores it; it need not pickle
            conn.send(("ok", result))
        except BaseException as exc:
            try:
                pickle.dumps(exc)
                conn.send(("err", exc))
            except Exception:
                conn.send(("err", RuntimeError(f"{type(exc).__name__}: {exc}")))


class ProcessPlanSource:
    """A `PlanSource` (agent/closed_loop.py) over a controller in a child process (see the module docstring)."""

    def __init__(self, factory: Callable[[Any], Any], config: Any) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, factory, config), name="tierplan-controller",
                                 daemon=True)
        self._proc.start()
        child.close()
        self._history: list[Any] = []
        self._closed = False
        self.close_error: str | None = None  # why close could not stop the child cleanly (it had died, say)
        try:  # built before the run starts: the controller's imports and set-up are no window's delay
            self._conn.recv()
        except EOFError:
            self._proc.join(timeout=5.0)
            self._closed = True
            raise RuntimeError(f"the controller's process ended while starting (exit code {self._proc.exitcode})") \
                from None

    def _call(self, name: str, arg: Any = None) -> Any:
        if self._closed:
            raise RuntimeError(f"{name}: the controller's process was closed")
        try:
            self._conn.send((name, arg))
            status, value = self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError) as exc:
            self._proc.join(timeout=5.0)
            raise RuntimeError(f"{name}: the controller's process ended (exit code {self._proc.exitcode})") from exc
        if status == "err":
            raise value
        return value

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

    def close(self) -> None:
        """Fetch the history, stop the child and wait for it (killed if it does not stop within 10 s)."""
        if self._closed:
            return
        try:
            _ = self.history
            self._call("stop")
        except Exception as exc:  # a child that died already: kept, with its exit code, for the run's notes
            self.close_error = f"{type(exc).__name__}: {exc}"
        finally:
            self._closed = True
            self._conn.close()
            self._proc.join(timeout=10.0)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()

    def __del__(self) -> None:  # a run that failed before its close: never leave the child behind
        if not getattr(self, "_closed", True):
            self.close()
