"""The common protocols of the controller's demand models and the expert-cache policies they drive.

Runs in the controller process (and in offline evaluation). Two roles, kept apart:
- `DemandPredictor`: learns online from the routing stream and scores, per layer, how likely each expert is
  to be demanded at that layer's next access. Named and versioned, so a `Plan` can say which model it carries
  and the shadow evaluator (shadow.py) can compare a candidate with the incumbent on the same windows.
- `ExpertCachePolicy`: what the replay harness (controller/eval/expert_cache.py) and the agent's local rules
  need from a policy: see the router's output, pick eviction victims, and propose prefetches within a budget.

The stream is fed in execution order: step s (one token at B=1, the union of B tokens otherwise), layers 0..L-1,
then step s+1. Nothing here may see the future: the clairvoyant Belady policy gets the future from its own
constructor, never through these calls. Never imports torch, runtime or agent.

Shape letters: E experts per layer.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class DemandPredictor(Protocol):
    """Online demand model: `observe` the stream, then `scores` for the next access of a layer."""

    name: str
    version: int

    def reset(self, num_layers: int, num_experts: int) -> None:
        """Forget everything; the next `observe` starts a new stream of this shape."""

    def observe(self, step: int, layer: int, expert_ids: np.ndarray) -> None:
        """The experts demanded at (step, layer) (distinct ids, router order), in execution order."""

    def scores(self, step: int, layer: int) -> np.ndarray:
        """[E] float64 in [0, 1]: estimated probability each expert is demanded at (step, layer), given
        everything observed so far (typically (step, layer - 1) was the last observation)."""


@runtime_checkable
class ExpertCachePolicy(Protocol):
    """A per-layer expert cache policy as the replay harness drives it (see module docstring for the order)."""

    name: str

    def reset(self, num_layers: int, num_experts: int, capacity: int, top_k: int) -> None:
        """Start a new replay: `capacity` resident experts per layer, `top_k` experts per token."""

    def begin_layer(self, step: int, layer: int, union: np.ndarray) -> None:
        """The router's output for (step, layer) is known (distinct ids); its accesses follow."""

    def touch(self, layer: int, expert: int, hit: bool) -> None:
        """One demand access served; `expert` is resident now (loaded on a miss)."""

    def victim(self, layer: int, evictable: np.ndarray) -> int:
        """Pick the resident expert to evict; `evictable` [E] bool marks the allowed ones (at least one)."""

    def prefetch(self, step: int, layer: int, resident: np.ndarray, budget: int) -> list[int]:
        """Experts to load for (step, layer) now, before its router runs: at most `budget`, none resident
        (`resident` [E] bool). Issued once the previous layer's routing is known (the harness's timing rule)."""
