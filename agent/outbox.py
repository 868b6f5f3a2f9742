"""Builds Telemetry messages from closed windows off the engine thread (inference process, one thread).

The engine thread only snapshots a window (`WindowDraft`: host arrays and values); building it into a
`Telemetry` (per-layer parts checked on the arrays, the message validated: `WindowDraft.build`) happens
here, with a GIL yield after each layer (see `_yield_gil`); `build_spans` keeps when each build ran. Messages
reach `sink` in window order. A window that fails to build is never dropped silently: it is counted in `failed`
with its error kept.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable

from tierplan.agent.taps import WindowDraft
from tierplan.controller.protocol import Telemetry

YIELD_S = 50e-6


def _yield_gil() -> None:
    """Hand the GIL to a waiting engine thread. sleep(0) is not enough: it releases and retakes the GIL at
    once, and a waiting thread that has not yet asked for a forced switch (after the 5 ms interval) rarely
    gets in. A real sleep lets it take the GIL; the build gets ~50 µs longer per layer, off the hot path."""
    time.sleep(YIELD_S)


class Outbox:
    def __init__(self, sink: Callable[[Telemetry], None]) -> None:
        self.sink = sink
        self.sent = 0
        self.failed = 0
        self.build_ms: deque[float] = deque(maxlen=1024)  # how long each recent message took to build and sink
        # (start, end) perf_counter of each recent build alone: Python under the GIL beside the engine thread (a
        # bench lays them over its steps; the sink's own time is the source's to tell).
        self.build_spans: deque[tuple[float, float]] = deque(maxlen=4096)
        self.last_error: BaseException | None = None
        self._q: queue.Queue[WindowDraft | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="tierplan-telemetry-outbox", daemon=True)
        self._thread.start()

    def put(self, draft: WindowDraft) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("telemetry outbox is closed")
        self._q.put(draft)

    def join(self) -> None:
        """Return once every window put so far has been built and sunk (or counted as failed)."""
        self._q.join()

    def close(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()

    def _run(self) -> None:
        while True:
            draft = self._q.get()
            try:
                if draft is None:
                    return
                t0 = time.perf_counter()
                msg = draft.build(between_layers=_yield_gil)
                self.build_spans.append((t0, time.perf_counter()))
                self.sink(msg)
                self.build_ms.append((time.perf_counter() - t0) * 1e3)
                self.sent += 1
            except Exception as exc:  # kept and counted: the engine thread must not die of it
                self.failed += 1
                self.last_error = exc
            finally:
                self._q.task_done()
