"""One-shot completions (inference process): `Latch`, and `OpFuture`, a multi-hop operation's completion set
once by the last hop's callback. An OpFuture must never be completed twice, nor swallow the error it carries.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence


class Latch:
    """A one-shot event: starts unset, `set()` once (later calls do nothing), `wait()` until then. Built on one
    held lock instead of `threading.Event`'s Condition: made and set in well under a microsecond, which matters
    on the load path (three per expert load). Any number of threads may wait."""

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def set(self) -> None:
        if not self._set:
            self._set = True
            _release(self._lock)

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout_s: float | None = None) -> bool:
        """True once set; False if `timeout_s` passed first."""
        if self._set:
            return True
        if not self._lock.acquire(timeout=-1 if timeout_s is None else max(0.0, timeout_s)):
            return self._set
        _release(self._lock)  # hand it on: every other waiter wakes in turn
        return True


def _release(lock: threading.Lock) -> None:
    """Release a latch's lock; a concurrent set() or waiter may have released it already (harmless)."""
    with contextlib.suppress(RuntimeError):
        lock.release()


class OpFuture:
    """Done exactly once, with or without an error; `wait()` re-raises the error."""

    __slots__ = ("_done", "error", "what")

    def __init__(self, what: str) -> None:
        self.what = what
        self.error: BaseException | None = None
        self._done = Latch()

    def set_result(self, error: BaseException | None = None) -> None:
        if self._done.is_set():
            raise RuntimeError(f"{self.what}: completed twice")
        self.error = error
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def ok(self) -> bool:
        return self._done.is_set() and self.error is None

    def wait(self, timeout_s: float | None = None) -> None:
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"{self.what}: not done within {timeout_s} s")
        if self.error is not None:
            raise self.error


def wait_every(futures: Sequence[OpFuture]) -> None:
    """Wait until every future is done, through errors and interrupts (what they move is still in flight and must
    land or fail before the caller goes on), then raise the first interrupt, else the first error in list order.
    The last is waited for first: a list's futures end in order, so the caller wakes about once, not once a
    future taking the GIL from the link's worker."""
    interrupt: BaseException | None = None
    for f in [*futures[-1:], *futures]:
        while not f.done():
            try:
                f.wait()
            except BaseException as exc:
                if not f.done():  # interrupted while waiting: keep it, wait on
                    interrupt = interrupt or exc
    if interrupt is not None:
        raise interrupt
    for f in futures:
        if f.error is not None:
            raise f.error


def wait_all(futures: Sequence[OpFuture], timeout_s: float | None = None) -> None:
    """Wait for every future, then raise the first error in list order. Waits for the last one first: a prefetch
    list's loads complete in list order, so the caller wakes once instead of once per future (each wake-up takes
    the GIL from the link worker while its copies run). `timeout_s` bounds each wait."""
    for f in reversed(futures):
        if not f._done.wait(timeout_s):
            raise TimeoutError(f"{f.what}: not done within {timeout_s} s")
    for f in futures:
        f.wait()
