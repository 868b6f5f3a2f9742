"""The plan's local predictor, run by the agent one MoE layer ahead (inference process, engine thread, mid-step).

Per-token, per-layer prefetch is far below a controller round trip, so the `Plan` carries a small transition
table (`controller.protocol.LocalPredictor`) and a prefetch byte budget per step. This module sits on the
router's route hook: when MoE layer l has routed the step's tokens, it scores layer l+1's experts from the
table (per token, the best successor probability over its experts; over the step, 1 - prod(1 - p)) and
prefetches those at or above the table's `min_score`, most likely first, through the expert provider's
loader (`load_async`, room made by the local policy's `make_rooms`, so the plan's caps and pins hold), while
layer l computes. It never spends more than the plan's bytes per step, and counts what it issued, skipped (and
why) and wasted (prefetched for a step whose layer then did not need it). Only eager steps route mid-step: a
CUDA graph replay (whole or piecewise) hands every layer's routes over once it has run (`observe_all`), and
those are observed only, since a prefetch after the layer could only be wasted (H200 phase run 12: 351 issued
that way, none used).

It also observes: per window, the cross-layer pairs (`LayerTransitions`) the controller trains the table
from, and each step's per-layer expert unions (`LayerUnions`) for the miss-ratio curves at batch B. Observing
stays on the routes' device (a used-experts mask and pair counts, copied to the host once a step and once a
window); a layer that prefetches copies its routes to the host mid-step, which stalls the launches behind it
until the GPU catches up, so the adapter runs this only when asked (`local_predictor=True`).
It must never talk to the network, decide a plan, or change what a kernel computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tierplan.agent.local_policy import LocalPolicy
from tierplan.controller.protocol import (
    MAX_PAIRS_PER_LAYER,
    MAX_UNION_STEPS,
    LayerTransitions,
    LayerUnions,
    Plan,
    TransitionPair,
)
from tierplan.runtime.engine.experts import OnDemandExperts
from tierplan.runtime.errors import RuntimeTierError
from tierplan.runtime.memory.slots import ExpertState
from tierplan.runtime.transfer import Priority

PAIR_ROWS = 64  # rows a step whose cross-layer pairs are counted (see `_count_pairs`)
COUNTERS = ("issued", "useful", "wasted", "skipped_resident", "skipped_budget", "skipped_no_slot", "failed")


def _normal_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A normal tensor, never an inference one: eager steps call the hook inside `torch.inference_mode`, graph
    replays outside it, and a window's counts are written by both (as agent/taps.py's buffers are)."""
    with torch.inference_mode(False):
        return torch.zeros(shape, dtype=dtype, device=device)


@dataclass(frozen=True)
class PredictorWindow:
    """One window of the predictor's observations as host arrays. `fields()` builds its Telemetry v2 parts (any
    thread: the adapter's outbox): the parts are made from arrays whose shape guarantees what their validators
    check (pairs unique, ids in range, one union per step, sorted and distinct), so they are constructed without
    re-validation; the Telemetry around them still checks them against the model (`check_unions`), and every
    process boundary (JSON) validates them whole. With thousands of pairs a window, validating each one in the
    engine's process cost 8-40 ms a window (2-core CPU box, 1,500-4,096 pairs a layer), under the GIL the
    engine thread needs (bench/results/phase_h200.md, runs 15-16)."""

    moe_layers: tuple[int, ...]
    num_experts: int
    pairs: np.ndarray | None  # [M - 1, E * E] float32 weighted pair counts (None: no pair counted)
    pair_tokens: np.ndarray  # [M - 1] tokens counted per row
    unions: np.ndarray  # [S, M, E] bool: the experts each layer used, per recorded step
    batch_tokens: tuple[int, ...]  # [S] each recorded step's tokens
    local_prefetch: dict[str, int]

    def fields(self) -> dict[str, Any]:
        e, transitions = self.num_experts, []
        for m in np.flatnonzero(self.pair_tokens) if self.pairs is not None else ():
            flat = np.rint(self.pairs[m])  # [E * E]
            nz = np.flatnonzero(flat)
            top = nz[np.argsort(-flat[nz], kind="stable")[:MAX_PAIRS_PER_LAYER]]  # most common first
            pairs = tuple(map(TransitionPair._make, zip((top // e).tolist(), (top % e).tolist(),
                                                        flat[top].astype(np.int64).tolist(), strict=True)))
            transitions.append(LayerTransitions.model_construct(
                layer=self.moe_layers[m], next_layer=self.moe_layers[m + 1], num_tokens=int(self.pair_tokens[m]),
                pairs=pairs))
        unions = [LayerUnions.model_construct(layer=layer, batch_tokens=self.batch_tokens,
                                              unions=tuple(tuple(np.flatnonzero(row).tolist())
                                                           for row in self.unions[:, m]))
                  for m, layer in enumerate(self.moe_layers)] if self.batch_tokens else []
        return {"transitions": tuple(transitions), "step_unions": tuple(unions),
                "local_prefetch": dict(self.local_prefetch)}


class LayerAheadPredictor:
    """See the module docstring. Layers here are model layers; the pool's index is looked up per call."""

    def __init__(self, moe_layers: tuple[int, ...], num_experts: int, experts: OnDemandExperts,
                 policy: LocalPolicy, stride_bytes: int) -> None:
        self.moe_layers, self.num_experts = tuple(moe_layers), num_experts
        self.experts, self.policy, self.stride_bytes = experts, policy, stride_bytes
        self._pool = {layer: i for i, layer in enumerate(self.moe_layers)}
        self._next = dict(zip(self.moe_layers, self.moe_layers[1:], strict=False))  # layer -> next MoE layer
        self.table: dict[int, np.ndarray] = {}  # src model layer -> [E, E] P(dst at next layer | src)
        self.min_score, self.budget_bytes, self.version = 1.0, 0, 0
        self.counts = dict.fromkeys(COUNTERS, 0)
        self._reported = dict.fromkeys(COUNTERS, 0)  # counts at the last window (telemetry carries the deltas)
        self._spent_bytes = 0
        self._prev: tuple[int, torch.Tensor] | None = None  # (layer, [N, k] routes on their device) of this step
        self._issued_for: dict[int, set[int]] = {}  # model layer -> experts prefetched for it this step
        self._used: torch.Tensor | None = None  # [M, E] bool on the routes' device: experts each layer used
        self._ran: set[int] = set()  # model layers routed this step
        self._step_tokens = 0
        self._pairs: torch.Tensor | None = None  # [M - 1, E * E] pair counts this window (routes' device)
        self._pair_tokens = np.zeros(max(0, len(self.moe_layers) - 1), np.int64)  # [M - 1] tokens counted
        self._union_rows: list[np.ndarray] = []  # per step [M, E] bool: the experts each layer used
        self._batch: list[int] = []

    # ---- plan ------------------------------------------------------------------------------------------
    def install(self, plan: Plan) -> None:
        """Take an applied plan's table and budget (a plan without one switches prefetching off)."""
        pred, table = plan.local_predictor, {}
        if pred is not None:
            for row in pred.rows:
                if row.layer not in self._next:  # a row for the last MoE layer (or a dense one) predicts nothing
                    continue
                probs = table.setdefault(row.layer, np.zeros((self.num_experts, self.num_experts)))  # [E, E]
                for s in row.next:
                    if row.src < self.num_experts and s.expert < self.num_experts:
                        probs[row.src, s.expert] = s.prob
        self.table = table
        self.min_score = pred.min_score if pred is not None else 1.0
        self.version = pred.version if pred is not None else 0
        self.budget_bytes = plan.prefetch_budget_bytes_per_step if pred is not None else 0

    # ---- the route hook --------------------------------------------------------------------------------
    def on_route(self, layer: int, ids: torch.Tensor) -> None:
        """MoE layer `layer` routed this step's rows to `ids` [N, k]; observe, then prefetch for the next layer.
        Observing stays on the routes' device (no host copy, so the step's launches run ahead of the GPU); only a
        layer that prefetches copies its routes to the host, because it must choose experts now."""
        if layer == self.moe_layers[0]:
            self._step_tokens = int(ids.shape[0])
        ids = ids.long()  # a no-op for int64 routes
        self._used_mask(ids.device)[self._pool[layer]].index_fill_(0, ids.reshape(-1), True)
        self._ran.add(layer)
        if self._prev is not None and self._next.get(self._prev[0]) == layer and self._prev[1].shape[0] == ids.shape[0]:
            self._count_pairs(self._prev[0], self._prev[1], ids)
        self._prev = (layer, ids)
        nxt = self._next.get(layer)
        if nxt is not None and layer in self.table and self.budget_bytes > 0:
            rows = ids.cpu().numpy()  # [N, k] the host copy (see the module docstring)
            self._prefetch(layer, nxt, rows, set(np.unique(rows).tolist()))

    def observe_all(self, ids: torch.Tensor) -> None:
        """Every MoE layer's routes of a step that has already run, ids [L, N, k] in `moe_layers` order (a CUDA
        graph replay's static buffers, read before the next replay): what `on_route` observes layer by layer, in
        one scatter for the masks, and no prefetch (every layer has computed: a prefetch now could only be
        wasted, and would count against the precision the controller judges the table by)."""
        ids = ids.long()
        self._step_tokens = int(ids.shape[1])
        self._used_mask(ids.device).scatter_(1, ids.reshape(len(self.moe_layers), -1), True)
        self._ran.update(self.moe_layers)
        if len(self.moe_layers) > 1 and ids.shape[1]:  # each MoE layer and the next one, in one update
            self._count_all_pairs(ids[:-1], ids[1:], 0)
        self._prev = None

    def _used_mask(self, device: torch.device) -> torch.Tensor:
        """[M, E] the step's used experts per MoE layer, on the routes' device (made at a step's first route)."""
        if self._used is None or self._used.device != device:
            self._used = _normal_zeros((len(self.moe_layers), self.num_experts), torch.bool, device)
        return self._used

    def _pair_counts(self, device: torch.device) -> torch.Tensor:
        """[M - 1, E * E] the window's pair counts, row m for MoE layer m and the next (made at first use)."""
        if self._pairs is None or self._pairs.device != device:
            self._pairs = _normal_zeros((len(self._pair_tokens), self.num_experts ** 2), torch.float32, device)
        return self._pairs

    def _count_pairs(self, layer: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Each row's (expert at `layer`, expert at the next MoE layer) pairs, into the dense counts on the
        routes' device (see `_count_all_pairs`)."""
        if int(src.shape[0]):
            m = self._pool[layer]
            self._count_all_pairs(src.unsqueeze(0), dst.unsqueeze(0), m)

    def _count_all_pairs(self, src: torch.Tensor, dst: torch.Tensor, first: int) -> None:
        """src, dst [P, N, k]: pairs of MoE layers first .. first + P - 1 with their next ones, in one index_add.
        At most PAIR_ROWS rows a step, evenly spaced and weighted to stand for all N: a prefill's thousand rows
        would otherwise cost ~10^5 updates a layer, for a table that is an average anyway."""
        n, e = int(src.shape[1]), self.num_experts
        if n > PAIR_ROWS:
            pick = torch.linspace(0, n - 1, PAIR_ROWS, device=src.device).round().long()
            src, dst = src.index_select(1, pick), dst.index_select(1, pick)
        rows = torch.arange(first, first + src.shape[0], device=src.device) * (e * e)  # [P] each layer's offset
        idx = (src.unsqueeze(3) * e + dst.unsqueeze(2)).reshape(src.shape[0], -1) + rows.unsqueeze(1)  # [P, R*k*k]
        idx = idx.reshape(-1)
        self._pair_counts(idx.device).view(-1).index_add_(
            0, idx, torch.ones(idx.shape, dtype=torch.float32, device=idx.device), alpha=n / src.shape[1])
        self._pair_tokens[first:first + src.shape[0]] += n

    def _prefetch(self, layer: int, nxt: int, rows: np.ndarray, union: set[int]) -> None:
        probs = self.table[layer]  # [E, E]
        best = probs[rows.astype(np.int64, copy=False)].max(axis=1)  # [N, E] best successor prob per token
        score = 1.0 - np.prod(1.0 - best, axis=0)  # [E] P(needed by at least one token)
        m, m_next = self._pool[layer], self._pool[nxt]
        protect = frozenset({(m, e) for e in union})
        wanted = [int(e) for e in np.argsort(-score, kind="stable") if score[e] >= self.min_score]
        protect |= {(m_next, e) for e in wanted}
        todo = []
        for e in wanted:
            if self.experts.pool.state(m_next, e) is not ExpertState.ABSENT:
                self.counts["skipped_resident"] += 1
            elif self._spent_bytes + (len(todo) + 1) * self.stride_bytes > self.budget_bytes:
                self.counts["skipped_budget"] += 1
            else:
                todo.append(e)
        # Room for the whole list at once, most likely first (one ranking of the candidates, not one per load).
        room = self.policy.make_rooms(m_next, len(todo), protect=protect)
        self.counts["skipped_no_slot"] += len(todo) - room
        for e in todo[:room]:
            try:
                self.experts.load_async(m_next, e, priority=Priority.HIGH)
            except RuntimeTierError:
                self.counts["failed"] += 1
                continue
            self._spent_bytes += self.stride_bytes
            self._issued_for.setdefault(nxt, set()).add(e)
            self.counts["issued"] += 1

    def end_step(self) -> None:
        """Between steps (the step's own sync is behind us): one host copy of the step's experts per layer closes
        its books: a prefetch its layer used is useful, one it did not use (or whose layer never ran) wasted."""
        used = self._used.cpu().numpy() if self._used is not None and self._ran else None  # [M, E]
        for layer, experts in self._issued_for.items():
            hit = 0 if used is None or layer not in self._ran else int(used[self._pool[layer], sorted(experts)].sum())
            self.counts["useful"] += hit
            self.counts["wasted"] += len(experts) - hit
        self._issued_for.clear()
        if used is not None and len(self._batch) < MAX_UNION_STEPS:
            self._union_rows.append(np.array(used, dtype=bool))  # the ids are listed off this thread
            self._batch.append(self._step_tokens)
        self._used = None  # a fresh mask next step
        self._ran.clear()
        self._prev, self._spent_bytes = None, 0

    # ---- the window --------------------------------------------------------------------------------------
    def window_snapshot(self) -> PredictorWindow:
        """Engine thread, between steps: the window so far as host arrays (one copy of the pair counts); resets.
        Its Telemetry v2 fields are built by `PredictorWindow.fields` off this thread."""
        pairs = self._pairs.cpu().numpy() if self._pairs is not None else None  # [M - 1, E * E]
        unions = (np.stack(self._union_rows) if self._union_rows
                  else np.zeros((0, len(self.moe_layers), self.num_experts), bool))  # [S, M, E]
        counts = {k: self.counts[k] - self._reported[k] for k in COUNTERS}
        snap = PredictorWindow(self.moe_layers, self.num_experts, pairs, self._pair_tokens.copy(), unions,
                               tuple(self._batch), {"table_version": self.version, **counts})
        self._pairs = None
        self._pair_tokens[:] = 0
        self._union_rows, self._batch = [], []
        self._reported = dict(self.counts)
        return snap

    def window_fields(self) -> dict[str, Any]:
        """Telemetry v2 fields of the window so far, built here (tests; the adapter defers `fields`); resets."""
        return self.window_snapshot().fields()

    def stats(self) -> dict[str, int]:
        return {**self.counts, "table_version": self.version, "budget_bytes_per_step": self.budget_bytes}
