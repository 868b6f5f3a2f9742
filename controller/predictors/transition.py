"""A compact per-layer sparse transition table: P(expert j at layer l+1 | expert i at layer l), top-m per row.

Trained online in the controller from the routing stream (the same token's experts at two consecutive layers);
shipped in a `Plan` as plain rows (`to_rows`) for the agent to evaluate one layer ahead: once layer l's router
has chosen experts S for a token, `predict(l, S)` scores layer l+1's experts as the mean over i in S of
P(j | i), each row backed off to layer l+1's marginal frequency. Rows keep only their top-m entries, so what
the agent holds is bounded (L x E x m entries); `from_rows` rebuilds the evaluator from exactly those rows.

A row's probabilities come from counts with `prior` pseudo-observations of the marginal: P(j | i) =
(n(i, j) + prior * q(j)) / (n(i) + prior), q = layer l+1's marginal demand (expected experts per token / k).
`decay` in [0, 1) ages counts per observed token, so the table follows a drifting workload.

`version` starts at 1 and grows by one at each `snapshot()` that follows new observations, so a Plan can name
the table it carries. Never imports torch, runtime or agent.

Shape letters: L layers, E experts per layer, m entries kept per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Row = tuple[int, int, int, float]  # (layer l, expert i at l, expert j at l + 1, P(j at l+1 | i at l))


@dataclass(frozen=True)
class TransitionSnapshot:
    """What a Plan carries: the table's version, its rows and each target layer's marginal (the back-off)."""

    version: int
    num_layers: int
    num_experts: int
    rows: tuple[Row, ...]
    marginals: tuple[tuple[float, ...], ...]  # [L][E] P(j demanded at layer l) per token


class TransitionTable:
    """Online cross-layer transition counts; also a DemandPredictor (`observe` / `scores`)."""

    name = "transition"

    def __init__(self, num_layers: int, num_experts: int, top_m: int = 8, prior: float = 1.0,
                 decay: float = 0.0) -> None:
        if top_m < 1 or prior < 0 or not 0.0 <= decay < 1.0:
            raise ValueError(f"transition table: need top_m >= 1, prior >= 0, decay in [0, 1); got {top_m}, "
                             f"{prior}, {decay}")
        self.top_m, self.prior, self.decay = top_m, prior, decay
        self.version = 1
        self.reset(num_layers, num_experts)

    def reset(self, num_layers: int, num_experts: int) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self._pair = np.zeros((max(num_layers - 1, 0), num_experts, num_experts))  # [L-1, E, E] n(i, j)
        self._src = np.zeros((max(num_layers - 1, 0), num_experts))  # [L-1, E] n(i)
        self._marg = np.zeros((num_layers, num_experts))  # [L, E] demands per layer
        self._tokens = np.zeros(num_layers)  # [L] tokens observed per layer
        self._last: dict[int, tuple[int, np.ndarray]] = {}  # layer -> (step, ids) last observed
        self._dirty = False

    def observe(self, step: int, layer: int, expert_ids: np.ndarray) -> None:
        """One token's (or one step's) experts at `layer`; pairs with the same step's previous layer."""
        ids = np.asarray(expert_ids, np.int64)
        ids = ids[ids >= 0]
        if self.decay:
            self._marg[layer] *= 1.0 - self.decay
            self._tokens[layer] *= 1.0 - self.decay
        self._marg[layer, ids] += 1.0
        self._tokens[layer] += 1.0
        prev = self._last.get(layer - 1)
        if layer > 0 and prev is not None and prev[0] == step:
            self.observe_pair(layer - 1, prev[1], ids)
        self._last[layer] = (step, ids)
        self._dirty = True

    def observe_pair(self, layer: int, src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
        """Count one token: experts `src_ids` at `layer`, `dst_ids` at `layer + 1`."""
        src = np.asarray(src_ids, np.int64)
        dst = np.asarray(dst_ids, np.int64)
        if self.decay:
            self._pair[layer] *= 1.0 - self.decay
            self._src[layer] *= 1.0 - self.decay
        self._pair[layer][np.ix_(src, dst)] += 1.0
        self._src[layer, src] += 1.0
        self._dirty = True

    def marginal(self, layer: int) -> np.ndarray:
        """[E] P(expert demanded at `layer`) per token so far (0 before any observation)."""
        n = self._tokens[layer]
        return self._marg[layer] / n if n else np.zeros(self.num_experts)

    def row_probs(self, layer: int) -> np.ndarray:
        """[E, E] P(j at layer+1 | i at layer), dense, with the marginal back-off."""
        q = self.marginal(layer + 1)  # [E]
        return (self._pair[layer] + self.prior * q) / (self._src[layer][:, None] + self.prior + 1e-12)

    def predict(self, layer: int, src_ids: np.ndarray) -> np.ndarray:
        """[E] scores for layer + 1 given the experts `src_ids` of the same token at `layer`."""
        src = np.asarray(src_ids, np.int64)
        src = src[src >= 0]
        if layer + 1 >= self.num_layers or src.size == 0:
            return self.marginal(min(layer + 1, self.num_layers - 1))
        q = self.marginal(layer + 1)
        rows = (self._pair[layer, src] + self.prior * q) / (self._src[layer, src][:, None] + self.prior + 1e-12)
        return rows.mean(axis=0)

    def scores(self, step: int, layer: int) -> np.ndarray:
        prev = self._last.get(layer - 1)
        if layer > 0 and prev is not None and prev[0] == step:
            return self.predict(layer - 1, prev[1])
        return self.marginal(layer)

    def observe_steps(self, sets: np.ndarray) -> None:
        """Whole steps at once: `sets` [n, L, E] one-hot demanded sets, in order (same counts as `observe` on each
        position; decay applies per position there, so this needs decay 0)."""
        if self.decay:
            raise ValueError("transition table: observe_steps needs decay 0 (decay ages counts per position)")
        self._pair += np.einsum("sli,slj->lij", sets[:, :-1], sets[:, 1:])
        self._src += sets[:, :-1].sum(axis=0)
        self._marg += sets.sum(axis=0)
        self._tokens += sets.shape[0]
        self._dirty = True

    def to_rows(self, top_m: int | None = None) -> list[Row]:
        """The top-m entries of every seen row as plain (layer, src, dst, prob) tuples, prob descending."""
        m = self.top_m if top_m is None else top_m
        rows: list[Row] = []
        for layer in range(self.num_layers - 1):
            seen = np.flatnonzero(self._src[layer] > 0)
            probs = self.row_probs(layer)[seen]  # [R, E]
            order = np.argsort(-probs, axis=1, kind="stable")[:, :m]  # [R, m]
            top = np.take_along_axis(probs, order, axis=1)
            rows.extend((layer, i, j, p) for i, js, ps in zip(seen.tolist(), order.tolist(), top.tolist(), strict=True)
                        for j, p in zip(js, ps, strict=True) if p > 0)
        return rows

    def snapshot(self) -> TransitionSnapshot:
        if self._dirty:
            self.version += 1
            self._dirty = False
        marg = tuple(tuple(float(x) for x in self.marginal(layer)) for layer in range(self.num_layers))
        return TransitionSnapshot(self.version, self.num_layers, self.num_experts, tuple(self.to_rows()), marg)


class CompactTransition:
    """The agent-side evaluator of a snapshot: only its rows and marginals (what a Plan carries)."""

    def __init__(self, snapshot: TransitionSnapshot) -> None:
        self.version = snapshot.version
        num_layers, num_experts = snapshot.num_layers, snapshot.num_experts
        self._marg = np.asarray(snapshot.marginals, np.float64).reshape(num_layers, num_experts)  # [L, E]
        self._table = np.zeros((max(num_layers - 1, 0), num_experts, num_experts))  # [L-1, E, E]
        self._has = np.zeros((max(num_layers - 1, 0), num_experts), bool)  # [L-1, E] row present
        if snapshot.rows:
            rows = np.asarray(snapshot.rows, np.float64)  # [R, 4]
            idx = rows[:, :3].astype(np.int64)
            bad = ~((idx[:, 0] >= 0) & (idx[:, 0] < num_layers - 1) & (idx[:, 1:] >= 0).all(1)
                    & (idx[:, 1:] < num_experts).all(1) & (rows[:, 3] >= 0) & (rows[:, 3] <= 1)
                    & (rows[:, :3] == idx).all(1))
            if bad.any():
                row = snapshot.rows[int(np.argmax(bad))]
                raise ValueError(f"transition row {row} outside {num_layers} layers x {num_experts} experts or "
                                 "not a probability")
            self._table[idx[:, 0], idx[:, 1], idx[:, 2]] = rows[:, 3]
            self._has[idx[:, 0], idx[:, 1]] = True

    def marginal(self, layer: int) -> np.ndarray:
        return self._marg[layer].copy()

    def dense_rows(self, layer: int) -> np.ndarray:
        """[E, E] the row each source expert contributes for layer + 1 (the marginal where no row was sent)."""
        return np.where(self._has[layer][:, None], self._table[layer], self._marg[layer + 1])

    def predict(self, layer: int, src_ids: np.ndarray) -> np.ndarray:
        """[E] scores for layer + 1: mean over src of its row (missing rows: the marginal of layer + 1)."""
        src = np.asarray(src_ids, np.int64)
        src = src[src >= 0]
        nxt = min(layer + 1, self._marg.shape[0] - 1)
        if layer + 1 >= self._marg.shape[0] or src.size == 0:
            return self._marg[nxt].copy()
        rows = np.where(self._has[layer, src][:, None], self._table[layer, src], self._marg[nxt])
        return rows.mean(axis=0)


def compact_score_stream(unions: list[list[np.ndarray]], num_layers: int, num_experts: int, chunk_steps: int = 16,
                         top_m: int = 8) -> np.ndarray:
    """[S, L, E] what an agent holding the last chunk's snapshot (top-m rows) predicts one layer ahead at every
    position of a recorded stream (CompactTransition.predict, vectorized per chunk); layer 0 gets the marginal
    (no same-token source). Causal by construction: a chunk is scored before the table sees it."""
    table = TransitionTable(num_layers, num_experts, top_m=top_m)
    sets = np.zeros((len(unions), num_layers, num_experts))  # [S, L, E]
    for s, per_layer in enumerate(unions):
        for layer, ids in enumerate(per_layer):
            sets[s, layer, ids] = 1.0
    sizes = sets.sum(axis=2, keepdims=True)  # [S, L, 1]
    out = np.zeros(sets.shape)
    for a in range(0, len(unions), chunk_steps):
        b = min(a + chunk_steps, len(unions))
        agent = CompactTransition(table.snapshot())
        out[a:b, 0] = agent.marginal(0)
        for layer in range(1, num_layers):
            src, n = sets[a:b, layer - 1], sizes[a:b, layer - 1]  # [n, E], [n, 1]
            out[a:b, layer] = np.where(n > 0, src @ agent.dense_rows(layer - 1) / np.maximum(n, 1.0),
                                       agent.marginal(layer))
        table.observe_steps(sets[a:b])
    return out
