"""CUDA graphs of the decode step, whole or piecewise (inference process, engine thread).

A decode step's shapes are fixed once its batch is padded to a bucket, so it is captured once per bucket and
replayed. Static inputs (tokens, positions [Bb], block table [Bb, M], the routing rows below) are copied in
from pinned staging buffers before each replay; padding rows decode token 0 at position 0 into the cache's
scratch block, which no sequence owns, and take row 0's route (`row_src`), so they need no expert the real
rows do not. Every MoE layer's routes are written into static buffers [L, Bb, k] (the agent's tap reads them
after the replay), and the queries of the layers the attention-mass observer may sample are saved.

Routing inside graphs: the router always runs; a forced-routes table (hooks.py) is gathered through the
static `trace_rows` buffer, once per step for every layer (the first piece does it), and wins where the staged
`forced` flag is set, so a forced-routing step replays the same graph as a live one.

Two graph kinds per bucket: the whole step (every expert resident: nothing for the host to do mid-step), and
the step cut at the MoE layers into `model.num_pieces` pieces (piece p = MoE layer p-1's experts through MoE
layer p's routing) replayed one after another, with the caller's residency work for each MoE layer between
its pieces (`replay_pieces`; as vLLM's piecewise graphs). Whatever neither can run is the engine's to run
eagerly (executor.py counts why). On a CPU nothing is captured: the same static-buffer pieces run eagerly
(`capture=False`), which is how CI checks padding, staging, routing and taps.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tierplan.runtime.device import Device, Event
from tierplan.runtime.engine.attention import QCapture, Segment, observe
from tierplan.runtime.engine.hooks import StepRouting
from tierplan.runtime.engine.model import FwdState, MoEModel

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def fewest_rows(rows: int) -> int:
    """The fewest sequences a decode step of `rows` rows can hold: one more than the bucket below it (padding
    rows fill the rest). The paged kernel sizes its context splits by it (`num_splits`), the same for a replay
    and for the padded eager step, so both give the same bits."""
    i = bisect.bisect_left(BUCKETS, rows)  # BUCKETS[:i] are the buckets below
    return BUCKETS[i - 1] + 1 if i else 1


_IDS = ("tokens", "positions", "trace_rows", "row_src", "forced")  # rows of the int64 staging buffer
_Hooks = tuple[Callable[[int], None], Callable[[int], None]]  # residency work before / after MoE layer p


@dataclass
class _Captured:
    graphs: list[torch.cuda.CUDAGraph] | None  # one whole step or one per piece; None: the CPU twin runs eagerly
    logits: torch.Tensor | None  # [Bb, V] float32, rewritten by every replay (captured)
    saved_q: dict[int, torch.Tensor]  # watched layer -> [Bb, Hq, D]
    state: FwdState | None = None  # the pieces' tensors (kept alive: later pieces read earlier ones)


class DecodeGraphs:
    def __init__(self, model: MoEModel, device: Device, max_batch: int, max_blocks: int, capture: bool) -> None:
        if max_batch < 1 or max_blocks < 1:
            raise ValueError(f"DecodeGraphs: max_batch={max_batch} and max_blocks={max_blocks} must be >= 1")
        self.model, self.device, self.capture = model, device, capture
        self.cache = model.cache
        self.buckets = sorted({b for b in BUCKETS if b < max_batch} | {max_batch})
        self.max_batch, self.max_blocks = max_batch, max_blocks
        dev, n, spec = device.torch_device, max_batch, model.spec
        self.ids = torch.zeros(len(_IDS), n, dtype=torch.int64, device=dev)  # [5, Bmax] (rows: _IDS)
        self.table = torch.full((n, max_blocks), self.cache.scratch_slot, dtype=torch.int32, device=dev)  # [Bmax, M]
        pin = device.is_cuda
        self._stage_ids = torch.zeros(len(_IDS), n, dtype=torch.int64, pin_memory=pin)
        self._stage_table = torch.full((n, max_blocks), self.cache.scratch_slot, dtype=torch.int32, pin_memory=pin)
        self._staged: Event | None = None  # event after the last H2D copy out of the staging buffers
        n_moe = len(spec.moe_layers)
        self.route_probs = torch.zeros(n_moe, n, max(1, spec.top_k), dtype=torch.float32, device=dev)  # [L, B, k]
        self.route_ids = torch.zeros(n_moe, n, max(1, spec.top_k), dtype=torch.int64, device=dev)  # [L, B, k]
        # The forced table's rows of the step and the staged flag, gathered once per step by the first piece.
        self.forced_ids = torch.zeros(n, n_moe, max(1, spec.top_k), dtype=torch.int64, device=dev)  # [B, L, k]
        self.forced_w = torch.zeros(n, n_moe, max(1, spec.top_k), dtype=torch.float32, device=dev)  # [B, L, k]
        self.forced_mask = torch.zeros(n, 1, dtype=torch.bool, device=dev)  # [B, 1]
        self._whole: dict[tuple[int, tuple[int, ...]], _Captured | None] = {}  # None: capture failed
        self._pieces: dict[tuple[int, tuple[int, ...]], _Captured | None] = {}
        self._pools = (torch.cuda.graph_pool_handle(), torch.cuda.graph_pool_handle()) if capture else (None, None)
        self.capture_failures = 0
        self.last_capture_error: str | None = None  # the last capture's error, for reports (counted above)
        # Wall time spent capturing (warm-up and capture of each new bucket, failed ones too): a server captures
        # its buckets at start-up, so a bench takes it out of its step clocks (`capture_s` only grows).
        self.capture_s = 0.0
        # Timing events around each graph replay of the last step (`take_gpu_ms`); a pair per piece, made once.
        n_pairs = model.num_pieces if capture else 0
        self._events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                        for _ in range(n_pairs)]
        self._timed = 0  # pairs recorded since the last take_gpu_ms

    def reset(self) -> None:
        """Forget every captured graph (the hooks changed: a graph bakes in the forced table's address)."""
        self._whole.clear()
        self._pieces.clear()
        if self.capture:  # fresh pools: capturing into a pool whose graphs were just freed trips the allocator
            self._pools = (torch.cuda.graph_pool_handle(), torch.cuda.graph_pool_handle())

    # ---- eligibility -------------------------------------------------------------------------------
    def bucket(self, batch: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, batch)]

    # ---- staging -----------------------------------------------------------------------------------
    def stage(self, seqs: Sequence[int], tokens: list[list[int]], starts: Sequence[int],
              tables: list[np.ndarray], trace_rows: list[int] | None) -> int:
        """Copy one decode step's inputs into the static buffers; returns its bucket Bb."""
        b = len(seqs)
        bb = self.bucket(b)
        if self._staged is not None:
            self._staged.synchronize()  # the last copy out of the staging buffers is done
        ids, tab = self._stage_ids.numpy(), self._stage_table.numpy()
        ids[:, :bb] = 0
        ids[0, :b] = [t[0] for t in tokens]
        ids[1, :b] = starts
        if trace_rows is not None:
            ids[2, :b] = trace_rows
            ids[4, :bb] = 1
        ids[3, :b] = range(b)  # padding rows keep 0: row 0's route
        for i, row in enumerate(tables):
            tab[i, : len(row)] = row
        tab[b:bb, 0] = self.cache.scratch_slot  # padding rows: the scratch block only
        nb = self.cache.num_blocks_for(max(starts) + 1)  # table columns any row of this step reads
        self.ids[:, :bb].copy_(self._stage_ids[:, :bb], non_blocking=True)
        self.table[:bb, :nb].copy_(self._stage_table[:bb, :nb], non_blocking=True)
        self._staged = self.device.record_event()
        return bb

    def _segments(self, bb: int, seqs: Sequence[int] = (), starts: Sequence[int] = ()) -> list[Segment]:
        """One decode segment per static row: the real sequences first, then padding rows (negative ids,
        position 0); all share one table tensor, which the attention reads as this step's block table."""
        table = self.table[:bb]
        real = [Segment(s, i, 1, p, table=table, table_row=i) for i, (s, p) in enumerate(zip(seqs, starts,
                                                                                              strict=True))]
        return real + [Segment(-1 - i, i, 1, 0, table=table, table_row=i) for i in range(len(real), bb)]

    def _routing(self, bb: int, graph_rows: bool) -> StepRouting:
        """Graph rows: router plus table (if any) under the staged flag, padding rows on row 0's route."""
        has_table = self.model.forced_routes is not None
        rows = self.ids[2, :bb]
        if not graph_rows:
            return StepRouting(trace_rows=rows, forced=has_table and bool(self._stage_ids[4, 0]))
        return StepRouting(trace_rows=rows if has_table else None,
                           forced_mask=self.forced_mask[:bb] if has_table else None,
                           row_src=self.ids[3, :bb], route_out=(self.route_probs[:, :bb], self.route_ids[:, :bb]),
                           forced_rows=(self.forced_ids[:bb], self.forced_w[:bb]) if has_table else None)

    def _gather_forced(self, bb: int) -> None:
        """The staged rows' routes for every layer and the staged flag, into their static buffers (three kernels
        a step, where a gather per layer cost a few kernels each)."""
        table = self.model.forced_routes
        if table is None:
            return
        rows = self.ids[2, :bb]
        torch.index_select(table.ids, 0, rows, out=self.forced_ids[:bb])
        torch.index_select(table.weights, 0, rows, out=self.forced_w[:bb])
        torch.ne(self.ids[4, :bb, None], 0, out=self.forced_mask[:bb])

    # ---- pieces ------------------------------------------------------------------------------------
    def _piece(self, st: FwdState | None, p: int, bb: int, saved_q: dict[int, torch.Tensor],
               table: bool = False) -> FwdState:
        """Piece p over the static rows; table: its MoE GEMMs read the slot table, which only the piecewise
        residency work between pieces keeps in step (the whole step reads the experts' ranges)."""
        m = self.model
        with torch.inference_mode():
            if st is None:
                self._gather_forced(bb)
                st = m.start(self.ids[0, :bb], self.ids[1, :bb], self._segments(bb))
            if p:
                m.finish_moe(st, p - 1, static=True, table=table)
            m.front(st, p, self._routing(bb, graph_rows=True), QCapture(saved_q))
        return st

    def _all_pieces(self, bb: int, saved_q: dict[int, torch.Tensor], residency: _Hooks | None = None) -> FwdState:
        st = None
        for p in range(self.model.num_pieces):
            if p and residency is not None:
                residency[0](p - 1)
            st = self._piece(st, p, bb, saved_q, table=residency is not None)
            if p and residency is not None:
                residency[1](p - 1)
        assert st is not None
        return st

    def _get(self, bb: int, watched: tuple[int, ...], piecewise: bool,
             residency: _Hooks | None = None) -> _Captured | None:
        book = self._pieces if piecewise else self._whole
        key = (bb, watched)
        if key in book:
            return book[key]
        spec, dev = self.model.spec, self.device.torch_device
        saved_q = {layer: torch.zeros(bb, spec.num_heads, spec.head_dim, dtype=self.model.w.embed.dtype, device=dev)
                   for layer in watched}
        if not self.capture:
            book[key] = _Captured(None, None, saved_q)
            return book[key]
        t0 = time.perf_counter()
        try:
            return self._capture(book, key, bb, saved_q, piecewise, residency)
        finally:
            torch.cuda.synchronize(dev)  # the warm-up's kernels end here, not in the replay timed after
            self.capture_s += time.perf_counter() - t0

    def _capture(self, book: dict[tuple[int, tuple[int, ...]], _Captured | None], key: tuple[int, tuple[int, ...]],
                 bb: int, saved_q: dict[int, torch.Tensor], piecewise: bool,
                 residency: _Hooks | None) -> _Captured | None:
        # Warm up on a side stream (Triton compiles, cuBLAS picks its kernels), then capture. The warm-up runs the
        # staged step itself (it rewrites the same K/V rows the step writes: idempotent), with its residency work
        # between pieces, so it reads only experts made resident for it.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._all_pieces(bb, saved_q, residency if piecewise else None)
        torch.cuda.current_stream().wait_stream(side)
        graphs: list[torch.cuda.CUDAGraph] = []
        st: FwdState | None = None
        try:
            for p in range(self.model.num_pieces if piecewise else 1):
                g = torch.cuda.CUDAGraph()
                # thread_local: the transfer engine's threads may sync on their own events meanwhile
                with torch.cuda.graph(g, pool=self._pools[piecewise], capture_error_mode="thread_local"):
                    st = self._piece(st, p, bb, saved_q, True) if piecewise else self._all_pieces(bb, saved_q)
                graphs.append(g)
        except RuntimeError as exc:
            self.capture_failures += 1
            self.last_capture_error = f"{type(exc).__name__}: {exc}"[:500]
            book[key] = None  # this bucket decodes eagerly (padded) from now on
            return None
        assert st is not None
        book[key] = _Captured(graphs, st.logits, saved_q, st)
        return book[key]

    def _watched(self) -> tuple[int, ...]:
        obs = self.model.mass_observer
        return tuple(sorted(obs.layers)) if obs is not None else ()

    # ---- running a staged step ---------------------------------------------------------------------
    def replay(self, seqs: list[int], starts: list[int], bb: int) -> torch.Tensor | None:
        """The whole-step graph over the staged rows: logits [B, V] (a fresh tensor), None if capture failed."""
        self._timed = 0  # this step's replays only (`take_gpu_ms`)
        self.model.pool.map_all_for_read()  # the graph (and its capture's warm-up) reads every expert's range
        got = self._get(bb, self._watched(), piecewise=False)
        if got is None:
            return None
        self.model.pool.wait_published()  # the graph reads every expert: loads published once issued (I3)
        if got.graphs is not None:
            self._timed_replay(got.graphs[0], 0)
            assert got.logits is not None
            logits = got.logits[: len(seqs)].clone()
        else:
            st = self._all_pieces(bb, got.saved_q)
            assert st.logits is not None
            logits = st.logits[: len(seqs)]
        self._after_replay(seqs, starts, got)
        return logits

    def replay_pieces(self, seqs: list[int], starts: list[int], bb: int, before_moe: Callable[[int], None],
                      after_moe: Callable[[int], None]) -> torch.Tensor | None:
        """The piecewise graphs over the staged rows; before_moe(p) runs on the host before the piece that
        computes MoE layer p's experts (make them resident, order the stream), after_moe(p) once it is queued.
        None if capture failed (nothing was replayed)."""
        self._timed = 0  # this step's replays only (`take_gpu_ms`)
        got = self._get(bb, self._watched(), piecewise=True, residency=(before_moe, after_moe))
        if got is None:
            return None
        st = None
        for p in range(self.model.num_pieces):
            if p:
                before_moe(p - 1)
            if got.graphs is not None:
                self._timed_replay(got.graphs[p], p)
            else:
                st = self._piece(st, p, bb, got.saved_q, table=True)
            if p:
                after_moe(p - 1)
        logits_all = got.logits if got.graphs is not None else (st.logits if st is not None else None)
        assert logits_all is not None
        logits = logits_all[: len(seqs)].clone() if got.graphs is not None else logits_all[: len(seqs)]
        self._after_replay(seqs, starts, got)
        return logits

    def _timed_replay(self, graph: torch.cuda.CUDAGraph, p: int) -> None:
        start, end = self._events[p]
        start.record()
        graph.replay()
        end.record()
        self._timed = p + 1

    def take_gpu_ms(self) -> float | None:
        """GPU time of the last step's graph replays (ms, the sum over its pieces; each from the stream reaching
        the replay to its end), then forgotten: None if no graph replayed since the last call (an eager step, a
        CPU). The wall time of a step beyond it went to the host between pieces (residency work, launches, the
        GIL) or to other work on the stream. Blocks until the last replay has finished (after a step it has)."""
        if not self._timed:
            return None
        self._events[self._timed - 1][1].synchronize()
        total = sum(a.elapsed_time(b) for a, b in self._events[: self._timed])
        self._timed = 0
        return total

    def step_routes(self, p: int, b: int) -> torch.Tensor:
        """MoE layer p's routes for the b real rows of the piece just queued [b, k] (a device tensor)."""
        return self.route_ids[p, :b]

    def run_padded_eager(self, seqs: list[int], starts: list[int], bb: int) -> torch.Tensor:
        """The staged step eagerly over the padded rows (the shapes the graph sees: which path a step takes never
        changes its bits); routed experts are asked of the provider for the real rows only."""
        segs = self._segments(bb, seqs, starts)
        with torch.inference_mode():
            return self.model.forward(self.ids[0, :bb], self.ids[1, :bb], segs, live_rows=len(seqs),
                                      routing=self._routing(bb, graph_rows=False))[: len(seqs)]

    def _after_replay(self, seqs: list[int], starts: list[int], got: _Captured) -> None:
        """Hand the static router and query buffers to the agent's taps (outside the graph). A tap without
        `add_all` is called per layer with views of the static buffers (the routes used, rewritten by the next
        replay): it must copy what it keeps."""
        m, b = self.model, len(seqs)
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
            segs = self._segments(b, seqs, starts)
            for layer, q in got.saved_q.items():
                for i, sg in enumerate(segs):
                    observe(obs, layer, sg, q[i], self.cache)
