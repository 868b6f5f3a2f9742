"""A multi-hop operation's completion (inference process): set once by the last hop's callback.

It must never be completed twice, and never swallow the error it carries.
"""

from __future__ import annotations

import threading


class OpFuture:
    """Done exactly once, with or without an error; `wait()` re-raises the error."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.error: BaseException | None = None
        self._done = threading.Event()

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
