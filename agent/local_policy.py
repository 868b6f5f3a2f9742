"""The plan's local rules for expert placement, run between plans without asking anyone (inference process).

The enforcer installs what the last applied plan said, already translated to the slot pool's layer index:
per-layer caps on resident experts, per-layer eviction orders (first to evict .. last), the pinned set and
the prefetch list. From then on this policy

  - ranks eviction victims for the engine's expert provider (`victim_order`, plugged into
    `OnDemandExperts` with its ranks, which the provider serves from an index): experts of layers over their
    cap first, then the plan's first-to-evict, then every expert the plan does not list, least recently used
    first; never a pinned expert;
  - names the experts a new cap pushes out (`over_cap_victims`);
  - runs the prefetch list (`run_prefetch`), most urgent first (priority, then deadline), through the
    expert provider's loader: into a free slot, or in place of a resident the plan does not want (for a
    layer at its cap, one of the same layer); experts already resident are skipped;
  - groups a layer's needed experts for the provider (`chunk_order`). With the scan rule (`ScanRule.MRU`),
    a layer whose step needs more experts than its slots (its cap, else an even share of the pool) is a
    scan, which defeats LRU (every expert is evicted just before it is needed again): its resident experts
    go first, as a kept subset, and the rest stream through `stream_slots` slots, the most recently used
    evicted first, so the kept subset survives from step to step.

Every time it cannot follow the plan it counts the fallback it took, by name (`Fallback`). All calls come
from the engine thread between steps (the ranking also from inside a step's `ensure`). It must never talk
to the network, decide a new plan, or touch KV blocks.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from tierplan.runtime.engine.experts import OnDemandExperts
from tierplan.runtime.errors import ConfigError, RuntimeTierError
from tierplan.runtime.future import OpFuture
from tierplan.runtime.memory.slots import ExpertSlotPool, ExpertState
from tierplan.runtime.transfer import Priority

Key = tuple[int, int]  # (pool layer, expert)


class Fallback(StrEnum):
    """What the policy did when the plan could not be followed (telemetry's `fallbacks` keys)."""

    LRU_NO_PLAN_ORDER = "lru_no_plan_order"  # a victim chosen by LRU: the plan ranks none of the candidates
    PREFETCH_NO_SLOT = "prefetch_no_slot"  # no free slot and nothing the plan lets a prefetch evict
    PREFETCH_LATE = "prefetch_late"  # not seen landed by the first look after its deadline
    PREFETCH_FAILED = "prefetch_failed"  # the loader refused it or the load failed


class ScanRule(StrEnum):
    """How a layer whose step needs more experts than its slots is served (the policy's option)."""

    LRU = "lru"  # consecutive groups, victims by the plan's order then least recently used
    MRU = "mru"  # residents first (kept), the rest streamed through a few slots, most recently used evicted


@dataclass(frozen=True)
class PrefetchJob:
    key: Key  # (pool layer, expert)
    priority: Priority
    deadline_s: float  # on the enforcer's clock: plan-apply time + the item's deadline_ms


@dataclass(frozen=True)
class PolicyState:
    """Everything a plan installs, plus the prefetches still queued or in flight (for comparisons)."""

    caps: tuple[tuple[int, int], ...]  # (pool layer, max resident experts), by layer
    eviction: tuple[tuple[int, tuple[int, ...]], ...]  # (pool layer, first-to-evict .. last), by layer
    pinned: frozenset[Key]
    queued: tuple[PrefetchJob, ...]
    in_flight: frozenset[Key]


@dataclass
class _Pending:
    job: PrefetchJob
    fut: OpFuture
    late: bool = False


class LocalPolicy:
    """See the module docstring."""

    def __init__(self, pool: ExpertSlotPool, experts: OnDemandExperts, scan_rule: ScanRule = ScanRule.LRU,
                 stream_slots: int = 1) -> None:
        if experts.pool is not pool:
            raise ConfigError("LocalPolicy: experts.pool is not the pool given (the policy must rank that pool)")
        self.pool, self.experts = pool, experts
        self.set_scan_rule(scan_rule, stream_slots)
        self._scanning: int | None = None  # the pool layer whose scan is being served (MRU victims)
        self._lock = threading.RLock()
        self._caps: dict[int, int] = {}  # absent layer: no cap
        self._order: dict[int, tuple[int, ...]] = {}
        self._position: dict[Key, int] = {}  # place in its layer's eviction order
        self._rank_version = 0  # bumped by every install: the provider's index rebuilds its ranks
        self._pinned: frozenset[Key] = frozenset()
        self._wanted: frozenset[Key] = frozenset()  # the plan's prefetch keys: never evicted for a prefetch
        self._queue: list[PrefetchJob] = []
        self._pending: list[_Pending] = []
        self.fallbacks: dict[str, int] = dict.fromkeys((f.value for f in Fallback), 0)
        self._counts = dict.fromkeys(("prefetch_started", "prefetch_landed", "prefetch_skipped_resident",
                                      "evicted_for_room", "scan_layers"), 0)

    def set_scan_rule(self, rule: ScanRule, stream_slots: int = 1) -> None:
        """Choose the scan rule (config or plan); ConfigError for an unknown rule or stream_slots < 1."""
        if not isinstance(rule, ScanRule):
            raise ConfigError(f"scan_rule: expected one of {[r.value for r in ScanRule]}, got {rule!r}")
        if isinstance(stream_slots, bool) or not isinstance(stream_slots, int) or stream_slots < 1:
            raise ConfigError(f"stream_slots: expected an int >= 1, got {stream_slots!r}")
        self.scan_rule, self.stream_slots = rule, stream_slots

    # ---- installing a plan ------------------------------------------------------------------------
    def _check_key(self, where: str, layer: int, expert: int) -> None:
        lay = self.pool.layout
        if not (0 <= layer < lay.num_layers and 0 <= expert < lay.num_experts):
            raise ConfigError(f"{where}: ({layer}, {expert}) is outside pool layers 0..{lay.num_layers - 1}, "
                              f"experts 0..{lay.num_experts - 1}")

    def install(self, caps: Mapping[int, int], eviction: Mapping[int, Sequence[int]], pinned: Iterable[Key],
                prefetch: Sequence[PrefetchJob]) -> None:
        """Replace the plan's rules (pool-layer indices); ConfigError, changing nothing, if any is out of range.

        Queued prefetches of the previous plan are dropped; call `drain` first to settle ones in flight."""
        pinned = frozenset(pinned)
        for layer, cap in caps.items():
            self._check_key(f"caps[{layer}]", layer, 0)
            if cap < 0:
                raise ConfigError(f"caps[{layer}]: {cap} is negative")
        for layer, order in eviction.items():
            if len(set(order)) != len(order):
                raise ConfigError(f"eviction[{layer}]: repeats an expert: {tuple(order)}")
            for e in order:
                self._check_key(f"eviction[{layer}]", layer, e)
        for k in pinned:
            self._check_key("pinned", *k)
        for job in prefetch:
            self._check_key("prefetch", *job.key)
        with self._lock:
            self._caps = dict(caps)
            self._order = {layer: tuple(order) for layer, order in eviction.items()}
            self._position = {(layer, e): i for layer, order in self._order.items() for i, e in enumerate(order)}
            self._pinned = pinned
            self._rank_version += 1
            self._wanted = frozenset(job.key for job in prefetch)
            ranked = sorted(enumerate(prefetch), key=lambda ij: (int(ij[1].priority), ij[1].deadline_s, ij[0]))
            self._queue = [job for _, job in ranked]

    def cap(self, layer: int) -> int | None:
        with self._lock:
            return self._caps.get(layer)

    @property
    def pinned(self) -> frozenset[Key]:
        with self._lock:
            return self._pinned

    def snapshot(self) -> PolicyState:
        with self._lock:
            return PolicyState(tuple(sorted(self._caps.items())), tuple(sorted(self._order.items())), self._pinned,
                               tuple(self._queue), frozenset(p.job.key for p in self._pending))

    # ---- ranking ----------------------------------------------------------------------------------
    def _evictable(self, candidates: Iterable[Key], protect: frozenset[Key] = frozenset()) -> list[Key]:
        return [k for k in candidates if k not in self._pinned and k not in protect and not self.pool.is_pinned(*k)]

    def _over_cap(self, layer: int) -> bool:
        cap = self._caps.get(layer)
        return cap is not None and len(self.pool.resident_experts(layer)) > cap

    def _rank(self, candidates: list[Key]) -> list[Key]:
        """Candidates (least recently used first) in eviction order; counts an LRU fallback when the plan
        ranks none of them (a choice among over-cap layers is the plan's caps speaking, not a fallback)."""
        if not candidates:
            return []
        over = {layer for layer in {k[0] for k in candidates} if self._over_cap(layer)}

        def sort_key(ik: tuple[int, Key]) -> tuple[bool, bool, int, int]:
            i, k = ik
            pos = self._position.get(k)
            return (k[0] not in over, pos is None, i if pos is None else pos, i)

        ranked = [k for _, k in sorted(enumerate(candidates), key=sort_key)]
        if not over and all(k not in self._position for k in candidates):
            self.fallbacks[Fallback.LRU_NO_PLAN_ORDER] += 1
        return ranked

    def victim_order(self, candidates: list[Key]) -> list[Key]:
        """`OnDemandExperts`' hook: candidates arrive least recently used first; pinned ones are dropped.
        While a scan is served, the most recently used go first (the streamed ones, not the kept subset)."""
        with self._lock:
            if self._scanning is not None:
                return self._evictable(candidates)[::-1]
            return self._rank(self._evictable(candidates))

    # ---- the ranks the provider's index serves (runtime.engine.victims.VictimRanks) ----------------
    @property
    def rank_version(self) -> int:
        return self._rank_version

    def rank_of(self, key: Key) -> int | None:
        """`key`'s place in its layer's eviction order (None: the plan does not list it)."""
        return self._position.get(key)

    def keeps(self, key: Key) -> bool:
        return key in self._pinned

    def ranks_hold(self) -> bool:
        """The ranks alone order the victims (as `victim_order` would): no scan is served (its victims go most
        recently used first) and no capped layer holds more than its cap (its experts would go first)."""
        with self._lock:
            return self._scanning is None and all(self.pool.num_resident(layer) <= cap
                                                  for layer, cap in self._caps.items())

    def saw_victims(self, victims: list[Key]) -> None:
        """Counts an LRU fallback when the first victim is unlisted (then the plan ranks no candidate)."""
        with self._lock:
            if victims and victims[0] not in self._position:
                self.fallbacks[Fallback.LRU_NO_PLAN_ORDER] += 1

    def chunk_order(self, layer: int, needed: list[int], capacity: int) -> list[list[int]]:
        """`OnDemandExperts`' grouping hook: consecutive groups of `capacity`, or under the MRU scan rule and
        more needed than the layer's slots, its residents first and the rest `stream_slots` at a time."""
        with self._lock:
            cap = self._caps.get(layer)
            slots = capacity if cap is not None else min(capacity, max(1, self.pool.num_slots
                                                                         // self.pool.layout.num_layers))
            if self.scan_rule is ScanRule.LRU or len(needed) <= slots:
                self._scanning = None
                return [needed[i : i + capacity] for i in range(0, len(needed), capacity)]
            self._scanning = layer
            self._counts["scan_layers"] += 1
            kept = [e for e in needed if self.pool.is_resident(layer, e)]
            rest = [e for e in needed if not self.pool.is_resident(layer, e)]
            n = min(self.stream_slots, capacity)
            return ([kept[i : i + capacity] for i in range(0, len(kept), capacity)]
                    + [rest[i : i + n] for i in range(0, len(rest), n)])

    def over_cap_victims(self, layer: int) -> list[Key]:
        """The residents of `layer` beyond its cap, first to evict first (fewer if the rest are pinned)."""
        with self._lock:
            cap = self._caps.get(layer)
            if cap is None:
                return []
            excess = len(self.pool.resident_experts(layer)) - cap
            if excess <= 0:
                return []
            cands = self._evictable(k for k in self.experts.residents_lru() if k[0] == layer)
            return self._rank(cands)[:excess]

    def make_room(self, key: Key, protect: frozenset[Key] = frozenset()) -> bool:
        """Free a slot `key` may take without passing its layer's cap, evicting by the plan's order.

        False (nothing changed) when no slot is free and every candidate is pinned or protected."""
        return self.make_rooms(key[0], 1, protect | {key}) == 1

    def make_rooms(self, layer: int, num: int, protect: frozenset[Key] = frozenset()) -> int:
        """`make_room` for `num` loads into `layer` at once, the candidates listed and ranked once (per load,
        each call walks every resident: H200 phase run 08 profiled ~0.3 ms a call on the engine thread). The
        slots the layer holds (loading, resident or being evicted, as the pool checks its limit: loads this
        policy did not queue hold one too) past its cap are freed from its own residents, the rest from free
        slots or any layer's victims, both by the plan's order. Returns how many of the `num` loads may start
        (fewer when candidates run out), and evicts nothing when none may."""
        if num <= 0:
            return 0
        with self._lock:
            cap = self._caps.get(layer)
            bound, free = self.pool.num_bound(layer), self.pool.num_free_slots
            if (cap is None or bound + num <= cap) and free >= num:
                return num
            # Served from the provider's index when the ranks hold (only as many as these loads can use).
            indexed = self.experts.victim_ranks is self and self.ranks_hold()
            if indexed:
                own = [] if cap is None else self.experts.ranked_victims(num + max(0, bound - cap), layer, protect)
            else:
                ranked = self._rank(self._evictable(self.experts.residents_lru(), protect))
                own = [k for k in ranked if k[0] == layer]

            def own_for(n: int) -> int:  # the layer's own victims `n` loads need under its cap
                return 0 if cap is None else max(0, bound + n - cap)

            ok = num if cap is None else max(0, min(num, cap - bound + len(own)))
            if indexed:
                rest = self.experts.ranked_victims(num, None, protect | set(own[:own_for(ok)]))
                if (own or rest) and all(k not in self._position for k in own + rest):  # as `_rank` counts
                    self.fallbacks[Fallback.LRU_NO_PLAN_ORDER] += 1
            else:
                rest = [k for k in ranked if k not in set(own[:own_for(ok)])]
            ok = min(ok, own_for(ok) + free + len(rest))
            if ok <= 0:
                return 0
            victims = [*own[:own_for(ok)], *rest[:max(0, ok - own_for(ok) - free)]]
            for key in victims:
                self.experts.evict(*key)
            self._counts["evicted_for_room"] += len(victims)
            return ok

    # ---- prefetch ---------------------------------------------------------------------------------
    def _poll(self, now_s: float) -> None:
        still = []
        for p in self._pending:
            failed = p.fut.done() and p.fut.error is not None
            if not p.late and not failed and now_s > p.job.deadline_s:
                p.late = True  # not seen landed by the first look after its deadline
                self.fallbacks[Fallback.PREFETCH_LATE] += 1
            if not p.fut.done():
                still.append(p)
            elif failed:
                self.fallbacks[Fallback.PREFETCH_FAILED] += 1
            else:
                self._counts["prefetch_landed"] += 1
        self._pending = still

    def run_prefetch(self, now_s: float) -> int:
        """Settle finished prefetches, then start every queued one that can get a slot; returns how many
        started. A job that cannot start now is counted and dropped (it is not retried)."""
        with self._lock:
            self._poll(now_s)
            queue, self._queue = self._queue, []
            started = 0
            for job in queue:
                state = self.pool.state(*job.key)
                if state is ExpertState.RESIDENT:
                    self._counts["prefetch_skipped_resident"] += 1
                    continue
                if state is not ExpertState.ABSENT or any(p.job.key == job.key for p in self._pending):
                    continue  # already on its way
                if not self.make_room(job.key, protect=self._wanted):
                    self.fallbacks[Fallback.PREFETCH_NO_SLOT] += 1
                    continue
                try:
                    fut = self.experts.load_async(*job.key, priority=job.priority, deadline_s=job.deadline_s)
                except RuntimeTierError:
                    self.fallbacks[Fallback.PREFETCH_FAILED] += 1
                    continue
                self._pending.append(_Pending(job, fut))
                self._counts["prefetch_started"] += 1
                started += 1
            return started

    def drain(self, now_s: float) -> None:
        """Drop queued prefetches and wait for the ones in flight (before a new plan is installed)."""
        with self._lock:
            self._queue = []
            for p in self._pending:
                with contextlib.suppress(Exception):  # a failure is read back from fut.error by _poll
                    p.fut.wait()
            self._poll(now_s)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self.fallbacks, **self._counts, "prefetch_queued": len(self._queue),
                    "prefetch_in_flight": len(self._pending), "num_pinned": len(self._pinned),
                    "num_capped_layers": len(self._caps)}
