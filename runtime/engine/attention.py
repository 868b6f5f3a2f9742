"""Attention of the reference engine over the paged KV cache (inference process).

GQA (Qwen3-MoE, Mixtral, OLMoE): project, optional per-head q/k RMSNorm, RoPE, scatter the new K/V rows
into their blocks, then attend over the sequence's blocks gathered through its block table. This is the
torch reference path (CPU, and the correctness oracle on the GPU). MLA (DeepSeek-V2) caches the
compressed latent and lives in `mla.py`; `attention` dispatches on the spec's kind. Never moves blocks
between tiers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from tierplan.runtime.engine.config import AttentionKind, ModelSpec
from tierplan.runtime.engine.kernels.paged_attention import HAS_TRITON
from tierplan.runtime.engine.kv_cache import PagedKVCache
from tierplan.runtime.errors import ConfigError


@dataclass(frozen=True)
class Segment:
    """`num_tokens` consecutive rows of the batch belonging to one sequence, starting at `first_pos`."""

    seq_id: int
    row_start: int
    num_tokens: int
    first_pos: int
    # This step's block table, built once per step on the device ([S, M] int32, row `table_row` is this
    # segment's GPU slots): layers read it instead of rebuilding it (no per-layer host-to-device copies).
    table: torch.Tensor | None = field(default=None, compare=False, repr=False)
    table_row: int = 0

    @property
    def context_len(self) -> int:
        return self.first_pos + self.num_tokens

    def slots(self, cache: PagedKVCache) -> torch.Tensor:
        """GPU-tier slots of this sequence's blocks [num_blocks] int64."""
        if self.table is None:
            return cache.gpu_slots(self.seq_id)
        return self.table[self.table_row, : cache.num_blocks_for(self.context_len)].long()


class MassObserver(Protocol):
    """Samples how much attention each KV block gets (the agent's tap); called between kernels, rarely.
    `layers`: the layers it may sample (a CUDA-graph step saves only their queries)."""

    layers: set[int]

    def wants(self, layer: int, seq_id: int) -> bool: ...

    def record(self, layer: int, block_ids: list[int], mass: torch.Tensor) -> None:
        """mass [num_blocks] float32 on the device: share of the last query's attention per block."""
        ...


class QCapture:
    """Stands in for the mass observer while a decode step is captured in a CUDA graph: the paged path saves
    the query rows of the watched layers into `saved[layer]` ([B, Hq, D] static buffers, one copy kernel per
    watched layer), and the graph runner feeds them to the real observer after each replay."""

    def __init__(self, saved: dict[int, torch.Tensor]) -> None:
        self.saved = saved

    def wants(self, layer: int, seq_id: int) -> bool:
        return False

    def record(self, layer: int, block_ids: list[int], mass: torch.Tensor) -> None:  # pragma: no cover
        raise AssertionError("QCapture never samples")


def block_mass(q: torch.Tensor, keys: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """q [Hq, D], keys [C, Hkv, D] -> [ceil(C / T)] float32: softmax(qK^T / sqrt(D)) summed per block, mean
    over heads (sums to 1)."""
    c, hkv, d = keys.shape
    k = keys.float().repeat_interleave(q.shape[0] // hkv, 1)  # [C, Hq, D]
    p = torch.einsum("hd,chd->hc", q.float(), k).div(d**0.5).softmax(-1).mean(0)  # [C]
    return F.pad(p, (0, -c % block_tokens)).view(-1, block_tokens).sum(-1)


def observe(observer: MassObserver | None, layer: int, s: Segment, q_last: torch.Tensor, cache: PagedKVCache,
            keys: torch.Tensor | None = None) -> None:
    """Give the observer this segment's block mass for `layer` if it wants a sample (keys gathered if None)."""
    if observer is None or not observer.wants(layer, s.seq_id):
        return
    if keys is None:  # the kernel path gathered nothing: gather this one sequence now
        kv = cache.gpu[:, layer, 0]  # [Nblk, T, Hkv, D]
        nb = cache.num_blocks_for(s.context_len)
        keys = kv[s.slots(cache)[:nb]].flatten(0, 1)[: s.context_len]
    mass = block_mass(q_last, keys, cache.block_tokens)
    observer.record(layer, cache.blocks_of(s.seq_id)[: mass.numel()], mass)


def build_block_table(segments: list[Segment], cache: PagedKVCache,
                      rows: Sequence[Sequence[int] | np.ndarray] | None = None) -> torch.Tensor:
    """[S, M] int32 GPU slots of each segment's blocks (zero padded), made on the host, copied once.
    rows: the segments' `cache.gpu_indices`, when the caller already looked them up."""
    if rows is None:
        rows = [cache.gpu_indices(s.seq_id) for s in segments]
    width = max(1, *(len(r) for r in rows))
    host = np.zeros((len(rows), width), dtype=np.int32)  # numpy takes a list row ~5x faster than torch.tensor
    for i, r in enumerate(rows):
        host[i, : len(r)] = r
    return torch.from_numpy(host).to(cache.device.torch_device, non_blocking=True)


FUSED_NORM = True  # on a GPU with Triton: one fused kernel per norm (kernels/rmsnorm.py)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if FUSED_NORM and x.is_cuda and HAS_TRITON:
        from tierplan.runtime.engine.kernels.rmsnorm import rms_norm_fused

        return rms_norm_fused(x, w, eps)
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope_tables(positions: torch.Tensor, d: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, 1, D] float32 for positions [N]: made once per step, shared by every layer."""
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=positions.device, dtype=torch.float32) / d))  # [D/2]
    ang = positions.to(torch.float32)[:, None] * inv[None, :]  # [N, D/2]
    return torch.cat([ang.cos(), ang.cos()], -1)[:, None, :], torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float,
         tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Rotary embedding on x [N, heads, D] at integer positions [N] (computed in float32)."""
    d = x.shape[-1]
    cos, sin = tables if tables is not None else rope_tables(positions, d, theta)
    x32 = x.float()
    rot = torch.cat([-x32[..., d // 2 :], x32[..., : d // 2]], -1)
    return (x32 * cos + rot * sin).to(x.dtype)


RopeTables = tuple[torch.Tensor, torch.Tensor]


def linear(x: torch.Tensor, w: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """x @ w[name]^T, plus w[name + ".bias"] where the checkpoint has one (attention_bias)."""
    y = x @ w[name].t()
    bias = w.get(f"{name}.bias")
    return y if bias is None else y + bias


def _project_qkv(x: torch.Tensor, w: dict[str, torch.Tensor], positions: torch.Tensor, spec: ModelSpec,
                 rt: RopeTables | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, nh, nkv, d = x.shape[0], spec.num_heads, spec.num_kv_heads, spec.head_dim
    q = linear(x, w, "q_proj")  # [N, Hq*D]
    k = linear(x, w, "k_proj")  # [N, Hkv*D]
    v = linear(x, w, "v_proj")  # [N, Hkv*D]
    if spec.qk_norm and not spec.qk_norm_per_head:  # OLMoE normalises the whole projection
        q, k = rms_norm(q, w["q_norm"], spec.rms_norm_eps), rms_norm(k, w["k_norm"], spec.rms_norm_eps)
    if spec.clip_qkv:  # OLMoE clamps after its q/k norm, before RoPE
        q, k, v = (t.clamp(-spec.clip_qkv, spec.clip_qkv) for t in (q, k, v))
    q, k, v = q.view(n, nh, d), k.view(n, nkv, d), v.view(n, nkv, d)  # [N, Hq, D], [N, Hkv, D], [N, Hkv, D]
    if spec.qk_norm and spec.qk_norm_per_head:  # Qwen3 normalises each head
        q, k = rms_norm(q, w["q_norm"], spec.rms_norm_eps), rms_norm(k, w["k_norm"], spec.rms_norm_eps)
    return rope(q, positions, spec.rope_theta, rt), rope(k, positions, spec.rope_theta, rt), v


@dataclass(frozen=True)
class StepMeta:
    """What every layer of one step shares, made once per step on the device: RoPE tables and, for a decode
    batch, the block table, each new token's GPU slot and offset in it, and the context lengths; for a step that
    mixes prefill and decode segments, its two halves (`MixedRows`)."""

    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [N, 1, D]
    table: torch.Tensor | None = None  # [B, M] int32
    slot: torch.Tensor | None = None  # [B] int64
    offset: torch.Tensor | None = None  # [B] int64
    lens: torch.Tensor | None = None  # [B] int32
    mixed: MixedRows | None = None


@dataclass(frozen=True)
class MixedRows:
    """A step of prefill and decode segments, split once per step: the decode rows go to the paged kernel as one
    batch, the prefill rows to the reference path. Through the reference path, each decode segment cost its own
    gathers and SDPA call in every layer: the H200's mixed steps of ~2K prefill tokens and ~50 decodes took
    340-430 ms against 45 ms for a prefill alone (phase run 28, qwen3 b128 1K). Segments are re-indexed to their
    half's rows (`row_start`; the decode half's `table_row` into its own table, rows of the step's)."""

    decode_rows: torch.Tensor  # [Bd] int64 rows of the step
    prefill_rows: torch.Tensor  # [Np] int64
    decode_segments: list[Segment]
    prefill_segments: list[Segment]
    decode_meta: StepMeta
    prefill_meta: StepMeta  # the prefill rows' RoPE tables
    decode_first: bool = True  # the step's first segment decodes: that half runs first (a mass tap samples the
    # first sequence a layer shows it, as on the one-path step)


def step_meta(positions: torch.Tensor, segments: list[Segment], cache: PagedKVCache, spec: ModelSpec,
              decode: bool) -> StepMeta:
    if spec.attention is not AttentionKind.GQA:
        return StepMeta()
    rt = rope_tables(positions, spec.head_dim, spec.rope_theta)
    if not decode:
        return StepMeta(rope=rt)
    bt = cache.block_tokens
    table = segments[0].table
    if table is None or any(s.table is not table or s.table_row != i for i, s in enumerate(segments)):
        table = build_block_table(segments, cache)  # [B, M]
    slot = table.gather(1, (positions // bt)[:, None].to(torch.int64)).squeeze(1).long()  # [B]
    return StepMeta(rt, table, slot, positions % bt, (positions + 1).to(torch.int32))


def mixed_meta(meta: StepMeta, positions: torch.Tensor, segments: list[Segment], cache: PagedKVCache,
               spec: ModelSpec) -> StepMeta:
    """`meta` of a step whose segments mix single-token (decode) and longer ones, with its `MixedRows`; `meta`
    as it is where the step has no decode segment or nothing else (the caller's test)."""
    dec = [s for s in segments if s.num_tokens == 1]
    pre = [s for s in segments if s.num_tokens != 1]
    if not dec or not pre:
        return meta
    dev = positions.device
    d_rows = torch.tensor([s.row_start for s in dec], dtype=torch.int64, device=dev)
    p_rows = torch.tensor([r for s in pre for r in range(s.row_start, s.row_start + s.num_tokens)],
                          dtype=torch.int64, device=dev)
    table = dec[0].table
    if table is not None and all(s.table is table for s in dec):  # the step's table: its decode rows, on the device
        sub = table.index_select(0, torch.tensor([s.table_row for s in dec], dtype=torch.int64, device=dev))
        d_segs = [replace(s, row_start=i, table=sub, table_row=i) for i, s in enumerate(dec)]
    else:
        d_segs = [replace(s, row_start=i, table=None, table_row=0) for i, s in enumerate(dec)]
    p_segs, row = [], 0
    for s in pre:
        p_segs.append(replace(s, row_start=row))
        row += s.num_tokens
    rope_p = None if meta.rope is None else (meta.rope[0][p_rows], meta.rope[1][p_rows])
    mixed = MixedRows(d_rows, p_rows, d_segs, p_segs, step_meta(positions[d_rows], d_segs, cache, spec, decode=True),
                      StepMeta(rope=rope_p), segments[0].num_tokens == 1)
    return replace(meta, mixed=mixed)


def gqa_mixed(x: torch.Tensor, w: dict[str, torch.Tensor], positions: torch.Tensor, cache: PagedKVCache,
              layer: int, spec: ModelSpec, observer: MassObserver | None, mixed: MixedRows) -> torch.Tensor:
    """x [N, H] -> [N, H] for a mixed step: the decode rows through the paged kernel, the rest through
    `gqa_attention`, each row's output where its input was."""
    m = mixed

    def decode() -> torch.Tensor:
        return gqa_decode_paged(x[m.decode_rows], w, positions[m.decode_rows], m.decode_segments, cache, layer, spec,
                                observer, m.decode_meta)

    def prefill() -> torch.Tensor:
        return gqa_attention(x[m.prefill_rows], w, positions[m.prefill_rows], m.prefill_segments, cache, layer, spec,
                             observer, m.prefill_meta)

    if m.decode_first:
        out_d, out_p = decode(), prefill()
    else:
        out_p, out_d = prefill(), decode()
    out = out_p.new_empty(x.shape[0], out_p.shape[1])
    out[m.decode_rows] = out_d
    out[m.prefill_rows] = out_p
    return out


def gqa_decode_paged(x: torch.Tensor, w: dict[str, torch.Tensor], positions: torch.Tensor, segments: list[Segment],
                     cache: PagedKVCache, layer: int, spec: ModelSpec,
                     observer: MassObserver | None = None, meta: StepMeta | None = None) -> torch.Tensor:
    """One token per segment: write all new K/V rows at once, then one paged-kernel launch for the batch."""
    from tierplan.runtime.engine.graphs import fewest_rows  # graphs imports this module
    from tierplan.runtime.engine.kernels.paged_attention import paged_decode_attention

    n = x.shape[0]
    if meta is None or meta.table is None:
        meta = step_meta(positions, segments, cache, spec, decode=True)
    q, k, v = _project_qkv(x, w, positions, spec, meta.rope)
    table = meta.table
    kv = cache.gpu[:, layer]  # [Nblk, 2, T, Hkv, D]
    kv[meta.slot, 0, meta.offset] = k
    kv[meta.slot, 1, meta.offset] = v
    out = paged_decode_attention(q, kv[:, 0], kv[:, 1], table, meta.lens, real_rows=fewest_rows(n))  # [B, Hq, D]
    if isinstance(observer, QCapture):
        if layer in observer.saved:
            observer.saved[layer].copy_(q)
        return linear(out.reshape(n, -1), w, "o_proj")
    for i, s in enumerate(segments):
        if s.seq_id >= 0:  # padding rows of a bucket carry negative ids: nothing to observe
            observe(observer, layer, s, q[i], cache)
    return linear(out.reshape(n, -1), w, "o_proj")


# With a mask, SDPA may take a kernel that holds every score of the segment, [Hq, n, C]: a 42K-token prompt at 16K
# mean context asked the H200 for 107 GiB (phase run 26). Query rows go in chunks of at most this many scores;
# a segment under it is one call, as before.
MAX_SCORES_PER_CALL = 1 << 28


def query_chunks(num_rows: int, num_heads: int, context: int) -> list[tuple[int, int]]:
    """[(first, end)) query-row ranges of one segment, each holding at most MAX_SCORES_PER_CALL scores (at least
    one row a chunk)."""
    step = max(1, MAX_SCORES_PER_CALL // max(1, num_heads * context))
    return [(q0, min(num_rows, q0 + step)) for q0 in range(0, num_rows, step)]


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, window: int) -> torch.Tensor:
    """q [Hq, n, D] at positions first_pos.., k/v [Hq, C, D] -> [n, Hq, D]: each query sees the keys up to its own
    position (and within `window` of it, where set). Without a window the keys past the last query are cut and
    the mask is the lower-right causal bias, which CUDA runs in the flash kernel; a boolean mask makes SDPA take
    its math path, which upcasts to float32 and held 2.1 s of a 16K-token prefill on the H100 (engine_run16)."""
    end = first_pos + q.shape[1]
    if not window:
        bias = causal_lower_right(q.shape[1], end)
        return F.scaled_dot_product_attention(q[None], k[None, :, :end], v[None, :, :end], attn_mask=bias)[0] \
            .transpose(0, 1)
    cols = torch.arange(k.shape[1], device=q.device)[None, :]  # [1, C]
    p = torch.arange(first_pos, end, device=q.device)[:, None]  # [n, 1]
    mask = (cols <= p) & (cols > p - window)  # [n, C]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1)


def gqa_attention(x: torch.Tensor, w: dict[str, torch.Tensor], positions: torch.Tensor, segments: list[Segment],
                  cache: PagedKVCache, layer: int, spec: ModelSpec,
                  observer: MassObserver | None = None, meta: StepMeta | None = None) -> torch.Tensor:
    """x [N, H] -> [N, H]; writes the N new K/V rows into the cache first. The caller marks the written
    blocks dirty once per step (`PagedKVCache.mark_written`), not every layer."""
    if spec.attention is not AttentionKind.GQA:
        raise ConfigError(f"{spec.name}: attention kind {spec.attention.value} has no reference kernel yet")
    n = x.shape[0]
    nh, nkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    q, k, v = _project_qkv(x, w, positions, spec, meta.rope if meta is not None else None)
    bt = cache.block_tokens
    kv = cache.gpu[:, layer]  # [Nblk, 2, T, Hkv, D]
    out = torch.empty(n, nh, d, dtype=x.dtype, device=x.device)  # [N, Hq, D]
    for s in segments:
        slots = s.slots(cache)  # [B]
        rows = slice(s.row_start, s.row_start + s.num_tokens)
        pos = positions[rows]
        kv[slots[pos // bt], 0, pos % bt] = k[rows]
        kv[slots[pos // bt], 1, pos % bt] = v[rows]
        ctx = s.context_len
        nb = cache.num_blocks_for(ctx)
        keys = kv[slots[:nb], 0].reshape(nb * bt, nkv, d)[:ctx]  # [C, Hkv, D]
        vals = kv[slots[:nb], 1].reshape(nb * bt, nkv, d)[:ctx]
        qs = q[rows].transpose(0, 1)  # [Hq, n, D]
        ks = keys.transpose(0, 1).repeat_interleave(nh // nkv, 0)  # [Hq, C, D]
        vs = vals.transpose(0, 1).repeat_interleave(nh // nkv, 0)
        seg_out = out[rows]  # [n, Hq, D], a view
        for q0, q1 in query_chunks(s.num_tokens, nh, ctx):
            seg_out[q0:q1] = _causal_sdpa(qs[:, q0:q1], ks, vs, s.first_pos + q0, spec.sliding_window)
        observe(observer, layer, s, q[rows][-1], cache, keys)
    return linear(out.reshape(n, nh * d), w, "o_proj")


def attention(x: torch.Tensor, w: dict[str, torch.Tensor], positions: torch.Tensor, segments: list[Segment],
              cache: PagedKVCache, layer: int, spec: ModelSpec, decode_kernel: bool = False,
              observer: MassObserver | None = None, meta: StepMeta | None = None) -> torch.Tensor:
    """x [N, H] -> [N, H] with the spec's attention kind; same contract as gqa_attention.

    decode_kernel: a batch of single-token (decode) segments goes through the Triton paged kernel.
    observer: samples attention mass per KV block (GQA)."""
    if spec.attention is AttentionKind.GQA:
        # The paged kernel attends to the whole context: a sliding window takes the reference path.
        if decode_kernel and not spec.sliding_window and all(s.num_tokens == 1 for s in segments):
            return gqa_decode_paged(x, w, positions, segments, cache, layer, spec, observer, meta)
        if meta is not None and meta.mixed is not None:  # made only where the kernel may run (MoEModel.start)
            return gqa_mixed(x, w, positions, cache, layer, spec, observer, meta.mixed)
        return gqa_attention(x, w, positions, segments, cache, layer, spec, observer, meta)
    if spec.attention is AttentionKind.MLA:
        from tierplan.runtime.engine.mla import mla_attention  # mla.py imports Segment/rms_norm/rope from here

        return mla_attention(x, w, positions, segments, cache, layer, spec)
    raise ConfigError(f"{spec.name}: attention kind {spec.attention.value} has no reference kernel")
