"""Spills of the vLLM KV connector in the background: CPU-tier blocks on their way to the NVMe file (vLLM worker
process).

A spill's bytes are already safe in our CPU tier, and the runtime holds the block where it is until the move
completes (no read, no free; its CPU index and its NVMe index both count against their tiers), so the engine
thread starts it and goes on. `KvTierWorker` finishes the spills it needs (a load, drop, move or overwrite of that
key) and every spill of a step by the next step's ops; a store that needs the room a spill still holds waits in a
host buffer of the worker's meanwhile (the engine thread waits only when all of those are taken). Never decides what to
spill; never waits except where a caller needs a spill done.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tierplan.runtime.kv.handler import KVMoveFuture


class SpillQueue:
    """Spills in flight by key; `on_done(key, error)` runs on the engine thread once each is finished."""

    def __init__(self, on_done: Callable[[str, BaseException | None], None]) -> None:
        self._on_done = on_done
        self._inflight: dict[str, KVMoveFuture] = {}
        self.num_started = 0
        self.num_waited = 0  # spills the engine thread had to wait for (not done when needed)

    def start(self, key: str, future: KVMoveFuture) -> None:
        if key in self._inflight:
            raise RuntimeError(f"SpillQueue: block {key!r} is spilling already; settle it first")
        self._inflight[key] = future
        self.num_started += 1

    def pending(self) -> int:
        return len(self._inflight)

    def is_spilling(self, key: str) -> bool:
        return key in self._inflight

    def _finish(self, key: str) -> None:
        future = self._inflight.pop(key)
        if not future.done():
            self.num_waited += 1
        try:
            future.wait()
            error = None
        except Exception as exc:  # the move's own error: the block stayed on the CPU tier
            error = exc
        self._on_done(key, error)

    def poll(self) -> None:
        """Finish the spills that are done, without waiting."""
        for key in [k for k, f in self._inflight.items() if f.done()]:
            self._finish(key)

    def settle(self, keys: Iterable[str]) -> None:
        """Finish the spills of these keys (waiting for them)."""
        for key in keys:
            if key in self._inflight:
                self._finish(key)

    def settle_all(self) -> None:
        for key in list(self._inflight):
            self._finish(key)
