"""The one model of step time: the optimizer values its options with it, `tierplan sim` replays traces over
it, the reports explain stalls with it.

Runs in the controller process and in `tierplan sim`; pure Python + numpy, never torch, runtime or agent.

A step walks the layers in order. Each layer computes a dense/attention part, then (MoE layers) its experts:
    dense_ms(T, C)  = dense_ms + dense_ms_per_token * T + attn_ms_per_ctx_token * C
    expert_ms(T, A, M) = moe_ms + moe_ms_per_token * T + moe_ms_per_active_expert * A + moe_ms_per_miss * M
(T tokens in the step, C context tokens its attention reads, A distinct experts the layer's batch routes to, M
of them loaded on demand at the layer), plus `step_ms` once per step (scheduling, sampling). `moe_ms_per_miss` is
what a demand load costs the step besides the wait the agent times as its stall: the host issuing the copy and
mapping the slot, and, where the layer's union outruns its slots, the chunks the engine then runs one after
another (H200 phase runs 26-29: decode steps with ~400 misses spent 55-80 ms outside their timed stall where
steps with ~50 spent 5-10, a cost no other term moved with). `chunked_step_ms` is what a decode step pays once
for running chunked off its graphs, where some layer's experts do not fit its slots at once (the reference
engine's `eager/layer_over_slots`): over the H100 and H200 phase runs 01-40, such steps' compute was 9-27 ms
above graph steps of the same batch beyond their misses at 0.06-0.16 ms each (bench/results/phase_h200.md,
session 25); `StepLoad.chunked` says a step runs so, and the valuation prices each layer's chance of it.
Bytes cross links (`controller.protocol.Link`): a
transfer of n records and b bytes takes n * overhead + b / bandwidth (small records pay the host's per-load
cost). KV blocks the step needs are fetched first (NVMe -> host -> HBM); attention waits for them (KV stall).
Prefetched experts stream on the host->device link behind them, in layer order, while earlier layers compute
(issued `prefetch_lookahead_layers` ahead, or all at step start when None). A miss found at the layer itself
is urgent: it goes ahead of queued prefetches and the layer waits for it (expert stall). A step that waited
on both counts all its stall as BOTH, as the agent's telemetry does. Spills (d2h, h2disk) overlap the step;
a link busy longer than the step stretches it (KV stall).

Public API (what the optimizer, the loop and the simulator use):
- `HardwareSpec(link_bytes_per_s={Link.H2D: ..., ...}, transfer_overhead_s, hbm_bytes, hbm_bytes_per_s)`
- `ComputeParams(...)` the nine compute coefficients above; `ComputeParams.prior_for(shape, hw, layer_ms)`.
- `StepLoad(batch_tokens, context_tokens, active_experts, miss_count, prefetch_count, kv_* bytes/counts)`:
  per-MoE-layer tuples (length shape.num_moe_layers, or empty for "none" / "estimate").
- `CostModel(shape, hardware, compute=None, prior_strength=1.0, forgetting=0.98)`:
  `.step_time_ms(load) -> StepBreakdown`, `.layer_stall_ms(num_missed, num_streamed, batch_tokens,
  context_tokens, window_layers) -> float`, `.transfer_ms(link, num_bytes, num_transfers) -> float`,
  `.compute_ms(batch_tokens, context_tokens) -> float`, `.calibrate(telemetry) -> None` (online, one window at
  a time), `.observe(...)` (one observation: a window's per-step means or a single step), `.compute` (current
  ComputeParams), `.link_bytes_per_s(link)`, `.overhead_s(link)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from tierplan.controller.costmodel_fit import HUBER_K, OnlineLinear
from tierplan.controller.model_shape import ModelShape
from tierplan.controller.protocol import Link, StallCause, Telemetry, Tier

TYPICAL_STEP_TOKENS = 8.0  # a decode step's tokens, and its context, for the prior's spreads (CostModel)
TYPICAL_CONTEXT_TOKENS = 8.0 * 1024


@dataclass(frozen=True)
class HardwareSpec:
    link_bytes_per_s: Mapping[Link, float]  # every Link; a link absent here is refused by CostModel
    transfer_overhead_s: float  # host cost per transfer record, on every link
    hbm_bytes: int
    hbm_bytes_per_s: float = 0.0  # HBM read bandwidth: the prior of each active expert's compute; 0 = unknown
    name: str = ""

    def __post_init__(self) -> None:
        bw = {Link(k): float(v) for k, v in self.link_bytes_per_s.items()}
        missing = [lk.value for lk in Link if lk not in bw]
        if missing or any(not v > 0 for v in bw.values()):
            raise ValueError(f"HardwareSpec {self.name!r}: link_bytes_per_s needs a bandwidth > 0 for every link "
                             f"{[lk.value for lk in Link]}; missing {missing}, got {bw}")
        if not self.transfer_overhead_s >= 0 or self.hbm_bytes < 0 or not self.hbm_bytes_per_s >= 0:
            raise ValueError(f"HardwareSpec {self.name!r}: transfer_overhead_s, hbm_bytes and hbm_bytes_per_s "
                             "must be >= 0")
        object.__setattr__(self, "link_bytes_per_s", bw)


@dataclass(frozen=True)
class ComputeParams:
    step_ms: float = 0.0
    dense_ms: float = 0.0
    moe_ms: float = 0.0
    dense_ms_per_token: float = 0.0
    attn_ms_per_ctx_token: float = 0.0
    moe_ms_per_token: float = 0.0
    moe_ms_per_active_expert: float = 0.0
    moe_ms_per_miss: float = 0.0
    chunked_step_ms: float = 0.0  # once per decode step run chunked off its graphs (module docstring)

    def as_tuple(self) -> tuple[float, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))

    @classmethod
    def prior_for(cls, shape: ModelShape, hw: HardwareSpec, layer_ms: float = 0.0) -> ComputeParams:
        """Constants as a prior: `layer_ms` per layer of dense/attention work, each active expert's weights read
        once from HBM, the dense weights read once per step."""
        per_expert_ms = shape.expert_bytes / hw.hbm_bytes_per_s * 1e3 if hw.hbm_bytes_per_s else 0.0
        dense_read_ms = shape.dense_bytes / shape.num_layers / hw.hbm_bytes_per_s * 1e3 if hw.hbm_bytes_per_s else 0.0
        return cls(dense_ms=max(layer_ms, dense_read_ms), moe_ms_per_active_expert=per_expert_ms)


def _per_layer(name: str, values: tuple[int, ...], num: int) -> tuple[int, ...]:
    if values and len(values) != num:
        raise ValueError(f"StepLoad.{name}: has {len(values)} entries, expected one per MoE layer ({num}) or none")
    if any(v < 0 for v in values):
        raise ValueError(f"StepLoad.{name}: entries must be >= 0, got {values}")
    return values or (0,) * num


@dataclass(frozen=True)
class StepLoad:
    batch_tokens: int
    context_tokens: int = 0
    active_experts: tuple[int, ...] = ()  # per MoE layer; empty = expected union of uniform routing
    miss_count: tuple[int, ...] = ()  # per MoE layer: experts loaded on demand at the layer
    prefetch_count: tuple[int, ...] = ()  # per MoE layer: experts streamed ahead of the layer
    kv_fetch_bytes: int = 0  # host -> HBM (blocks found on the CPU tier)
    kv_fetch_count: int = 0
    kv_disk_read_bytes: int = 0  # NVMe -> host -> HBM
    kv_disk_read_count: int = 0
    kv_spill_bytes: int = 0  # HBM -> host
    kv_spill_count: int = 0
    kv_disk_write_bytes: int = 0  # host -> NVMe
    kv_disk_write_count: int = 0
    chunked: bool = False  # the step runs chunked off its graphs: some layer's experts exceed its slots


@dataclass(frozen=True)
class StepBreakdown:
    total_ms: float
    compute_ms: float  # all layers' compute plus step_ms
    compute_ms_per_layer: tuple[float, ...]  # every model layer
    expert_stall_ms_per_layer: tuple[float, ...]  # every MoE layer (BOTH included)
    stall_ms: dict[StallCause, float]
    link_ms: dict[Link, float]  # busy time per link within the step

    def to_dict(self) -> dict[str, object]:
        return {"total_ms": self.total_ms, "compute_ms": self.compute_ms,
                "stall_ms": {c.value: v for c, v in self.stall_ms.items()},
                "link_ms": {lk.value: v for lk, v in self.link_ms.items()}}


@dataclass
class _Timeline:
    end_ms: float
    compute_ms_per_layer: list[float] = field(default_factory=list)
    stall_ms_per_moe: list[float] = field(default_factory=list)
    h2d_busy_ms: float = 0.0


class CostModel:
    def __init__(self, shape: ModelShape, hardware: HardwareSpec, compute: ComputeParams | None = None,
                 prior_strength: float = 1.0, forgetting: float = 0.98, prefetch_lookahead_layers: int | None = None,
                 huber_k: float = HUBER_K) -> None:
        """huber_k: how far (in median absolute residuals) an observation may fall from the fit before it counts
        less (`OnlineLinear`): the default suits telemetry windows, whose means already smooth a slow step out."""
        self.shape, self.hardware = shape, hardware
        self.prefetch_lookahead_layers = prefetch_lookahead_layers
        prior = compute or ComputeParams.prior_for(shape, hardware)
        # A prior is believed to within 10x of its share of a typical step, and a coefficient given as 0 to within
        # 1 ms of it: data soon outweigh it, while what telemetry cannot see (e.g. attention per context token)
        # stays where the user put it. Each spread is per unit of its feature, so it is over the feature's size in
        # a typical step (`_typical_features`): one spread of 1 in raw units let the fit explain a fixed cost by
        # its largest feature (an H100 b1 decode's 2.7 ms as 64 active experts x 0.05 ms and no intercept), which
        # then mispriced every step of other counts. Replayed over the H100/H200 phase steps of runs 01-40
        # (bench/phase_cost_replay.py), with the bench's step forgetting: 146 of 225 runs within 15 %,
        # against 133 with one spread.
        scale = [max(10 * abs(v), 1.0 / t) for v, t in zip(prior.as_tuple(), self._typical_features(), strict=True)]
        self._compute_fit = OnlineLinear(prior.as_tuple(), scale, prior_strength, forgetting, robust=True,
                                         huber_k=huber_k)
        self._link_fit: dict[Link, OnlineLinear] = {}
        for lk in Link:  # theta = (ms per transfer, ms per byte)
            mean = (hardware.transfer_overhead_s * 1e3, 1e3 / hardware.link_bytes_per_s[lk])
            scale = [max(10 * mean[0], 0.1), 10 * mean[1]]
            self._link_fit[lk] = OnlineLinear(mean, scale, prior_strength, forgetting, robust=True, huber_k=huber_k)
        self._refresh()

    def _refresh(self) -> None:
        # A cost is never negative, and a link is never believed 10x faster than its rating: telemetry of
        # equal-sized loads cannot split a load's time into per-record and per-byte parts.
        self.compute = ComputeParams(*(float(v) for v in self._compute_fit.theta_at_least([0.0] * len(fields(
            ComputeParams)))))
        self._link_theta = {}
        for lk, f in self._link_fit.items():
            floor = 1e3 / self.hardware.link_bytes_per_s[lk] / 10
            ovh, per_byte = f.theta_at_least([0.0, floor])
            self._link_theta[lk] = (float(ovh), float(per_byte))

    # ---- parameters ---------------------------------------------------------------------------------
    def link_bytes_per_s(self, link: Link) -> float:
        ms_per_byte = self._link_theta[link][1]
        return 1e3 / ms_per_byte if ms_per_byte > 0 else float("inf")

    def overhead_s(self, link: Link) -> float:
        return self._link_theta[link][0] / 1e3

    def transfer_ms(self, link: Link, num_bytes: float, num_transfers: float) -> float:
        ovh, per_byte = self._link_theta[link]
        return num_transfers * ovh + num_bytes * per_byte if num_transfers or num_bytes else 0.0

    def expected_active(self, batch_tokens: float) -> float:
        """Distinct experts of one layer under uniform top-k routing of `batch_tokens` tokens."""
        e, k = self.shape.num_experts, self.shape.top_k
        return e * (1.0 - (1.0 - k / e) ** max(0.0, batch_tokens))

    def _typical_features(self) -> list[float]:
        """The sizes the prior's spreads are scaled by: the features of a decode step of TYPICAL_STEP_TOKENS tokens
        reading TYPICAL_CONTEXT_TOKENS of context, with the least a step routes active (top-k experts a layer),
        one miss a layer, and run chunked."""
        m, k = self.shape.num_moe_layers, self.shape.top_k
        return [max(1.0, x) for x in self._features(TYPICAL_STEP_TOKENS, TYPICAL_CONTEXT_TOKENS, m * k, m, 1.0)]

    def _features(self, tokens: float, ctx: float, active_sum: float, miss_sum: float = 0.0,
                  chunked: float = 0.0) -> list[float]:
        n, m = self.shape.num_layers, self.shape.num_moe_layers
        return [1.0, n, m, n * tokens, n * ctx, m * tokens, active_sum, miss_sum, chunked]

    def compute_ms(self, batch_tokens: float, context_tokens: float = 0.0) -> float:
        """Step compute with no stall (active experts estimated from the batch)."""
        active = self.shape.num_moe_layers * self.expected_active(batch_tokens)
        x = self._features(batch_tokens, context_tokens, active)
        return float(sum(a * b for a, b in zip(x, self.compute.as_tuple(), strict=True)))

    # ---- the step -----------------------------------------------------------------------------------
    def _timeline(self, load: StepLoad, active: tuple[float, ...], misses: tuple[int, ...],
                  prefetches: tuple[int, ...], kv_ready_ms: float) -> _Timeline:
        p, shape = self.compute, self.shape
        eb = shape.expert_bytes
        dense = p.dense_ms + p.dense_ms_per_token * load.batch_tokens + p.attn_ms_per_ctx_token * load.context_tokens
        moe_index = {layer: j for j, layer in enumerate(shape.moe_layers)}
        pref_ms = [self.transfer_ms(Link.H2D, n * eb, n) for n in prefetches]
        done: dict[int, float] = {}  # MoE index -> prefetch arrival
        t = link_end = kv_ready_ms
        busy = 0.0
        issued = 0
        look = self.prefetch_lookahead_layers
        tl = _Timeline(end_ms=0.0)
        for layer in range(shape.num_layers):
            # Prefetches for MoE layers up to `layer + lookahead` are on the queue once this layer starts.
            horizon = shape.num_layers if look is None else layer + look
            while issued < len(pref_ms) and shape.moe_layers[issued] <= horizon:
                if pref_ms[issued]:
                    link_end = max(link_end, t) + pref_ms[issued]
                    busy += pref_ms[issued]
                done[issued] = link_end if pref_ms[issued] else 0.0
                issued += 1
            j = moe_index.get(layer)
            if j is None:
                tl.compute_ms_per_layer.append(dense)
                t += dense
                continue
            routed = t + dense
            miss_ms = self.transfer_ms(Link.H2D, misses[j] * eb, misses[j])
            if miss_ms:  # urgent: ahead of everything still queued, which moves back by as much
                busy += miss_ms
                if link_end > routed:  # else nothing is queued (arrivals only grow along the queue)
                    done = {i: (d + miss_ms if d > routed else d) for i, d in done.items()}
                link_end = link_end + miss_ms if link_end > routed else routed + miss_ms
            ready = max(routed + miss_ms, done.get(j, 0.0))
            stall = max(0.0, ready - routed)
            expert = (p.moe_ms + p.moe_ms_per_token * load.batch_tokens + p.moe_ms_per_active_expert * active[j]
                      + p.moe_ms_per_miss * misses[j])
            tl.compute_ms_per_layer.append(dense + expert)
            tl.stall_ms_per_moe.append(stall)
            t = routed + stall + expert
        tl.end_ms = t + p.step_ms + (p.chunked_step_ms if load.chunked else 0.0)
        tl.h2d_busy_ms = busy
        return tl

    def step_time_ms(self, load: StepLoad) -> StepBreakdown:
        m = self.shape.num_moe_layers
        misses = _per_layer("miss_count", tuple(load.miss_count), m)
        prefetches = _per_layer("prefetch_count", tuple(load.prefetch_count), m)
        if load.active_experts:
            active: tuple[float, ...] = tuple(float(a) for a in _per_layer("active_experts", load.active_experts, m))
        else:
            active = (self.expected_active(load.batch_tokens),) * m
        disk_ms = self.transfer_ms(Link.DISK2H, load.kv_disk_read_bytes, load.kv_disk_read_count)
        kv_h2d_ms = self.transfer_ms(Link.H2D, load.kv_fetch_bytes + load.kv_disk_read_bytes,
                                     load.kv_fetch_count + load.kv_disk_read_count)
        with_kv = self._timeline(load, active, misses, prefetches, disk_ms + kv_h2d_ms)
        links = {Link.H2D: with_kv.h2d_busy_ms + kv_h2d_ms, Link.DISK2H: disk_ms,
                 Link.D2H: self.transfer_ms(Link.D2H, load.kv_spill_bytes, load.kv_spill_count),
                 Link.H2DISK: self.transfer_ms(Link.H2DISK, load.kv_disk_write_bytes, load.kv_disk_write_count)}
        total = with_kv.end_ms
        overflow = max(0.0, links[Link.D2H] + links[Link.H2DISK] - total)  # spills chain d2h then h2disk
        total += overflow
        expert_stall, kv_stall = sum(with_kv.stall_ms_per_moe), disk_ms + kv_h2d_ms + overflow
        if expert_stall > 0 and kv_stall > 0:  # as the agent's telemetry counts a step that waited on both
            stalls = {StallCause.EXPERT_MISS: 0.0, StallCause.KV_MISS: 0.0, StallCause.BOTH: expert_stall + kv_stall}
        else:
            stalls = {StallCause.EXPERT_MISS: expert_stall, StallCause.KV_MISS: kv_stall, StallCause.BOTH: 0.0}
        compute = (sum(with_kv.compute_ms_per_layer) + self.compute.step_ms
                   + (self.compute.chunked_step_ms if load.chunked else 0.0))
        return StepBreakdown(total, compute, tuple(with_kv.compute_ms_per_layer), tuple(with_kv.stall_ms_per_moe),
                             stalls, links)

    def layer_stall_ms(self, num_missed: float, num_streamed: float = 0.0, batch_tokens: float = 1.0,
                       context_tokens: float = 0.0, window_layers: float = 1.0) -> float:
        """One MoE layer's stall: its `num_missed` demand loads in full (each also its `moe_ms_per_miss`), plus
        whatever of streaming `num_streamed` experts does not fit in the compute of the `window_layers` layers
        before it."""
        eb = self.shape.expert_bytes
        window = window_layers * self.compute_ms(batch_tokens, context_tokens) / self.shape.num_layers
        stream = self.transfer_ms(Link.H2D, num_streamed * eb, num_streamed)
        return (max(0.0, stream - window) + self.transfer_ms(Link.H2D, num_missed * eb, num_missed)
                + self.compute.moe_ms_per_miss * num_missed)

    def _active_per_step(self, counts: tuple[int, ...], tokens_per_step: float, num_steps: int) -> float:
        """Distinct experts one step of the window routed to in a layer: exact for a one-step window, else the
        uniform expectation, capped by the experts the window saw at all."""
        seen = sum(1 for c in counts if c)
        return float(seen) if num_steps == 1 else min(float(seen), self.expected_active(tokens_per_step))

    # ---- online calibration -------------------------------------------------------------------------
    def calibrate(self, telemetry: Telemetry) -> None:
        """Fold one telemetry window in. Compute: the mean step less its stalls, against the tokens per step
        (the window's MoE layers' token counts), the distinct experts per step (exact in one-step windows) and
        the context attention reads (the GPU KV blocks at the window's end, exact in one-step windows up to
        block rounding), and the share of its steps the agent ran chunked (`Telemetry.chunked_steps`). Host->device
        link: the
        stall time against the demand loads (expert misses and KV blocks fetched from CPU/NVMe) and their
        bytes. Both fits are robust (a step a neighbour preempted counts less) and forget slowly."""
        n = telemetry.step_timings_ms.num_steps
        if n == 0:
            return
        layers = [row.num_tokens for row in telemetry.layers]
        tokens = sum(layers) / len(layers) / n if layers else 0.0
        stall_total = sum(s.total_ms for s in telemetry.stalls)
        compute_per_step = telemetry.step_timings_ms.mean - stall_total / n
        active = sum(self._active_per_step(row.activation_counts, tokens, n) for row in telemetry.layers)
        active *= self.shape.num_moe_layers / len(layers) if layers else 0.0
        # What attention reads: the KV blocks held on the GPU when the window closed (a one-step window's
        # sequences, rounded up to whole blocks).
        ctx = telemetry.kv.blocks_per_tier.get(Tier.GPU, 0) * self.shape.block_tokens
        kv_loads = sum(v for tier, v in telemetry.kv.misses_per_tier.items() if tier.value != "gpu")
        loads = telemetry.expert_misses + kv_loads
        demand_bytes = telemetry.expert_misses * self.shape.expert_bytes + kv_loads * self.shape.kv_bytes_per_block
        self.observe(tokens, ctx, active, compute_per_step, loads / n, demand_bytes / n, stall_total / n, weight=n,
                     expert_misses=telemetry.expert_misses / n, chunked=telemetry.chunked_steps / n)

    def observe(self, batch_tokens: float, context_tokens: float, active_experts: float, compute_ms: float,
                demand_loads: float = 0.0, demand_bytes: float = 0.0, stall_ms: float = 0.0,
                weight: float = 1.0, expert_misses: float = 0.0, chunked: float = 0.0) -> None:
        """Fold one observation in (a telemetry window's per-step means, or one step measured on its own, as the
        phase bench's records are): a step of `batch_tokens` tokens reading `context_tokens` of context, whose
        MoE layers ran `active_experts` distinct experts in all, took `compute_ms` besides its `stall_ms` of
        waiting on `demand_loads` host->device loads of `demand_bytes`, `expert_misses` of them experts (what the
        compute side pays per miss: `moe_ms_per_miss`), `chunked` the share of its steps run chunked off their
        graphs (`chunked_step_ms`). `weight`: steps it stands for."""
        self._compute_fit.update(self._features(batch_tokens, context_tokens, active_experts, expert_misses,
                                                chunked), compute_ms, weight=weight)
        if demand_loads:
            self._link_fit[Link.H2D].update([demand_loads, demand_bytes], stall_ms, weight=weight)
        self._refresh()
