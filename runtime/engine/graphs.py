"""CUDA graphs of the decode step (inference process, engine thread).

A decode step in which every expert is resident and every KV block is on the GPU has no host decision
inside it, so it is captured once per padded batch size (a bucket) and replayed: one launch instead of
~35 kernels per layer. Static inputs are tokens [Bb], positions [Bb] and the block table [Bb, M], copied in
from pinned staging buffers before each replay; padding rows decode token 0 at position 0 into the cache's
scratch block, which no sequence owns. Every MoE layer's router writes its raw top-k into static buffers
[L, Bb, k] (the agent's tap reads them after the replay: no tap kernel inside the graph), and the queries
of the layers the attention-mass observer may sample are saved (one copy per watched layer).

On a CPU there is nothing to capture: the same static-buffer step runs eagerly (`capture=False`), which is
how CI checks the padding, staging and tap logic. Whatever the graph cannot run (a prefill, a missing
expert, forced routes, MLA, a batch or context beyond the buffers) runs eagerly and the reason is counted
in `fallbacks`; a decode step that misses an expert or has forced routes runs eagerly over the same padded
rows (`run(replay=False)`), so whether a step replays never changes its bits.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.device import Device, Event
from runtime.engine.attention import QCapture, Segment, observe
from runtime.engine.config import AttentionKind
from runtime.engine.model import MoEModel

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None  # None: the CPU twin re-runs the forward on the static buffers
    logits: torch.Tensor  # [Bb, V] float32, rewritten by every replay
    saved_q: dict[int, torch.Tensor]  # watched layer -> [Bb, Hq, D]


class DecodeGraphs:
    def __init__(self, model: MoEModel, device: Device, max_batch: int, max_blocks: int, capture: bool) -> None:
        if max_batch < 1 or max_blocks < 1:
            raise ValueError(f"DecodeGraphs: max_batch={max_batch} and max_blocks={max_blocks} must be >= 1")
        self.model, self.device, self.capture = model, device, capture
        self.cache = model.cache
        self.buckets = sorted({b for b in BUCKETS if b < max_batch} | {max_batch})
        self.max_batch, self.max_blocks = max_batch, max_blocks
        dev, n, spec = device.torch_device, max_batch, model.spec
        self.tokens = torch.zeros(n, dtype=torch.int64, device=dev)  # [Bmax]
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)  # [Bmax]
        self.table = torch.full((n, max_blocks), self.cache.scratch_slot, dtype=torch.int32, device=dev)  # [Bmax, M]
        pin = device.is_cuda
        self._stage_ids = torch.zeros(2, n, dtype=torch.int64, pin_memory=pin)  # tokens, positions
        self._stage_table = torch.full((n, max_blocks), self.cache.scratch_slot, dtype=torch.int32, pin_memory=pin)
        self._staged: Event | None = None  # event after the last H2D copy out of the staging buffers
        n_moe = len(spec.moe_layers)
        self.route_probs = torch.zeros(n_moe, n, max(1, spec.top_k), dtype=torch.float32, device=dev)  # [L, B, k]
        self.route_ids = torch.zeros(n_moe, n, max(1, spec.top_k), dtype=torch.int64, device=dev)  # [L, B, k]
        self._graphs: dict[tuple[int, tuple[int, ...]], _Captured | None] = {}  # None: capture failed
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.fallbacks: Counter[str] = Counter()  # eager steps by reason
        self.replays = 0
        self.padded_eager = 0  # decode steps run eagerly over the bucket's padded rows

    # ---- eligibility -------------------------------------------------------------------------------
    def why_not(self, tokens: list[list[int]], tables: list[list[int]] | None) -> str | None:
        """None when this step can replay a graph, else the reason it runs eagerly (a fallbacks key).

        Shape reasons come first: a step that fits the buffers and only misses an expert or has forced routes
        runs eagerly over the padded rows (engine.PADDED_EAGER), so which of those it is never depends on
        where the experts are."""
        m = self.model
        if any(len(t) != 1 for t in tokens):
            return "prefill"
        if m.spec.attention is not AttentionKind.GQA or not m.decode_kernel:
            return "no_paged_decode_kernel"
        if len(tokens) > self.max_batch:
            return "batch_too_large"
        if tables is not None and any(len(t) > self.max_blocks for t in tables):
            return "context_too_long"
        if m.forced_routes is not None:
            return "forced_routes"
        pool = m.pool
        if not all(pool.num_resident(i) == pool.layout.num_experts for i in m.pool_layer.values()):
            return "experts_not_resident"
        return None

    # ---- capture -----------------------------------------------------------------------------------
    def _watched(self) -> tuple[int, ...]:
        obs = self.model.mass_observer
        return tuple(sorted(obs.layers)) if obs is not None else ()

    def _forward(self, bb: int, saved_q: dict[int, torch.Tensor]) -> torch.Tensor:
        """The decode forward over the first bb static rows, hooks pointed at the static buffers."""
        m = self.model
        segs = self._segments(bb)
        hooks = m.route_tap, m.mass_observer, m.route_out
        m.route_out = (self.route_probs[:, :bb], self.route_ids[:, :bb])
        m.route_tap, m.mass_observer = None, QCapture(saved_q)
        try:
            with torch.inference_mode():
                return m.forward(self.tokens[:bb], self.positions[:bb], segs)
        finally:
            m.route_tap, m.mass_observer, m.route_out = hooks

    def _get(self, bb: int, watched: tuple[int, ...]) -> _Captured | None:
        key = (bb, watched)
        if key in self._graphs:
            return self._graphs[key]
        spec, dev = self.model.spec, self.device.torch_device
        saved_q = {layer: torch.zeros(bb, spec.num_heads, spec.head_dim, dtype=self.model.w.embed.dtype, device=dev)
                   for layer in watched}
        if not self.capture:
            got = _Captured(None, torch.empty(0), saved_q)
        else:
            # Warm up on a side stream (Triton compiles, cuBLAS picks its kernels), then capture. Static rows
            # hold padding meanwhile (scratch block, position 0): nothing a real sequence owns is written.
            self._pad_rows(0, bb)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(bb, saved_q)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: the transfer engine's threads may sync on their own events meanwhile
                with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                    logits = self._forward(bb, saved_q)
            except RuntimeError:
                self.fallbacks["capture_failed"] += 1
                self._graphs[key] = None  # this bucket decodes eagerly (padded) from now on
                return None
            got = _Captured(graph, logits, saved_q)
        self._graphs[key] = got
        return got

    def _segments(self, bb: int, seqs: Sequence[int] = (), starts: Sequence[int] = ()) -> list[Segment]:
        """One decode segment per static row: the real sequences first, then padding rows (negative ids,
        position 0); all share one table tensor, which the attention reads as this step's block table."""
        table = self.table[:bb]
        real = [Segment(s, i, 1, p, table=table, table_row=i) for i, (s, p) in enumerate(zip(seqs, starts,
                                                                                              strict=True))]
        return real + [Segment(-1 - i, i, 1, 0, table=table, table_row=i) for i in range(len(real), bb)]

    def _pad_rows(self, lo: int, hi: int) -> None:
        self.tokens[lo:hi].zero_()
        self.positions[lo:hi].zero_()
        self.table[lo:hi, 0] = self.cache.scratch_slot

    # ---- replay ------------------------------------------------------------------------------------
    def run(self, seqs: list[int], tokens: list[list[int]], starts: list[int], tables: list[list[int]],
            replay: bool = True) -> torch.Tensor:
        """One decode step over the batch padded to its bucket: logits [B, V] float32, a fresh tensor.

        replay: why_not(...) was None, so the step replays its graph. Otherwise (an expert missing, forced
        routes) it runs eagerly over the same padded rows, so that dense layers and attention see the shapes
        the graph sees: which path a step takes must never change its bits (placement exactness)."""
        b = len(seqs)
        bb = self.buckets[bisect.bisect_left(self.buckets, b)]
        got = self._get(bb, self._watched()) if replay else None
        if self._staged is not None:
            self._staged.synchronize()  # the last copy out of the staging buffers is done
        ids, tab = self._stage_ids.numpy(), self._stage_table.numpy()
        ids[:, :bb] = 0
        ids[0, :b] = [t[0] for t in tokens]
        ids[1, :b] = starts
        for i, row in enumerate(tables):
            tab[i, : len(row)] = row
        tab[b:bb, 0] = self.cache.scratch_slot  # padding rows: the scratch block only
        nb = self.cache.num_blocks_for(max(starts) + 1)  # table columns any row of this step reads
        self.tokens[:bb].copy_(self._stage_ids[0, :bb], non_blocking=True)
        self.positions[:bb].copy_(self._stage_ids[1, :bb], non_blocking=True)
        self.table[:bb, :nb].copy_(self._stage_table[:bb, :nb], non_blocking=True)
        self._staged = self.device.record_event()
        if got is None:
            self.padded_eager += 1
            segs = self._segments(bb, seqs, starts)
            with torch.inference_mode():
                return self.model.forward(self.tokens[:bb], self.positions[:bb], segs, live_rows=b)[:b]
        self.model.pool.wait_published()  # the graph reads every expert: loads published once issued (I3)
        if got.graph is not None:
            got.graph.replay()
            logits = got.logits[:b].clone()
        else:
            logits = self._forward(bb, got.saved_q)[:b]
        self.replays += 1
        self._after_replay(seqs, starts, b, got)
        return logits

    def _after_replay(self, seqs: list[int], starts: list[int], b: int, got: _Captured) -> None:
        """Hand the static router and query buffers to the agent's taps (outside the graph). A tap without
        `add_all` is called per layer with views of the static buffers (raw top-k probabilities, rewritten by
        the next replay): it must copy what it keeps."""
        m = self.model
        tap = m.route_tap
        if tap is not None:
            add_all = getattr(tap, "add_all", None)
            if add_all is not None:
                add_all(self.route_ids[:, :b], self.route_probs[:, :b])
            else:
                for layer, i in m.pool_layer.items():
                    tap(layer, self.route_ids[i, :b], self.route_probs[i, :b])
        obs = m.mass_observer
        if obs is not None and got.saved_q:
            segs = self._segments(len(seqs), seqs, starts)
            for layer, q in got.saved_q.items():
                for i, sg in enumerate(segs):
                    observe(obs, layer, sg, q[i], self.cache)
