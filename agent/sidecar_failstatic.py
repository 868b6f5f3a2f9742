"""Fail-static: what the sidecar hands its agents while the controller service is unreachable.

Runs in the sidecar process (its uplink thread). Three modes, each entry counted:
- ONLINE: the service answers; plans it issues are pushed to the agents as they arrive.
- LAST_GOOD: the service stopped answering less than `ttl_s` ago (measured from the last answered request).
  The cached plan (the newest the service issued) stays the current one: an agent that (re)connects gets it.
- SAFE_STATIC: unreachable for `ttl_s` or longer. The safe static plan is "keep what is applied": the cached
  plan is withdrawn (no agent is handed it any more) and nothing new is pushed, so each agent stays on the
  plan it already applied, whose budgets hold until the next plan. Why not a plan minted here: its version
  would be one the service never issued, and the service refuses every later window that reports it
  (`plan_version_ahead`), so the loop could not catch up when the service returns; a plan not yet applied
  after the TTL was built for traffic that has moved on.
Any answered request returns the mode to ONLINE. It must never make a network call or read a clock itself:
the uplink passes `now_s`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from enum import StrEnum


class Mode(StrEnum):
    ONLINE = "online"
    LAST_GOOD = "last_good"
    SAFE_STATIC = "safe_static"


class FailStatic:
    def __init__(self, ttl_s: float, now_s: float, on_change: Callable[[Mode, Mode], None] | None = None) -> None:
        if not ttl_s >= 0:
            raise ValueError(f"FailStatic: ttl_s must be >= 0 seconds, got {ttl_s}")
        self.ttl_s, self.on_change = ttl_s, on_change
        self.mode = Mode.ONLINE
        self.last_ok_s = now_s  # the start counts as contact: a service down from the start ages the same way
        self.entries: Counter[Mode] = Counter()  # entries into each mode (ONLINE: recoveries)

    def answered(self, now_s: float) -> None:
        """A request got an answer from the service (a 2xx, 3xx or 4xx status)."""
        self.last_ok_s = now_s
        self._go(Mode.ONLINE)

    def unreachable(self, now_s: float) -> None:
        """A request got no answer (connect error, timeout, 5xx)."""
        if self.mode is Mode.ONLINE:
            self._go(Mode.LAST_GOOD)
        self.age(now_s)

    def age(self, now_s: float) -> None:
        """Called while waiting to retry: the TTL runs out without another request."""
        if self.mode is Mode.LAST_GOOD and now_s - self.last_ok_s >= self.ttl_s:
            self._go(Mode.SAFE_STATIC)

    @property
    def serves_cached_plan(self) -> bool:
        return self.mode is not Mode.SAFE_STATIC

    def _go(self, mode: Mode) -> None:
        if mode is self.mode:
            return
        old, self.mode = self.mode, mode
        self.entries[mode] += 1
        if self.on_change is not None:
            self.on_change(old, mode)
