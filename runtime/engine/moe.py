"""The MoE block of the reference engine: router, grouped GEMM over the slot pool, deterministic combine.

Runs in the inference process. Experts are read through each layer's stable virtual range: gate+up of all
experts form one strided [E, 2I, H] view and down one [E, H, I] view, so `torch._grouped_mm` (a per-expert
loop where it is missing) reads expert e at a fixed address whether or not it was just loaded. Tokens'
top-k outputs are combined in a fixed order (no atomics), so results do not depend on placement.
Residency is asked of an `ExpertProvider` before the GEMMs; this module never decides what to load.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from tierplan.runtime.engine.config import ModelSpec
from tierplan.runtime.engine.kernels import moe_gemm
from tierplan.runtime.memory.slots import ExpertSlotPool
from tierplan.runtime.weights.format import ExpertFormat

HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


class ExpertProvider(Protocol):
    capacity: int  # how many experts can be resident at once (the pool's slots)

    def chunks(self, layer: int, needed: list[int]) -> list[list[int]]:
        """The layer's needed experts (ascending ids) in groups that are made resident one after another."""
        ...

    def all_resident(self, layer: int) -> bool:
        """True when every expert of the layer is resident: compute may skip `ensure` (no host sync)."""
        ...

    def ensure(self, layer: int, experts: list[int]) -> None:
        """Return once every listed expert of `layer` is resident and ordered before compute."""
        ...

    def done_reading(self, layer: int, experts: list[int]) -> None:
        """The GEMMs just queued read these experts: their slots must not be reused before that work ends."""
        ...


def route(x: torch.Tensor, router: torch.Tensor, spec: ModelSpec,
          out: tuple[torch.Tensor, torch.Tensor] | None = None,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts per token: ids [T, k] int64 and weights [T, k] float32.

    out: (probs [T, k] float32, ids [T, k] int64) buffers that receive the raw top-k (a CUDA graph's static
    buffers, read by the agent's tap after replay: the tap then costs no kernel inside the graph).
    bias: [E] float32, DeepSeek-V3's e_score_correction_bias (sigmoid scoring only; None = zeros)."""
    # A router kept in float32 (DeepSeek's, as transformers keeps it) routes float32 rows.
    logits = x @ router.t() if router.dtype == x.dtype else x.to(router.dtype) @ router.t()  # [T, E]
    if spec.router_scoring == "sigmoid":
        from tierplan.runtime.engine.families.routing import noaux_tc

        w, ids = noaux_tc(logits.float(), bias, spec.top_k, spec.num_expert_groups, spec.topk_groups, out)
        if spec.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)  # transformers' V3 guards the sum the same way
        return ids, w * spec.routed_scaling_factor
    probs = F.softmax(logits.float(), dim=-1)  # [T, E]
    if spec.num_expert_groups:
        from tierplan.runtime.engine.families.routing import group_limited

        probs = group_limited(probs, spec.num_expert_groups, spec.topk_groups)
    if out is not None:
        w, ids = torch.topk(probs, spec.top_k, dim=-1, out=out)  # [T, k] written in place
    else:
        w, ids = probs.topk(spec.top_k, dim=-1)  # [T, k]
    if spec.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    return ids, w * spec.routed_scaling_factor


class ExpertViews:
    """Strided views of one layer's experts inside the slot pool's stable range (built once per layer), and, for
    a pool with a slot window, of every slot in the window with the layer's row of the slot table (`slots`:
    expert -> slot), which a table reader's GEMM indexes instead of the experts' ranges."""

    def __init__(self, pool: ExpertSlotPool, fmt: ExpertFormat, layer: int) -> None:
        gate, up, down = (next(t for t in fmt.tensors if t.name == n) for n in ("gate_proj", "up_proj", "down_proj"))
        i, h = gate.shape
        if up.offset_bytes != gate.offset_bytes + gate.num_bytes:
            raise ValueError("expert format: up_proj must follow gate_proj directly to fuse them")
        dt = getattr(torch, gate.dtype)
        raw = pool.layer_tensor(layer).view(dt)  # [E * stride / itemsize]
        es = pool.layout.stride_bytes // dt.itemsize
        e = pool.layout.num_experts
        self.gate_up = raw.as_strided((e, 2 * i, h), (es, h, 1), gate.offset_bytes // dt.itemsize)  # [E, 2I, H]
        self.down = raw.as_strided((e, h, i), (es, i, 1), down.offset_bytes // dt.itemsize)  # [E, H, I]
        self.intermediate = i
        self.ident = torch.arange(e, dtype=torch.int64, device=raw.device)  # [E] expert e at e (the range)
        window, table = pool.ranges.window, pool.reads.table
        self.slots = table[layer] if table is not None else None  # [E] int64 on the device
        self.win_gate_up = self.win_down = None
        if window is not None:
            win, s = window.view(dt), pool.num_slots
            self.win_gate_up = win.as_strided((s, 2 * i, h), (es, h, 1), gate.offset_bytes // dt.itemsize)  # [S,2I,H]
            self.win_down = win.as_strided((s, h, i), (es, i, 1), down.offset_bytes // dt.itemsize)  # [S, H, I]


def _grouped(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, counts: list[int] | None,
             triton_gemm: bool = False, slots: torch.Tensor | None = None, table: bool = False) -> torch.Tensor:
    """x [M, K] sorted by expert, w [E, N, K] -> [M, N]; groups given by offs (cumulative) / counts. slots [E]:
    group e reads w[slots[e]] (table: w is the slot window [S, N, K]; else the identity over the range)."""
    if triton_gemm:
        return moe_gemm.grouped_gemm(x, w, offs, slots)
    if table:
        assert slots is not None
        w = w.index_select(0, slots)  # [E, N, K]: the CPU twin's torch path (the same bytes as the ranges)
    if HAS_GROUPED_MM:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    assert counts is not None, "the loop fallback needs the per-expert row counts on the host"
    out = x.new_empty(x.shape[0], w.shape[1])
    start = 0
    for e, n in enumerate(counts):
        if n:
            out[start : start + n] = x[start : start + n] @ w[e].t()
        start += n
    return out


def _expert_mlp(xs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, intermediate: int,
                offs: torch.Tensor, counts: list[int] | None, triton_gemm: bool, slots: torch.Tensor,
                table: bool = False) -> torch.Tensor:
    """SwiGLU of sorted rows xs [M, H] through experts gate_up [E', 2I, H] / down [E', H, I] -> [M, H].
    `counts` (host) is only needed where `torch._grouped_mm` is missing; `triton_gemm` picks the Triton
    grouped GEMM (decided per layer, so every chunk of a layer uses the same kernel); slots [E'] say where
    each group's weights sit (table: in the slot window gate_up [S, 2I, H] / down [S, H, I])."""
    gu = _grouped(xs, gate_up, offs, counts, triton_gemm, slots, table)  # [M, 2I]
    g, u = gu.split(intermediate, dim=-1)
    return _grouped(F.silu(g) * u, down, offs, counts, triton_gemm, slots, table)  # [M, H]


def moe_forward(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, views: ExpertViews, layer: int,
                provider: ExpertProvider, kernel_rows: int | None = None, static: bool = False,
                table: bool = False) -> torch.Tensor:
    """x [T, H], ids/weights [T, k] -> [T, H] (routed experts only).

    kernel_rows: the routed rows the GEMM kernel is chosen for (default T*k); a padded batch passes its padded
    count, so it picks the kernel its CUDA-graph twin picks. static: the caller already made every routed expert
    resident and ordered the stream after its load (a piecewise graph): one grouped GEMM pair over the layer's
    range, which reads only experts with rows (no host sync, no provider call); with `table` the pair reads the
    slot window through the layer's slot table (the caller synced it: `ensure(table=True)`)."""
    t, k = ids.shape
    e = views.gate_up.shape[0]
    flat = ids.reshape(-1)  # [T*k]
    order = torch.argsort(flat, stable=True)  # [T*k]
    # scatter_add, not bincount: CUDA bincount reads min/max back to the host (two syncs per layer)
    counts_t = torch.zeros(e, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    xs = x[order // k]  # [T*k, H]
    tri = moe_gemm.usable(x, t * k if kernel_rows is None else kernel_rows)
    if (HAS_GROUPED_MM or tri) and (static or provider.all_resident(layer)):
        # Every expert has a slot: one grouped GEMM pair over all experts, offsets on the device, no host sync
        # (CUDA-graph friendly). Per-expert rows are the same as in the chunked path below.
        offs = torch.cumsum(counts_t, 0).to(torch.int32)  # [E]
        if table and static:
            assert views.slots is not None and views.win_gate_up is not None and views.win_down is not None
            y = _expert_mlp(xs, views.win_gate_up, views.win_down, views.intermediate, offs, None, tri, views.slots,
                            table=True)  # [T*k, H]
        else:
            y = _expert_mlp(xs, views.gate_up, views.down, views.intermediate, offs, None, tri, views.ident)

        return _combine(y, order, weights, t, k, x.dtype)
    # This host sync also means every earlier layer's GEMMs (all-resident layers record no per-expert
    # readers) have finished before `ensure` below may evict one of their experts.
    counts = counts_t.tolist()
    needed = [i for i, n in enumerate(counts) if n]
    y = torch.empty_like(xs)  # [T*k, H]
    # More experts needed than slots: the provider groups them (consecutive runs by default, a policy's scan
    # rule otherwise), one group resident at a time. Each expert's GEMM sees the same rows either way, so the
    # result does not depend on how many slots there are or how the groups fall.
    position = {e: i for i, e in enumerate(needed)}
    for chunk in provider.chunks(layer, needed):
        provider.ensure(layer, chunk)
        for run in _runs(chunk, position):
            e0, e1 = run[0], run[-1] + 1
            r0, r1 = sum(counts[:e0]), sum(counts[:e1])
            sub_counts = counts[e0:e1]
            offs = torch.cumsum(counts_t[e0:e1], 0).to(torch.int32)  # [e1-e0]
            y[r0:r1] = _expert_mlp(xs[r0:r1], views.gate_up[e0:e1], views.down[e0:e1], views.intermediate, offs,
                                   sub_counts, tri, views.ident[: e1 - e0])  # [rows, H]
        provider.done_reading(layer, chunk)  # the next chunk may evict these: it must wait for these GEMMs
    return _combine(y, order, weights, t, k, x.dtype)


def _runs(chunk: list[int], position: dict[int, int]) -> list[list[int]]:
    """A chunk split where another chunk's needed expert lies between two of its own: each run's id range
    [first, last] then holds only its own experts' rows (ids routed to no row read nothing)."""
    runs: list[list[int]] = []
    for e in sorted(chunk, key=position.__getitem__):
        if runs and position[e] == position[runs[-1][-1]] + 1:
            runs[-1].append(e)
        else:
            runs.append([e])
    return runs


def _combine(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, t: int, k: int,
             dtype: torch.dtype) -> torch.Tensor:
    """Expert outputs y [T*k, H] in expert order -> [T, H]: weighted sum over each token's k, in fixed order."""
    unsorted = torch.empty_like(y)
    unsorted[order] = y
    return (unsorted.view(t, k, -1).float() * weights.unsqueeze(-1)).sum(1).to(dtype)  # [T, H]


def mlp(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """Dense SwiGLU MLP (dense layers, shared experts)."""
    return (F.silu(x @ w["gate_proj"].t()) * (x @ w["up_proj"].t())) @ w["down_proj"].t()
