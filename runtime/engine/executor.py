"""How a reference-engine step runs: the executor picked for it, the reason, and the piecewise residency work.

Runs in the inference process, on the engine thread. `pick` chooses, per step, between the whole-step CUDA
graph (every expert resident), the piecewise graphs (experts missing: each MoE layer's misses are made
resident between its pieces) and eager execution (padded to the graph's bucket where the step fits the
graph's buffers, so which executor runs never changes a bit), and says why with a `Reason`. `PieceResidency`
is the host work between pieces: the layer's misses loaded as one list (`OnDemandExperts.ensure`; with slot-table
reads, `EngineConfig.expert_reads="table"`, a miss is ready once its copy is issued, before its range is
mapped, and the pieces' GEMMs find it through the table), the stream ordered after them, their reads
recorded, and, as a mode (`lookahead_layers`), the next layers' experts
started loading while this one computes (FluxMoE's window). Routes come from the forced table's host copy
when the step is forced (nothing is read back), else from the piece that routed them (one host sync per
layer); the window's later layers are then predicted by the last step's routes. Never decides placement
beyond the provider's victim order, never changes what a step computes.
"""

from __future__ import annotations

from collections import Counter
from enum import Enum

import numpy as np
import torch

from tierplan.runtime.engine.experts import OnDemandExperts
from tierplan.runtime.engine.model import MoEModel


class Executor(Enum):
    GRAPH = "graph"  # the whole decode step replayed from one CUDA graph
    PIECEWISE = "piecewise"  # per-MoE-layer graphs, residency work between them
    EAGER = "eager"  # kernels launched one by one (padded to the bucket where the step fits the buffers)


class Reason(Enum):
    """Why a step runs on its executor (GRAPH: none needed; the rest are counted fallbacks)."""

    ALL_RESIDENT = "all_resident"  # graph
    EXPERTS_MISSING = "experts_missing"  # piecewise
    PREFILL = "prefill"
    NO_GRAPHS = "no_graphs"  # EngineConfig.decode_graphs off
    NO_PAGED_DECODE_KERNEL = "no_paged_decode_kernel"
    BATCH_TOO_LARGE = "batch_too_large"
    CONTEXT_TOO_LONG = "context_too_long"
    CAPTURE_FAILED = "capture_failed"
    OFFLOAD_EAGER = "offload_eager"  # experts missing and EngineConfig.offload_exec="eager"
    LAYER_OVER_SLOTS = "layer_over_slots"  # a layer may need more experts than the free slots: chunked eager
    GEMM_READS_EVERY_EXPERT = "gemm_reads_every_expert"  # the layer's GEMM is not the routed-only kernel


PADDED = frozenset({Reason.OFFLOAD_EAGER, Reason.LAYER_OVER_SLOTS, Reason.GEMM_READS_EVERY_EXPERT,
                    Reason.CAPTURE_FAILED})  # eager steps that fit the graph's buffers run over its padded rows


class ExecutorStats:
    """Steps by executor and by reason (the engine's `executors` / `reasons`)."""

    def __init__(self) -> None:
        self.runs: Counter[tuple[Executor, Reason]] = Counter()  # steps by (executor, reason)

    @property
    def steps(self) -> Counter[Executor]:
        return Counter({x: sum(n for (e, _), n in self.runs.items() if e is x) for x, _ in self.runs})

    @property
    def reasons(self) -> Counter[Reason]:
        return Counter({r: sum(n for (_, q), n in self.runs.items() if q is r) for _, r in self.runs})

    def count(self, executor: Executor, reason: Reason) -> None:
        self.runs[executor, reason] += 1

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {"steps": {e.value: self.steps[e] for e in Executor},
                "reasons": {r.value: n for r, n in self.reasons.items()}}


def known_routes(model: MoEModel, trace_rows: list[int] | None) -> list[list[int]] | None:
    """Per MoE layer (pool order) the sorted experts a forced step's real rows use, from the table's host copy."""
    table = model.forced_routes
    if table is None or trace_rows is None:
        return None
    ids = table.ids_host[np.asarray(trace_rows, dtype=np.int64)]  # [B, L, k]
    return [np.unique(ids[:, m]).tolist() for m in range(ids.shape[1])]


class PieceResidency:
    """The host work between a piecewise step's pieces (see the module docstring)."""

    def __init__(self, model: MoEModel, experts: OnDemandExperts, lookahead_layers: int = 0) -> None:
        self.model, self.experts, self.lookahead = model, experts, lookahead_layers
        self.table = model.table_reads  # the pieces read through the slot table: a miss is ready once issued
        n = len(model.moe_layers)
        self._last: list[list[int] | None] = [None] * n  # last step's routes per MoE layer (the window's guess)
        self._known: list[list[int]] | None = None
        self._used: list[list[int] | None] = [None] * n
        self._started: set[int] = set()  # MoE layers whose window prefetch was issued this step
        self.route_syncs = 0  # routes read back from the device (live routing)

    def begin(self, known: list[list[int]] | None) -> None:
        self._known, self._started = known, set()
        self._used = [None] * len(self._used)

    def fits(self, known: list[list[int]] | None, batch: int) -> bool:
        """Whether every layer's experts fit the slots at once (live routing: any `batch` rows' routes must)."""
        pool_layers = [self.model.pool_layer[m] for m in self.model.moe_layers]
        if known is None:  # layer limits: any routes must fit
            caps = [self.experts.capacity_of(pl) for pl in pool_layers]
            return min(caps) >= min(self.experts.pool.layout.num_experts, batch * max(1, self.model.spec.top_k))
        return all(len(k) <= self.experts.capacity_of(pl, k) for k, pl in zip(known, pool_layers, strict=True))

    def _needs(self, p: int) -> list[int] | None:
        return self._known[p] if self._known is not None else self._used[p] or self._last[p]

    def before_moe(self, p: int, routes: torch.Tensor) -> None:
        """MoE layer p's routed experts resident and ordered before the piece that reads them."""
        if self._known is not None:
            need = self._known[p]
        else:
            need = np.unique(routes.cpu().numpy()).tolist()  # [b, k] -> sorted ids (one host sync)
            self.route_syncs += 1
        self._used[p] = need
        m = self.model.moe_layers[p]
        pl = self.model.pool_layer[m]
        window = [q for q in range(p + 1, min(len(self._used), p + 1 + self.lookahead))]
        soon = {(pl, e) for e in need}
        for q in window:
            soon |= {(self.model.pool_layer[self.model.moe_layers[q]], e) for e in (self._needs(q) or [])}
        self.experts.soon = frozenset(soon)
        self.experts.ensure(pl, need, table=self.table)
        for q in window:
            if q in self._started:
                continue
            guess = self._needs(q)
            if guess:
                self._started.add(q)
                self.experts.prefetch(self.model.pool_layer[self.model.moe_layers[q]], guess)

    def after_moe(self, p: int) -> None:
        m = self.model.moe_layers[p]
        need = self._used[p] or []
        self.experts.done_reading(self.model.pool_layer[m], need)
        self._last[p] = need
