"""The KV reuse predictor fed live from agents' telemetry, and a plan's KV retention order from it (controller
process).

`KvReuseFeed.observe(telemetry)` turns a window's `kv.reuse_events` (a prefix's blocks were found again, on
some tier) into accesses of `KVReusePredictor` (controller/predictors/kv_reuse.py), in the order reported:
each event is one access of one block, at the window's end (a window is the finest time the agent reports),
so the predictor learns online which prefixes come back within its horizon. `retention(max_items)` ranks the
prefixes seen within the horizon, highest P(reused within the horizon) first: a `Plan`'s `kv_retention`.
Before the model's first fit (it needs `min_fit_events` resolved events of both outcomes) the order is by
accesses so far, and `Retention.basis` says so; the plan's reason repeats it.
Nothing is dropped unsaid: events past `max_events_per_window` and windows whose end lies before the feed's
clock (another rank's clock behind) are counted in `stats()`. Pure Python and numpy: it must never import
torch, runtime or agent, touch disk or network, or keep globals.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import StrEnum

from tierplan.controller.predictors.kv_reuse import KVReusePredictor, ScorerKind
from tierplan.controller.protocol import MAX_ITEMS, Telemetry


class RetentionBasis(StrEnum):
    MODEL = "model"  # the learned predictor's P(reused within the horizon)
    COUNT = "count"  # before its first fit: accesses so far (the count rule, which needs no training)


@dataclass(frozen=True)
class KvReuseConfig:
    horizon_s: float = 600.0  # "reused" means: found again within this long of its last access
    kind: ScorerKind = ScorerKind.LOGISTIC
    min_fit_events: int = 1_000
    refit_every_events: int = 25_000  # each refit reads the whole window: the main cost of feeding an event
    window_events: int = 50_000  # resolved events the model is refitted on (the newest)
    max_events_per_window: int = 8_192  # events of one window fed; the rest counted, not learned from


@dataclass(frozen=True)
class Retention:
    """Prefix hashes to keep first, most likely reused first, with their scores (probabilities for MODEL,
    accesses so far for COUNT)."""

    hashes: tuple[str, ...]
    scores: tuple[float, ...]
    basis: RetentionBasis
    horizon_s: float
    num_resolved: int = 0  # the predictor's resolved events when ranked (COUNT: short of min_fit_events)
    min_fit_events: int = 0

    def describe(self) -> str:
        """One clause for a plan's reason ('' when there is nothing to keep)."""
        if not self.hashes:
            return ""
        n = len(self.hashes)
        head = f"KV retention: {n} prefix{'es' if n != 1 else ''} kept first"
        if self.basis is RetentionBasis.MODEL:
            return (f"{head}, by P(reused within {self.horizon_s:g} s) from the reuse model "
                    f"({self.scores[0]:.2f} .. {self.scores[-1]:.2f})")
        return (f"{head}, by accesses so far ({self.scores[0]:g} .. {self.scores[-1]:g}): the reuse model is not "
                f"fitted yet ({self.num_resolved} events resolved, needs {self.min_fit_events} of both outcomes)")


class KvReuseFeed:
    """See the module docstring."""

    def __init__(self, config: KvReuseConfig | None = None) -> None:
        self.config = cfg = config or KvReuseConfig()
        if cfg.max_events_per_window < 1:
            raise ValueError(f"KvReuseConfig.max_events_per_window must be >= 1, got {cfg.max_events_per_window}")
        self.predictor = KVReusePredictor(cfg.horizon_s, cfg.kind, refit_every_events=cfg.refit_every_events,
                                          window_events=cfg.window_events, min_fit_events=cfg.min_fit_events)
        self.now_s: float | None = None
        self.counts: Counter[str] = Counter()  # windows, events_fed, events_over_cap, windows_clock_behind

    def observe(self, tel: Telemetry) -> int:
        """Feed one accepted window's reuse events; returns how many were fed."""
        self.counts["windows"] += 1
        events = tel.kv.reuse_events
        if not events:
            self._advance(tel.window_end_s)
            return 0
        now_s = self._advance(tel.window_end_s)
        fed = events[: self.config.max_events_per_window]
        for ev in fed:
            self.predictor.observe(now_s, (ev.prefix_hash,), 0, score=False)
        self.counts["events_fed"] += len(fed)
        self.counts["events_over_cap"] += len(events) - len(fed)
        return len(fed)

    def _advance(self, end_s: float) -> float:
        if self.now_s is not None and end_s < self.now_s:
            self.counts["windows_clock_behind"] += 1  # fed at the feed's time: the predictor's time never goes back
            return self.now_s
        self.now_s = end_s
        return end_s

    def retention(self, max_items: int) -> Retention:
        """The keep-first order of at most `max_items` prefixes (empty before any event)."""
        cfg = self.config
        if self.now_s is None or max_items <= 0:
            ranked, fitted = [], self.predictor.is_fitted
        else:
            ranked, fitted = self.predictor.rank(self.now_s, max_items)
        return Retention(hashes=tuple(h for h, _ in ranked), scores=tuple(s for _, s in ranked),
                         basis=RetentionBasis.MODEL if fitted else RetentionBasis.COUNT, horizon_s=cfg.horizon_s,
                         num_resolved=self.predictor.num_resolved_events, min_fit_events=cfg.min_fit_events)

    def reuse_scores(self, max_items: int = MAX_ITEMS) -> dict[str, float]:
        """`Forecast.kv_reuse_scores`: the model's probabilities (empty before its first fit)."""
        return {} if self.now_s is None else self.predictor.reuse_scores(self.now_s, max_items)

    def stats(self) -> dict[str, int]:
        return {**{k: self.counts[k] for k in ("windows", "events_fed", "events_over_cap", "windows_clock_behind")},
                "resolved_events": self.predictor.num_resolved_events, "fits": self.predictor.num_fits}
