"""The engine's expert residency replayed over the forced router's table: the misses a run's steps make at a split.

Runs in the bench process (each row's `predicted_step_ms`: bench/phase_predictor.py, bench/phase_pricing.py) and
offline (the replay of saved steps, bench/phase_cost_replay.py); pure numpy, no torch.

The rows priced a split's misses from the trace's LRU stack-distance curves until session 41. Those count a
step's own earlier accesses in each expert's distance, as a cache that may evict an expert the same step still
needs; the engine never does (`OnDemandExperts.ensure`: a layer's needed experts load as consecutive groups of
its slots, ascending, and a miss evicts the least recently used resident outside its group), so near a layer's
union the curves counted up to twice its misses (H100 b32 at 59 slots of 128: 21.3 a step against 10.6), and a
prefill step, priced on a curve of independent sequences, found none of the experts the decode steps before it
left. Replaying the engine's rule over the run's own step shapes instead (this CPU box, the H100/H200 steps of
phase runs 01-79): the mean misses of a run's decode steps within 15 % (or 2) of those measured at 932 of 957
runs (the curves: 696), of its prefill steps at 891 of 912 (the curves: 247).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SEQ_STRIDE = 997  # the forced router's: token `pos` of sequence `seq` reads row (seq * 997 + pos) % T
PROMPT_STRIDE = 7919  # where a replayed step's prompt starts in the table (a prime: each step's its own place)


@dataclass(frozen=True)
class StepLoads:
    """One replayed step: the misses of each MoE layer and whether some layer needed more than its slots (the
    engine then runs a decode step chunked off its graphs)."""

    misses: tuple[int, ...]
    over_slots: bool


class ResidencyReplay:
    """Each MoE layer's resident experts, as the engine's LRU residency keeps them, over synthetic steps read from
    the forced router's table `ids` [T, L_moe, k]: a step's decodes are sequences 0..n-1 at the replay's step
    index (each walks the table in order, as the router has them), its prompt tokens one run of rows."""

    def __init__(self, ids: np.ndarray, num_experts: int) -> None:
        if ids.ndim != 3 or not ids.size:
            raise ValueError(f"ResidencyReplay: expected a routing table [T, L_moe, k], got shape {ids.shape}")
        if int(ids.max()) >= num_experts or int(ids.min()) < 0:
            raise ValueError(f"ResidencyReplay: expert ids must lie in [0, {num_experts}), "
                             f"got [{int(ids.min())}, {int(ids.max())}]")
        self.ids, self.num_experts = ids, num_experts
        layers = ids.shape[1]
        self._resident = np.zeros((layers, num_experts), bool)
        self._last = np.full((layers, num_experts), -1.0)  # each expert's last use (a clock over every access)
        self._clock = 0.0
        self._t = 0  # steps replayed

    @classmethod
    def of_layers(cls, num_layers: int, num_experts: int) -> ResidencyReplay:
        """A replay driven by `step_needed` alone (the caller names each step's experts; no table to read)."""
        return cls(np.zeros((1, num_layers, 1), np.int64), num_experts)

    def _rows(self, num_decodes: int, prompt_tokens: int) -> np.ndarray:
        t_rows = self.ids.shape[0]
        parts = [(np.arange(num_decodes, dtype=np.int64) * SEQ_STRIDE + self._t) % t_rows]
        if prompt_tokens > 0:
            parts.append((self._t * PROMPT_STRIDE + np.arange(prompt_tokens, dtype=np.int64)) % t_rows)
        self._t += 1
        return np.concatenate(parts)

    def _evict(self, layer: int, num: int, keep: np.ndarray | None = None) -> None:
        """Drop `num` least recently used residents of `layer` (none of `keep`)."""
        cand = np.flatnonzero(self._resident[layer])
        if keep is not None:
            cand = cand[~np.isin(cand, keep)]
        victims = cand[np.argsort(self._last[layer, cand], kind="stable")[:num]]
        self._resident[layer, victims] = False

    def step(self, slots: Sequence[int], num_decodes: int, prompt_tokens: int = 0) -> StepLoads:
        """One step of `num_decodes` decode tokens and `prompt_tokens` prompt tokens at `slots[m]` slots in MoE
        layer m (`step_needed` over the experts the table routes them to)."""
        if len(slots) != self.ids.shape[1]:
            raise ValueError(f"ResidencyReplay: {len(slots)} slot counts for {self.ids.shape[1]} MoE layers")
        rows = self._rows(num_decodes, prompt_tokens)
        return self.step_needed(slots, [np.unique(self.ids[rows, m]) for m in range(self.ids.shape[1])])

    def step_needed(self, slots: Sequence[int], needed: Sequence[np.ndarray]) -> StepLoads:
        """One step needing the distinct experts `needed[m]` (ascending) of each MoE layer m, at `slots[m]` slots:
        the groups load one after another, each miss evicting the layer's least recently used resident outside
        its group. A layer whose slots hold every expert misses nothing (the warm-up filled them)."""
        misses, over = [], False
        for m, (cap, need) in enumerate(zip((int(s) for s in slots), needed, strict=True)):
            if cap >= self.num_experts:  # kept in order all the same: a later plan may cut the layer's slots
                self._resident[m, need] = True
                self._last[m, need] = self._clock + np.arange(need.size)
                self._clock += need.size
                misses.append(0)
                continue
            cap = max(1, cap)
            excess = int(self._resident[m].sum()) - cap  # a plan cut this layer's slots: its LRU ones go
            if excess > 0:
                self._evict(m, excess)
            over = over or need.size > cap
            n = 0
            for i in range(0, need.size, cap):
                group = need[i : i + cap]
                held = self._resident[m, group]
                load = group[~held]
                if load.size:
                    short = load.size - (cap - int(self._resident[m].sum()))
                    if short > 0:
                        self._evict(m, short, keep=group)
                    self._resident[m, load] = True
                    n += int(load.size)
                # the engine touches a group's hits as it finds them, then its misses once loaded
                order = np.concatenate([group[held], load])
                self._last[m, order] = self._clock + np.arange(order.size)
                self._clock += order.size
            misses.append(n)
        return StepLoads(tuple(misses), over)


def replay_loads(ids: np.ndarray, num_experts: int, shapes: Sequence[tuple[int, int]],
                 slots: Sequence[Sequence[int]]) -> list[StepLoads]:
    """Each step of `shapes` ((decode tokens, prompt tokens) each) at its `slots`, in order, from a residency
    warmed by one pass over the same steps: a steady state, as a run's measured steps find it (its own warm-up
    and the runs before it filled the slots)."""
    if len(shapes) != len(slots):
        raise ValueError(f"replay_loads: {len(shapes)} steps, {len(slots)} splits")
    replay = ResidencyReplay(ids, num_experts)
    for (decodes, prompt), s in zip(shapes, slots, strict=True):
        replay.step(s, decodes, prompt)
    return [replay.step(s, decodes, prompt) for (decodes, prompt), s in zip(shapes, slots, strict=True)]
