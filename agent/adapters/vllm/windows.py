"""Telemetry windows of a vLLM engine (engine-core / worker process, between steps).

`VllmWindows` is our engine agent's window machinery over vLLM: the capture's `RouterTap` counters and our
`TelemetryWindow` (the same Telemetry fields our reference adapter sends: activation counts, top-k
co-occurrence, router entropy, step timings, KV per tier, fallbacks), closed every `window_steps` steps.
The engine thread only snapshots (one host copy of the counters); the `Outbox` thread builds the message and
hands it to `sink` (the ServiceLink's queue). KV numbers come from the connector (`add_kv`, any thread,
counts since its last call, blocks as a level) or, where no connector reports, from vLLM's own scheduler
stats (`add_engine_kv`, the stat logger's relay). The connector's prefix hits come as reuse events
(`add_reuse`: prefix hash, age, tier), the KV reuse predictor's input; at most MAX_REUSE_EVENTS_PER_WINDOW a
window, the rest and any malformed one counted in the fallbacks. vLLM keeps every expert resident, so every
routed expert is an expert hit. It must never wait on the sidecar or raise into the engine.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable

from tierplan.agent.adapters.vllm.capture import RouterCapture
from tierplan.agent.adapters.vllm.kv_limits import TIER_NAMES, ReuseEvent
from tierplan.agent.outbox import Outbox
from tierplan.agent.taps import TelemetryWindow
from tierplan.controller.protocol import MAX_ID_CHARS, MAX_ITEMS, Telemetry

# ~115 bytes of JSON each with vLLM's 64-hex hashes: 8192 keep a window near 1 MB, well under the service's
# 4 MiB request limit (the protocol's MAX_ITEMS would not be), and equal to what the controller learns from one.
MAX_REUSE_EVENTS_PER_WINDOW = 8192


def _valid_reuse(event: object) -> ReuseEvent | None:
    """The event as the protocol's ReuseEvent fields, or None where it could not be one (counted by the caller:
    one bad event must not cost the window that carries it)."""
    try:
        key, age_s, tier = event  # type: ignore[misc]
        age_s = float(age_s)
    except (TypeError, ValueError):
        return None
    if (not isinstance(key, str) or not key or len(key) > MAX_ID_CHARS or any(c.isspace() or not c.isprintable()
                                                                            for c in key)):
        return None
    if not (math.isfinite(age_s) and age_s >= 0) or tier not in TIER_NAMES:
        return None
    return key, age_s, tier


class KvBook:
    """KV counts of the current window, fed from other threads; `take()` hands them over and starts anew."""

    def __init__(self, max_reuse_events: int = MAX_REUSE_EVENTS_PER_WINDOW) -> None:
        if not 0 <= max_reuse_events <= MAX_ITEMS:
            raise ValueError(f"KvBook: max_reuse_events must be in 0..{MAX_ITEMS}, got {max_reuse_events}")
        self.max_reuse_events = max_reuse_events
        self._lock = threading.Lock()
        self._hits: Counter[str] = Counter()
        self._misses: Counter[str] = Counter()
        self._blocks: dict[str, int] = dict.fromkeys(TIER_NAMES, 0)
        self._engine: tuple[int, int, int] | None = None  # gpu hits, misses, blocks from vLLM's stats
        self._reuse: list[ReuseEvent] = []  # this window's, at most max_reuse_events
        self.connector_reports = 0
        self.reuse_events_over_cap = 0  # events past a window's max_reuse_events, counted in the fallbacks
        self.reuse_events_bad = 0  # events that could not be a ReuseEvent (no hash, a bad age or tier)
        self.kv_entries_unknown_tier = 0  # connector report entries under a name that is no Tier

    def add_reuse(self, events: Iterable[object]) -> None:
        """The connector's prefix hits of one step: (prefix hash, age in seconds, tier name) each."""
        good = []
        for ev in events:
            checked = _valid_reuse(ev)
            if checked is None:
                self.reuse_events_bad += 1
            else:
                good.append(checked)
        with self._lock:
            room = self.max_reuse_events - len(self._reuse)
            self._reuse.extend(good[:room])
            self.reuse_events_over_cap += max(0, len(good) - room)

    def take_reuse(self) -> tuple[ReuseEvent, ...]:
        """This window's reuse events, in the order reported; the next window starts empty."""
        with self._lock:
            out, self._reuse = tuple(self._reuse), []
        return out

    def add(self, hits: dict[str, int], misses: dict[str, int], blocks: dict[str, int]) -> None:
        """A connector report; an entry under a name that is no tier of ours is left out and counted."""
        unknown = sum(1 for d in (hits, misses, blocks) for k in d if k not in TIER_NAMES)
        with self._lock:
            self.connector_reports += 1
            self.kv_entries_unknown_tier += unknown
            self._hits.update({k: int(v) for k, v in hits.items() if k in TIER_NAMES})
            self._misses.update({k: int(v) for k, v in misses.items() if k in TIER_NAMES})
            self._blocks.update({k: int(v) for k, v in blocks.items() if k in TIER_NAMES})

    def add_engine(self, gpu_hit_blocks: int, gpu_miss_blocks: int, gpu_blocks: int) -> None:
        with self._lock:
            h, m, _ = self._engine or (0, 0, 0)
            self._engine = (h + gpu_hit_blocks, m + gpu_miss_blocks, gpu_blocks)

    def levels(self) -> dict[str, int]:
        """Blocks held per tier now (the last report)."""
        with self._lock:
            return dict(self._blocks)

    def take(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """(blocks, hits, misses) per tier for the window being closed."""
        with self._lock:
            hits, misses, blocks = dict(self._hits), dict(self._misses), dict(self._blocks)
            if self.connector_reports == 0 and self._engine is not None:  # no connector: vLLM's own view of the GPU
                hits["gpu"], misses["gpu"], blocks["gpu"] = self._engine
            self._hits.clear()
            self._misses.clear()
            self._engine = None if self._engine is None else (0, 0, self._engine[2])
        return ({t: blocks.get(t, 0) for t in TIER_NAMES}, {t: hits.get(t, 0) for t in TIER_NAMES},
                {t: misses.get(t, 0) for t in TIER_NAMES})


class VllmWindows:
    """See the module docstring. `plan_version` and `fallbacks` are read at each window's close."""

    def __init__(self, capture: RouterCapture, agent_id: str, rank: int, model: str, window_steps: int,
                 sink: Callable[[Telemetry], None], plan_version: Callable[[], int],
                 fallbacks: Callable[[], dict[str, int]], clock: Callable[[], float] = time.time) -> None:
        s = capture.shape
        self.capture, self.window_steps = capture, window_steps
        self.plan_version, self.fallbacks = plan_version, fallbacks
        self.window = TelemetryWindow(agent_id, rank, model, s.num_layers, s.num_experts, capture.tap, clock)
        self.kv = KvBook()
        self.outbox = Outbox(sink)
        self.steps_in_window = 0
        self.closed = 0

    def on_step(self, step_s: float, warmup: bool) -> bool:
        """After each forward; True when it closed a window."""
        if warmup:
            if self.window.seq == 0 and self.steps_in_window == 0:
                self.window.restart()  # the first window starts with traffic, not with the warm-up
            return False
        # vLLM never waits on an expert load (KV loads: the connector); the step's tokens from its attention metadata
        self.window.observe_step(step_s, 0.0, 0.0, tokens=self.capture.last_step_tokens)
        self.steps_in_window += 1
        if self.steps_in_window < self.window_steps:
            return False
        self.close()
        return True

    def close(self) -> None:
        """Close the current window now (between steps) and queue it for the outbox."""
        blocks, hits, misses = self.kv.take()
        draft = self.window.close_draft(kv_blocks=blocks, kv_hits=hits, kv_misses=misses, links={}, expert_hits=0,
                                        expert_misses=0, plan_version=self.plan_version(),
                                        fallbacks=self._fallbacks())
        expert_hits = int(draft.router.counts.sum())  # every expert is resident in vLLM: each activation hits
        draft = dataclasses.replace(draft, fields={**draft.fields, "expert_hits": expert_hits},
                                    reuse=self.kv.take_reuse())
        self.steps_in_window = 0
        self.closed += 1
        self.outbox.put(draft)

    def _fallbacks(self) -> dict[str, int]:
        out = {f"capture_unbound_{k}": v for k, v in self.capture.unbound.items() if v}
        out |= {k: v for k, v in self.fallbacks().items() if v}
        for name in ("reuse_events_over_cap", "reuse_events_bad", "kv_entries_unknown_tier"):
            if getattr(self.kv, name):
                out[name] = getattr(self.kv, name)
        if self.outbox.failed:
            out["telemetry_build_failed"] = self.outbox.failed
        return out

    def flush(self) -> None:
        """Close a partial window (if it saw steps) and wait until every window is built and sunk."""
        if self.steps_in_window:
            self.close()
        self.outbox.join()
