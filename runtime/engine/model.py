"""The reference MoE decoder: one forward over a batch of sequence segments (inference process).

Rows of the batch are grouped in `Segment`s (one per sequence: a prefill chunk or one decode token).
Each layer: RMSNorm -> attention over the paged KV cache -> RMSNorm -> MoE (routed experts from the
slot pool + shared experts) or a dense MLP. Logits are returned for the last row of each segment.
`forced_routes` replaces the router's choice (real routing traces drive synthetic weights) without
changing anything else. Never moves experts or KV blocks itself: it asks the provider and the cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from runtime.engine.attention import MassObserver, Segment, attention, rms_norm, step_meta
from runtime.engine.config import ModelSpec
from runtime.engine.kv_cache import PagedKVCache
from runtime.engine.moe import ExpertProvider, ExpertViews, mlp, moe_forward, route
from runtime.engine.weights import DenseWeights, expert_format
from runtime.memory.slots import ExpertSlotPool

# (model layer, token rows [N]) -> (ids [N, k] int64, weights [N, k] float32) or None to use the router
ForcedRoutes = Callable[[int, int], tuple[torch.Tensor, torch.Tensor] | None]
RouteTap = Callable[[int, torch.Tensor, torch.Tensor], None]  # (layer, ids [N, k], weights [N, k])


class MoEModel:
    def __init__(self, spec: ModelSpec, weights: DenseWeights, pool: ExpertSlotPool, provider: ExpertProvider,
                 cache: PagedKVCache) -> None:
        self.spec, self.w, self.pool, self.provider, self.cache = spec, weights, pool, provider, cache
        self.pool_layer = {layer: i for i, layer in enumerate(spec.moe_layers)}
        fmt = expert_format(spec)
        self.views = {layer: ExpertViews(pool, fmt, i) for layer, i in self.pool_layer.items()}
        self.forced_routes: ForcedRoutes | None = None
        self.decode_kernel = False  # decode batches through the Triton paged kernel (the engine turns it on)
        self.mass_observer: MassObserver | None = None  # the agent's sampled attention-mass tap
        self.route_tap: RouteTap | None = None
        # CUDA-graph mode: (probs, ids) [L_moe, N, k] buffers that every MoE layer's router writes its raw
        # top-k into (instead of calling route_tap per layer); the graph runner hands them to the tap.
        self.route_out: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
                live_rows: int | None = None) -> torch.Tensor:
        """tokens, positions [N] -> logits [S, V] (float32) for the last row of each of the S segments.

        live_rows: only the first `live_rows` rows are real (a decode batch padded to a CUDA-graph bucket and
        run eagerly): dense layers see all N rows, as the graph does, while routed experts are fetched and
        computed for the real rows only (each row's expert output is independent of the others)."""
        spec = self.spec
        x = self.w.embed[tokens]  # [N, H]
        decode = self.decode_kernel and all(s.num_tokens == 1 for s in segments)
        meta = step_meta(positions, segments, self.cache, spec, decode)  # shared by every layer
        for i, lw in enumerate(self.w.layers):
            h = rms_norm(x, lw.input_norm, spec.rms_norm_eps)
            x = x + attention(h, lw.attn, positions, segments, self.cache, i, spec, self.decode_kernel,
                              self.mass_observer, meta)
            h = rms_norm(x, lw.post_attn_norm, spec.rms_norm_eps)
            if lw.router is None:
                assert lw.dense is not None
                x = x + mlp(h, lw.dense)
                continue
            n = h.shape[0] if live_rows is None else live_rows
            forced = self.forced_routes(i, n) if self.forced_routes is not None else None
            if forced is not None:
                ids, wts = forced
            elif self.route_out is not None:
                m = self.pool_layer[i]
                ids, wts = route(h, lw.router, spec, out=(self.route_out[0][m], self.route_out[1][m]))
            else:
                ids, wts = route(h, lw.router, spec)
            ids, wts = ids[:n], wts[:n]
            if self.route_tap is not None and self.route_out is None:
                self.route_tap(i, ids, wts)
            out = moe_forward(h[:n], ids, wts, self.views[i], self.pool_layer[i], self.provider,
                              kernel_rows=h.shape[0] * ids.shape[1])
            if n < h.shape[0]:
                out = torch.cat([out, out.new_zeros(h.shape[0] - n, out.shape[1])])  # padding rows: no experts
            if lw.shared is not None:
                out = out + mlp(h, lw.shared)
            x = x + out
        if all(s.num_tokens == 1 and s.row_start == r for r, s in enumerate(segments)) and len(segments) == len(x):
            last_rows = x  # decode: every row is a segment's last (no host-made index: CUDA-graph safe)
        else:
            last = torch.tensor([s.row_start + s.num_tokens - 1 for s in segments], device=x.device)
            last_rows = x[last]
        h = rms_norm(last_rows, self.w.final_norm, spec.rms_norm_eps)
        return (h @ self.w.lm_head.t()).float()  # [S, V]
