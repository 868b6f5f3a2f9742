"""The reference MoE decoder: one forward over a batch of sequence segments (inference process).

Rows of the batch are grouped in `Segment`s (one per sequence: a prefill chunk or one decode token).
Each layer: RMSNorm -> attention over the paged KV cache -> RMSNorm -> MoE (routed experts from the
slot pool + shared experts) or a dense MLP. Logits are returned for the last row of each segment.

A forward is cut into pieces at the MoE layers: piece p runs everything from MoE layer p-1's experts up to
MoE layer p's routing (piece 0 starts at the embedding, the last piece ends with the LM head), so a caller may
make experts resident between pieces (piecewise CUDA graphs, graphs.py). `forward` runs them all eagerly,
asking the provider for each layer's experts. Forced routes (hooks.py) replace the router's choice without
changing anything else. Never moves experts or KV blocks itself: it asks the provider and the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tierplan.runtime.engine.attention import MassObserver, Segment, attention, mixed_meta, rms_norm, step_meta
from tierplan.runtime.engine.config import AttentionKind, ModelSpec
from tierplan.runtime.engine.hooks import ForcedRoutes, ModelHooks, RouteTap, StepRouting
from tierplan.runtime.engine.kv_cache import PagedKVCache
from tierplan.runtime.engine.moe import ExpertProvider, ExpertViews, mlp, moe_forward, route
from tierplan.runtime.engine.weights import DenseWeights, expert_format
from tierplan.runtime.memory.slots import ExpertSlotPool


@dataclass
class FwdState:
    """The working tensors of one forward between pieces (in a piecewise graph, static graph tensors)."""

    positions: torch.Tensor  # [N]
    segments: list[Segment]
    meta: Any  # StepMeta, shared by every layer
    x: torch.Tensor  # [N, H] residual stream
    h: torch.Tensor | None = None  # [N, H] the pending MoE layer's normed input
    ids: torch.Tensor | None = None  # [n, k] its routes (n real rows, or N with graph rows)
    wts: torch.Tensor | None = None  # [n, k]
    logits: torch.Tensor | None = None  # [S, V] float32 after the last piece


class MoEModel:
    def __init__(self, spec: ModelSpec, weights: DenseWeights, pool: ExpertSlotPool, provider: ExpertProvider,
                 cache: PagedKVCache, hooks: ModelHooks | None = None, table_reads: bool = False) -> None:
        """table_reads: static MoE layers (piecewise pieces) read experts through the pool's slot table."""
        if table_reads and pool.reads.table is None:
            raise ValueError("MoEModel(table_reads=True) needs a pool with a slot window (its slot table)")
        self.spec, self.w, self.pool, self.provider, self.cache = spec, weights, pool, provider, cache
        self.table_reads = table_reads
        self.pool_layer = {layer: i for i, layer in enumerate(spec.moe_layers)}
        self.moe_layers = sorted(self.pool_layer)
        fmt = expert_format(spec)
        self.views = {layer: ExpertViews(pool, fmt, i) for layer, i in self.pool_layer.items()}
        self._hooks = hooks or ModelHooks()

    # ---- hooks (read-only from outside: ReferenceEngine.set_hooks replaces them) --------------------------
    @property
    def hooks(self) -> ModelHooks:
        return self._hooks

    def set_hooks(self, hooks: ModelHooks) -> None:
        self._hooks = hooks

    @property
    def route_tap(self) -> RouteTap | None:
        return self._hooks.route_tap

    @property
    def mass_observer(self) -> MassObserver | None:
        return self._hooks.mass_observer

    @property
    def forced_routes(self) -> ForcedRoutes | None:
        return self._hooks.forced_routes

    @property
    def decode_kernel(self) -> bool:
        return self._hooks.decode_kernel

    @property
    def num_pieces(self) -> int:
        return len(self.moe_layers) + 1

    # ---- pieces ---------------------------------------------------------------------------------------
    def start(self, tokens: torch.Tensor, positions: torch.Tensor, segments: list[Segment]) -> FwdState:
        decode = self.decode_kernel and all(s.num_tokens == 1 for s in segments)
        meta = step_meta(positions, segments, self.cache, self.spec, decode)  # shared by every layer
        if self.decode_kernel and not decode and self.spec.attention is AttentionKind.GQA \
                and not self.spec.sliding_window:  # prefill beside decodes: the decodes still go to the kernel
            meta = mixed_meta(meta, positions, segments, self.cache, self.spec)
        return FwdState(positions, segments, meta, self.w.embed[tokens])  # x [N, H]

    def front(self, st: FwdState, p: int, routing: StepRouting, observer: MassObserver | None,
              live_rows: int | None = None) -> None:
        """Piece p after its MoE: the layers up to MoE layer p's routing (or, for the last piece, to the head)."""
        spec, last = self.spec, p == len(self.moe_layers)
        lo = 0 if p == 0 else self.moe_layers[p - 1] + 1
        hi = spec.num_layers if last else self.moe_layers[p]
        for i in range(lo, hi + (0 if last else 1)):
            lw = self.w.layers[i]
            x = st.x
            h = rms_norm(x, lw.input_norm, spec.rms_norm_eps)
            x = x + attention(h, lw.attn, st.positions, st.segments, self.cache, i, spec, self.decode_kernel,
                              observer, st.meta)
            h = rms_norm(x, lw.post_attn_norm, spec.rms_norm_eps)
            if lw.router is None:
                assert lw.dense is not None
                st.x = x + mlp(h, lw.dense)
                continue
            st.x, st.h = x, h
            n = h.shape[0] if live_rows is None else live_rows
            st.ids, st.wts = self._route(h, i, routing, n)
            if routing.route_out is None and self.route_tap is not None:
                self.route_tap(i, st.ids, st.wts)
        if last:
            st.logits = self._head(st.x, st.segments)

    def finish_moe(self, st: FwdState, p: int, static: bool = False, table: bool = False) -> None:
        """MoE layer p's routed experts (asked of the provider, unless `static`: the caller made the routed
        experts resident and ordered, and one grouped GEMM pair over the layer's range reads only those; with
        `table` too, through the slot table the caller synced: a piecewise piece) plus its shared experts, added
        to the residual."""
        i = self.moe_layers[p]
        h, ids, wts = st.h, st.ids, st.wts
        assert h is not None and ids is not None and wts is not None
        n = ids.shape[0]
        out = moe_forward(h[:n], ids, wts, self.views[i], self.pool_layer[i], self.provider,
                          kernel_rows=h.shape[0] * ids.shape[1], static=static,
                          table=static and table and self.table_reads)
        if n < h.shape[0]:
            out = torch.cat([out, out.new_zeros(h.shape[0] - n, out.shape[1])])  # padding rows: no experts
        lw = self.w.layers[i]
        if lw.shared is not None:
            out = out + mlp(h, lw.shared)
        st.x = st.x + out
        st.h = st.ids = st.wts = None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
                live_rows: int | None = None, routing: StepRouting | None = None) -> torch.Tensor:
        """tokens, positions [N] -> logits [S, V] (float32) for the last row of each of the S segments.

        live_rows: only the first `live_rows` rows are real (a decode batch padded to a CUDA-graph bucket and
        run eagerly): dense layers see all N rows, as the graph does, while routed experts are fetched and
        computed for the real rows only (each row's expert output is independent of the others)."""
        routing = routing or StepRouting()
        st = self.start(tokens, positions, segments)
        for p in range(self.num_pieces):
            if p:
                self.finish_moe(st, p - 1)
            self.front(st, p, routing, self.mass_observer, live_rows)
        assert st.logits is not None
        return st.logits

    # ---- helpers --------------------------------------------------------------------------------------
    def _route(self, h: torch.Tensor, layer: int, r: StepRouting, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [n, k] int64, weights [n, k] float32 for MoE `layer` (see StepRouting)."""
        lw, m, table = self.w.layers[layer], self.pool_layer[layer], self.forced_routes
        if r.forced and r.forced_mask is None:
            assert table is not None and r.trace_rows is not None, "forced routes need a table and trace rows"
            rows = r.trace_rows[:n]
            return table.ids[rows, m], table.weights[rows, m]
        assert lw.router is not None
        if r.route_out is None:
            ids, wts = route(h, lw.router, self.spec, bias=lw.router_bias)
            return ids[:n], wts[:n]
        probs_out, ids_out = r.route_out[0][m], r.route_out[1][m]  # [N, k]
        ids, wts = route(h, lw.router, self.spec, out=(probs_out, ids_out), bias=lw.router_bias)
        if r.forced_mask is not None:
            assert table is not None and r.trace_rows is not None
            if r.forced_rows is not None:
                f_ids, f_w = r.forced_rows[0][:, m], r.forced_rows[1][:, m]  # [N, k] views of the step's gather
            else:
                f_ids, f_w = table.ids[r.trace_rows, m], table.weights[r.trace_rows, m]  # [N, k]
            # Three kernels a layer, written in place: the tap's buffers hold the routes used.
            ids = torch.where(r.forced_mask, f_ids, ids, out=ids_out)
            wts = torch.where(r.forced_mask, f_w, wts)
            torch.where(r.forced_mask, f_w, probs_out, out=probs_out)
        if r.row_src is not None:
            ids, wts = ids[r.row_src], wts[r.row_src]
        return ids[:n], wts[:n]

    def _head(self, x: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        if all(s.num_tokens == 1 and s.row_start == r for r, s in enumerate(segments)) and len(segments) == len(x):
            last_rows = x  # decode: every row is a segment's last (no host-made index: CUDA-graph safe)
        else:
            last = torch.tensor([s.row_start + s.num_tokens - 1 for s in segments], device=x.device)
            last_rows = x[last]
        h = rms_norm(last_rows, self.w.final_norm, self.spec.rms_norm_eps)
        return (h @ self.w.lm_head.t()).float()  # [S, V]

