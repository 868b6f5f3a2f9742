"""Eviction orders the expert residency (`OnDemandExperts`) can be given (inference process, engine thread).

`lru_victim_order` is the default: candidates already arrive least recently used first. `ScanVictimOrder` is
the local rule for scans. The agent plugs its own policy in through `OnDemandExperts.set_victim_order`; an
order that ranks each expert by a rank of its own, then by recency, also hands over its `VictimRanks`, which
the residency serves from an index (recency.py) instead of passing it every candidate. These rank candidates
only: they never evict, load or touch the slot pool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

Key = tuple[int, int]  # (pool layer, expert)
VictimOrder = Callable[[list[Key]], list[Key]]
ChunkOrder = Callable[[int, list[int], int], list[list[int]]]  # (layer, needed ascending, capacity_of) -> groups


class VictimRanks(Protocol):
    """A victim order's ranks: experts with a rank go first, lowest first, then the unranked; ties and the
    unranked by recency, least recently used first. The residency asks `ranks_hold` before each ranking: when
    it is False the full candidate list goes through the order itself this time (e.g. a layer over its cap)."""

    @property
    def rank_version(self) -> int: ...  # changes whenever any rank may have changed

    def rank_of(self, key: Key) -> int | None: ...

    def keeps(self, key: Key) -> bool: ...  # never a victim, whatever its rank (e.g. the plan's pins)

    def ranks_hold(self) -> bool: ...

    def saw_victims(self, victims: list[Key]) -> None: ...  # what a ranking chose (for the order's counts)


class _Union(Protocol):
    last_union: int  # how many experts the last forward asked for

    @property
    def capacity(self) -> int: ...


def lru_victim_order(candidates: list[Key]) -> list[Key]:
    """The default ranking: candidates already arrive least recently used first."""
    return candidates


class ScanVictimOrder:
    """A local rule for scans: when the last step asked for more experts than there are slots (every expert is
    evicted just before it is needed again under LRU), evict the most recently used first, so the experts that
    stayed resident form a kept subset and the rest stream through the remaining slots; otherwise LRU. An
    option the engine exposes (EngineConfig.expert_victims="scan") until the agent's policy plugs its own."""

    def __init__(self, experts: _Union) -> None:
        self.experts = experts
        self.scans = 0  # rankings made most-recently-used first

    def __call__(self, candidates: list[Key]) -> list[Key]:
        if self.experts.last_union > self.experts.capacity:
            self.scans += 1
            return candidates[::-1]
        return candidates
