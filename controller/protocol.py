"""Every message that crosses a process: agent -> sidecar -> controller and back (pydantic v2, versioned).

Imported by the inference process (agent, sidecar) and by the controller service alike, so it is plain data
plus validation. It must never import torch, runtime or agent, touch the network or disk, or keep state.
Each top-level message carries `schema_version`; a change old readers cannot parse bumps it. Sequences are
tuples so a frozen message is immutable all the way down (a list given on input is accepted and converted).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from types import MappingProxyType
from typing import Annotated, Any, Literal, NamedTuple, Self

from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator

from tierplan.controller.protocol_kv import MAX_RETENTION, KvRetention  # noqa: F401 - re-exported
from tierplan.controller.protocol_predictor import (  # noqa: F401 - re-exported: the agent imports only this module
    MAX_TOP_M,
    MAX_UNION_STEPS,
    LayerTransitions,
    LayerUnions,
    LocalPredictor,
    PredictorKind,
    PrefetchCounts,
    Successor,
    TransitionPair,
    TransitionRow,
    check_predictor,
    check_since,
    check_transitions,
    check_unions,
    check_v2_only,
)
from tierplan.controller.validation import (  # noqa: F401 - parse, to_json, ProtocolError are this module's API too
    MAX_EXPERTS,
    MAX_FALLBACK_NAMES,
    MAX_ID_CHARS,
    MAX_ITEMS,
    MAX_LAYERS,
    MAX_PAIRS_PER_LAYER,
    MAX_TEXT_CHARS,
    NUM_ERRORS_SHOWN,
    Count,
    ExpertIndex,
    Id,
    LayerIndex,
    Millis,
    NumExperts,
    NumLayers,
    Probability,
    ProtocolError,
    Seconds,
    Text,
    Version,
    _invalid,
    parse,
    to_json,
)
from tierplan.controller.validation import refuse_repeats as _refuse_repeats

# Version 2 (Telemetry, Plan) adds the local predictor: a plan may carry a transition table and a prefetch
# byte budget per step, telemetry the cross-layer counts it is trained from. Version 1 is still accepted: a
# version-1 message is exactly a version-2 one without those fields (a sidecar's cached plan, or an agent
# not yet upgraded, keeps working), so a version-1 message that carries them is refused. Plan version 3
# adds the KV retention order (protocol_kv.py) under the same rule; Telemetry version 3 each step's decode
# tokens and the count of steps run chunked (an agent sends 2 where it reports neither, so an older controller
# still reads it).
SchemaVersion = Literal[1, 2, 3]
PlanSchemaVersion = Literal[1, 2, 3]


class Tier(StrEnum):
    GPU = "gpu"
    CPU = "cpu"
    NVME = "nvme"


class StallCause(StrEnum):
    EXPERT_MISS = "expert_miss"
    KV_MISS = "kv_miss"
    BOTH = "both"


class Link(StrEnum):  # runtime's transfer links by value; repeated here because the controller never imports runtime
    H2D = "h2d"
    D2H = "d2h"
    DISK2H = "disk2h"
    H2DISK = "h2disk"


class AckStatus(StrEnum):
    APPLIED = "applied"
    REJECTED = "rejected"


class RejectReason(StrEnum):
    STALE = "stale"  # base_version is not the agent's applied version
    OVER_BUDGET = "over_budget"
    MALFORMED = "malformed"
    UNKNOWN_EXPERT = "unknown_expert"
    OTHER = "other"


class ProtocolModel(BaseModel):
    """Base of every message and part: immutable, unknown fields refused, NaN/inf refused (not JSON)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class ExpertKey(ProtocolModel):
    layer: LayerIndex
    expert: ExpertIndex


def _check_layer_rows(rows: Sequence[Any], vector: str, num_layers: int, num_experts: int) -> None:
    """Rows keyed by `.layer`: in range, unique, and `.<vector>` of length num_experts."""
    for i, row in enumerate(rows):
        if row.layer >= num_layers:
            raise _invalid(f"layers.{i}.layer", f"{row.layer} is out of range for num_layers={num_layers}")
        if len(getattr(row, vector)) != num_experts:
            detail = f"has {len(getattr(row, vector))} entries, expected num_experts={num_experts}"
            raise _invalid(f"layers.{i}.{vector}", detail)
    _refuse_repeats("layers", [row.layer for row in rows], ".layer")


# ---- Telemetry (agent -> sidecar -> controller, one per window) ----
class CoPair(NamedTuple):
    """`count` tokens of the window routed to both experts `a` and `b`; stored once, with a < b (checked by
    LayerStats). A named tuple, not a model: a 48-layer window carries ~3,000 of them, and a model each cost
    the agent ~10 ms per window to validate; in JSON a pair is `[a, b, count]` (an object is accepted too)."""

    a: ExpertIndex
    b: ExpertIndex
    count: Count


class LayerStats(ProtocolModel):
    layer: LayerIndex
    activation_counts: tuple[Count, ...] = Field(max_length=MAX_EXPERTS)  # indexed by expert id
    cooccurrence: tuple[CoPair, ...] = Field(default=(), max_length=MAX_PAIRS_PER_LAYER)  # sparse top pairs
    router_entropy_mean: float = Field(ge=0)
    num_tokens: Count

    @model_validator(mode="after")
    def _unique_pairs(self) -> Self:
        for k, p in enumerate(self.cooccurrence):
            if p.a >= p.b:
                raise _invalid(f"cooccurrence.{k}.b", f"{p.b} must be greater than a={p.a} (each pair is stored "
                                                      "once, a < b)")
        _refuse_repeats("cooccurrence", [(p.a, p.b) for p in self.cooccurrence])
        return self


class ReuseEvent(ProtocolModel):
    """A prefix's KV blocks were reused `age_s` after they were last touched, found in `tier`."""

    prefix_hash: Id
    age_s: Seconds
    tier: Tier


class BlockMass(ProtocolModel):
    """Sampled share of attention a KV block received (mean over sampled queries, heads and layers)."""

    block: Count  # the agent's KV block id
    mass: Probability
    samples: Count


class KVStats(ProtocolModel):
    blocks_per_tier: dict[Tier, Count]
    hits_per_tier: dict[Tier, Count]
    misses_per_tier: dict[Tier, Count]
    reuse_events: tuple[ReuseEvent, ...] = Field(default=(), max_length=MAX_ITEMS)
    attention_mass: tuple[BlockMass, ...] = Field(default=(), max_length=MAX_ITEMS)

    @model_validator(mode="after")
    def _unique_blocks(self) -> Self:
        _refuse_repeats("attention_mass", [b.block for b in self.attention_mass])
        return self


class LinkStats(ProtocolModel):
    link: Link
    bytes: Count
    queue_delay_ms_mean: Millis
    queue_delay_ms_max: Millis

    @model_validator(mode="after")
    def _mean_within_max(self) -> Self:
        if self.queue_delay_ms_mean > self.queue_delay_ms_max:
            detail = f"{self.queue_delay_ms_mean} exceeds queue_delay_ms_max={self.queue_delay_ms_max}"
            raise _invalid("queue_delay_ms_mean", detail)
        return self


class Stall(ProtocolModel):
    cause: StallCause
    count: Count
    total_ms: Millis


class StepTimings(ProtocolModel):
    """Engine step durations over the window, in milliseconds."""

    num_steps: Count
    mean: Millis
    p50: Millis
    p99: Millis

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.p50 > self.p99:
            raise _invalid("p50", f"{self.p50} exceeds p99={self.p99}")
        return self


class LayerSlots(ProtocolModel):
    """A MoE layer's expert slots in the split in force (telemetry's `expert_slots`)."""

    layer: LayerIndex
    slots: Count


class Telemetry(ProtocolModel):
    schema_version: SchemaVersion = 3
    agent_id: Id
    rank: Count
    window_seq: Count
    window_start_s: Seconds
    window_end_s: Seconds
    model: Text
    num_layers: NumLayers
    num_experts: NumExperts
    layers: tuple[LayerStats, ...] = Field(max_length=MAX_LAYERS)  # may cover a subset (e.g. this rank's)
    kv: KVStats
    links: tuple[LinkStats, ...] = Field(default=(), max_length=len(Link))
    stalls: tuple[Stall, ...] = Field(default=(), max_length=len(StallCause))
    step_timings_ms: StepTimings
    expert_hits: Count
    expert_misses: Count
    applied_plan_version: Count  # 0 until the first plan is applied
    fallbacks: dict[Id, Count] = Field(default_factory=dict, max_length=MAX_FALLBACK_NAMES)
    transitions: tuple[LayerTransitions, ...] = Field(default=(), max_length=MAX_LAYERS)  # v2: cross-layer pairs
    step_unions: tuple[LayerUnions, ...] = Field(default=(), max_length=MAX_LAYERS)  # v2: experts needed per step
    queued_kv_blocks: Count = 0  # v2: KV blocks the requests waiting for admission (or swapped out) would need
    local_prefetch: PrefetchCounts | None = None  # v2: what the plan's local predictor did this window
    # v2: the tokens of each step (its newest MAX_UNION_STEPS), or none: the typical step's batch without unions
    step_tokens: tuple[Count, ...] = Field(default=(), max_length=MAX_UNION_STEPS)
    # v3: of each step's tokens, those of sequences decoding (one each; the rest are prompt chunks), or none: the
    # running batch, which the median whole step overstates where most steps carry a prompt chunk
    step_decode_tokens: tuple[Count, ...] = Field(default=(), max_length=MAX_UNION_STEPS)
    # v3: steps of the window run chunked off their graphs because some layer's experts did not fit its slots at
    # once (the reference engine's eager/layer_over_slots): a cost each such step pays once (CostModel)
    chunked_steps: Count = 0
    # v2: the GPU KV blocks the share in force allows at the window's end (None: not reported). The controller
    # learns the split the agent started with from it, a split it never issued.
    kv_gpu_limit_blocks: Count | None = None
    # v3: each MoE layer's expert slots in the split in force at the window's end, by model layer (empty: not
    # reported); with kv_gpu_limit_blocks, the whole split the agent started with, which the first plan is weighed
    # against as any later plan is against the split in force.
    expert_slots: tuple[LayerSlots, ...] = Field(default=(), max_length=MAX_LAYERS)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        check_v2_only(self, ("transitions", "step_unions", "queued_kv_blocks", "local_prefetch", "step_tokens",
                             "kv_gpu_limit_blocks"), "telemetry")
        check_since(self, 3, ("step_decode_tokens", "chunked_steps", "expert_slots"), "telemetry")
        want = min(self.step_timings_ms.num_steps, MAX_UNION_STEPS)
        if self.step_tokens and len(self.step_tokens) != want:
            raise _invalid("step_tokens", f"has {len(self.step_tokens)} steps, expected {want} (the window's "
                                          f"{self.step_timings_ms.num_steps} steps, at most {MAX_UNION_STEPS})")
        if self.chunked_steps > self.step_timings_ms.num_steps:
            raise _invalid("chunked_steps", f"{self.chunked_steps} exceeds the window's "
                                            f"{self.step_timings_ms.num_steps} steps")
        if self.step_decode_tokens:
            if len(self.step_decode_tokens) != len(self.step_tokens):
                raise _invalid("step_decode_tokens", f"has {len(self.step_decode_tokens)} steps, expected one per "
                                                     f"step_tokens ({len(self.step_tokens)})")
            for i, (d, t) in enumerate(zip(self.step_decode_tokens, self.step_tokens, strict=True)):
                if d > t:
                    raise _invalid(f"step_decode_tokens.{i}", f"{d} exceeds the step's {t} tokens (step_tokens.{i})")
        check_transitions(self.transitions, self.num_layers, self.num_experts)
        check_unions(self.step_unions, self.num_layers, self.num_experts)
        for i, row in enumerate(self.expert_slots):
            if row.layer >= self.num_layers:
                raise _invalid(f"expert_slots.{i}.layer",
                               f"layer {row.layer} is out of range for num_layers={self.num_layers}")
            if row.slots > self.num_experts:
                raise _invalid(f"expert_slots.{i}.slots", f"{row.slots} exceed num_experts={self.num_experts}")
        _refuse_repeats("expert_slots", [row.layer for row in self.expert_slots], ".layer")
        if self.window_end_s < self.window_start_s:
            raise _invalid("window_end_s", f"{self.window_end_s} is before window_start_s={self.window_start_s}")
        _check_layer_rows(self.layers, "activation_counts", self.num_layers, self.num_experts)
        for i, row in enumerate(self.layers):
            for k, pair in enumerate(row.cooccurrence):  # a < b, so only b can overflow
                if pair.b >= self.num_experts:
                    detail = f"expert {pair.b} is out of range for num_experts={self.num_experts}"
                    raise _invalid(f"layers.{i}.cooccurrence.{k}.b", detail)
        _refuse_repeats("links", [s.link for s in self.links], ".link")
        _refuse_repeats("stalls", [s.cause for s in self.stalls], ".cause")
        return self


# ---- Forecast (controller internal and API) ----
class LayerForecast(ProtocolModel):
    layer: LayerIndex
    probs: tuple[Probability, ...] = Field(max_length=MAX_EXPERTS)  # P(expert is needed within the horizon)


class Forecast(ProtocolModel):
    schema_version: Literal[1] = 1
    model: Text
    num_layers: NumLayers
    num_experts: NumExperts
    horizon_steps: Annotated[int, Strict(), Field(ge=1)]
    created_s: Seconds
    layers: tuple[LayerForecast, ...] = Field(max_length=MAX_LAYERS)
    kv_reuse_scores: dict[Id, Probability] = Field(default_factory=dict, max_length=MAX_ITEMS)  # by prefix hash

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        _check_layer_rows(self.layers, "probs", self.num_layers, self.num_experts)
        return self


# ---- Plan (controller -> sidecar -> agent) ----
class LayerEviction(ProtocolModel):
    layer: LayerIndex
    order: tuple[ExpertIndex, ...] = Field(max_length=MAX_EXPERTS)  # first to evict .. last to evict

    @model_validator(mode="after")
    def _distinct(self) -> Self:
        _refuse_repeats("order", self.order)
        return self


class PrefetchItem(ProtocolModel):
    key: ExpertKey
    deadline_ms: Millis
    priority: Annotated[int, Strict(), Field(ge=0, le=3)]  # 0 most urgent, as runtime's transfer Priority


class Plan(ProtocolModel):
    schema_version: PlanSchemaVersion = 3
    plan_id: Id
    version: Version
    base_version: Count  # the applied version this plan was built on; the agent rejects it as STALE otherwise
    created_s: Seconds
    hbm_budget_bytes: Count
    expert_bytes_per_layer: tuple[Count, ...] = Field(max_length=MAX_LAYERS)  # per model layer; 0 if dense
    kv_blocks_per_tier: dict[Tier, Count]
    pinned_experts: tuple[ExpertKey, ...] = Field(default=(), max_length=MAX_ITEMS)
    eviction_priority: tuple[LayerEviction, ...] = Field(default=(), max_length=MAX_LAYERS)
    prefetch: tuple[PrefetchItem, ...] = Field(default=(), max_length=MAX_ITEMS)
    link_shares: dict[Link, Probability] = Field(default_factory=dict)  # fractions of the plan's transfer budget
    reason: Text
    # v2: the predictor the agent evaluates one MoE layer ahead, and the bytes it may prefetch per engine step
    local_predictor: LocalPredictor | None = None
    prefetch_budget_bytes_per_step: Count = 0
    kv_retention: KvRetention = ()  # v3: prefix hashes the KV tiers keep first, most likely reused first

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        check_v2_only(self, ("local_predictor", "prefetch_budget_bytes_per_step"), "plan")
        check_since(self, 3, ("kv_retention",), "plan")
        _refuse_repeats("kv_retention", self.kv_retention)
        if self.local_predictor is not None:
            check_predictor(self.local_predictor, len(self.expert_bytes_per_layer))
        if self.version <= self.base_version:
            raise _invalid("version", f"{self.version} must be greater than base_version={self.base_version}")
        if sum(self.link_shares.values()) > 1.0 + 1e-9:  # a little slack: 0.1 + 0.2 + 0.7 is not exactly 1.0
            detail = f"sum to {sum(self.link_shares.values()):g}; expected at most 1 (shares of one transfer budget)"
            raise _invalid("link_shares", detail)
        expert_bytes = sum(self.expert_bytes_per_layer)
        if expert_bytes > self.hbm_budget_bytes:
            # KV bytes per block are unknown here, so only the expert share can be checked against the budget.
            detail = f"sums to {expert_bytes} bytes, over hbm_budget_bytes={self.hbm_budget_bytes}"
            raise _invalid("expert_bytes_per_layer", detail)
        _refuse_repeats("pinned_experts", self.pinned_experts)
        _refuse_repeats("prefetch", [item.key for item in self.prefetch], ".key")
        _refuse_repeats("eviction_priority", [e.layer for e in self.eviction_priority], ".layer")
        self._check_covered()
        return self

    def _check_covered(self) -> None:
        num_covered = len(self.expert_bytes_per_layer)
        located = (
            [(f"pinned_experts.{i}.layer", k.layer) for i, k in enumerate(self.pinned_experts)]
            + [(f"eviction_priority.{i}.layer", e.layer) for i, e in enumerate(self.eviction_priority)]
            + [(f"prefetch.{i}.key.layer", p.key.layer) for i, p in enumerate(self.prefetch)]
        )
        for path, layer in located:
            if layer >= num_covered:
                raise _invalid(path, f"layer {layer} is outside the {num_covered} layers of expert_bytes_per_layer")


# ---- PlanAck (agent -> sidecar -> controller) ----
class Footprint(ProtocolModel):
    """What the agent measured after handling a plan (unchanged footprint when it rejected one)."""

    expert_bytes_per_layer: tuple[Count, ...] = Field(max_length=MAX_LAYERS)
    kv_blocks_per_tier: dict[Tier, Count]
    total_hbm_bytes: Count

    @model_validator(mode="after")
    def _total_covers_experts(self) -> Self:
        expert_bytes = sum(self.expert_bytes_per_layer)
        if expert_bytes > self.total_hbm_bytes:
            raise _invalid("total_hbm_bytes", f"{self.total_hbm_bytes} is below the {expert_bytes} expert bytes")
        return self


class PlanAck(ProtocolModel):
    schema_version: Literal[1] = 1
    agent_id: Id
    rank: Count
    plan_id: Id
    version: Version
    status: AckStatus
    reason_code: RejectReason | None = None  # required when rejected, absent when applied
    reason: str = Field(default="", max_length=MAX_TEXT_CHARS)  # required (non-blank) when rejected
    applied_s: Seconds  # when the agent decided, applied or rejected
    footprint: Footprint

    @model_validator(mode="after")
    def _reason_matches_status(self) -> Self:
        if self.status is AckStatus.REJECTED:
            if self.reason_code is None:
                raise _invalid("reason_code", "is required when status is 'rejected'")
            if not self.reason.strip():
                raise _invalid("reason", "must be non-blank when status is 'rejected'")
        elif self.reason_code is not None:
            raise _invalid("reason_code", f"must be absent when status is 'applied', got {self.reason_code.value!r}")
        return self


# ---- Helpers ----

MESSAGE_TYPES: Mapping[str, type[ProtocolModel]] = MappingProxyType(
    {cls.__name__: cls for cls in (Telemetry, Forecast, Plan, PlanAck)}
)


