"""Exponential backoff with full jitter for the sidecar's retries and the agent link's reconnects.

Used in the sidecar process (HTTP to the service) and in the inference process's `ServiceLink` sender thread
(reconnecting to the sidecar), never on the engine thread. Full jitter (AWS architecture blog, "Exponential
Backoff And Jitter"): the n-th consecutive failure waits uniform(0, min(cap_s, base_s * 2**n)) seconds, so a
fleet of sidecars that lost the service together does not retry in lockstep. The random source comes in
through the constructor (a seeded `random.Random` in tests); nothing here sleeps or reads a clock.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    base_s: float = 0.2
    cap_s: float = 10.0
    rng: random.Random = field(default_factory=random.Random)
    failures: int = 0  # consecutive failures since the last success

    def __post_init__(self) -> None:
        if not (self.base_s > 0 and self.cap_s >= self.base_s):
            raise ValueError(f"Backoff: need 0 < base_s <= cap_s, got base_s={self.base_s}, cap_s={self.cap_s}")

    def ceiling_s(self, failures: int) -> float:
        """The most the wait after `failures` consecutive failures can be (before jitter)."""
        return min(self.cap_s, self.base_s * 2.0 ** min(failures - 1, 62))

    def next_delay_s(self) -> float:
        """Record one more failure and return the wait before the next attempt."""
        self.failures += 1
        return self.rng.uniform(0.0, self.ceiling_s(self.failures))

    def reset(self) -> None:
        self.failures = 0
