"""Messages between the sidecar, the controller service and its readers (UI, CLI, dashboards): pydantic v2.

Part of the protocol (controller/protocol.py re-exports nothing from here; import this module by name). The
sidecar registers the agent it serves (`AgentRegistration`: the model's shape, the hardware and what the
split is made of, so the service can build that agent's controller), posts telemetry in batches
(`TelemetryBatch`), polls `Plan`s and posts `PlanAck`s (both in protocol.py). Operators tune an agent group
with `PolicyUpdate`; the service answers with records (`AgentStatus`, `IngestResult`, `PlanRecord`,
`PolicyRecord`, `DecisionRecord`); a vLLM rank's stat logger sends its agent `EngineStats`. Imported by
the inference process (sidecar) and the service alike: plain data plus validation; it must never import
torch, runtime or agent, touch the network or disk, or keep state.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, Self

from pydantic import Field, model_validator

from tierplan.controller.protocol import (
    ExpertKey,
    Link,
    Plan,
    PlanAck,
    ProtocolModel,
    Stall,
    StallCause,
    StepTimings,
    Telemetry,
    Tier,
)
from tierplan.controller.validation import (
    MAX_ITEMS,
    MAX_LAYERS,
    Count,
    Id,
    LayerIndex,
    Millis,
    NumExperts,
    NumLayers,
    Probability,
    Seconds,
    Text,
    Version,
    _invalid,
)

MAX_BATCH_WINDOWS = 256  # telemetry windows in one POST; a sidecar sends more as several batches


# ---- vLLM's own stats (its stat logger, API server process -> the rank's agent, engine-core process) ----
class EngineStats(ProtocolModel):
    """One datagram of vLLM's scheduler and cache stats: counts since the sender's previous datagram, plus
    the GPU KV blocks in use now (agent/adapters/vllm/stats_inbox.py carries it)."""

    schema_version: Literal[1] = 1
    engine_index: Count = 0
    gpu_hit_blocks: Count  # prompt blocks vLLM found in its prefix cache
    gpu_miss_blocks: Count  # prompt blocks it looked up and did not find
    gpu_blocks: Count  # KV blocks in use now
    num_running_reqs: Count = 0
    num_waiting_reqs: Count = 0


# ---- registration (sidecar -> service, once per agent rank and again after a service restart) ----
class ShapeSpec(ProtocolModel):
    """controller.model_shape.ModelShape as a message (the field names are the same)."""

    name: Id
    num_layers: NumLayers
    moe_layers: tuple[LayerIndex, ...] = Field(min_length=1, max_length=MAX_LAYERS)
    num_experts: NumExperts
    top_k: int = Field(ge=1, strict=True)
    expert_bytes: int = Field(ge=1, strict=True)
    dense_bytes: Count
    kv_bytes_per_token: int = Field(ge=1, strict=True)
    block_tokens: int = Field(default=16, ge=1, strict=True)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.top_k > self.num_experts:
            raise _invalid("top_k", f"{self.top_k} exceeds num_experts={self.num_experts}")
        layers = list(self.moe_layers)
        if layers != sorted(set(layers)) or layers[-1] >= self.num_layers:
            raise _invalid("moe_layers", f"must be ascending, unique and below num_layers={self.num_layers}")
        return self


class HardwareSheet(ProtocolModel):
    """controller.costmodel.HardwareSpec as a message: bandwidth of every link, per-transfer host cost."""

    name: Text = "unnamed"  # Text refuses blank; a default that reads back is needed for stored registrations
    link_bytes_per_s: dict[Link, float] = Field(min_length=len(Link), max_length=len(Link))
    transfer_overhead_s: Seconds
    hbm_bytes: Count
    hbm_bytes_per_s: float = Field(default=0.0, ge=0)

    @model_validator(mode="after")
    def _positive(self) -> Self:
        for link, bw in self.link_bytes_per_s.items():
            if not bw > 0:
                raise _invalid(f"link_bytes_per_s.{link.value}", f"{bw} must be > 0 bytes/s")
        return self


class SplitSheet(ProtocolModel):
    """controller.valuation.SplitSpace as a message (what the split is made of, in bytes), plus the KV
    capacity of the slower tiers. Knobs an operator tunes (min slots, link share) live in `PolicyKnobs`."""

    hbm_budget_bytes: int = Field(ge=1, strict=True)
    dense_bytes: Count
    workspace_bytes: Count
    slot_bytes: int = Field(ge=1, strict=True)
    kv_block_bytes: int = Field(ge=1, strict=True)
    kv_gpu_blocks_max: int = Field(ge=1, strict=True)
    kv_gpu_blocks_min: Count
    kv_block_tokens: int = Field(default=16, ge=1, strict=True)
    kv_cpu_blocks: Count
    kv_nvme_blocks: Count
    # The most sequences the engine runs in one step (vLLM's max_num_seqs; None: not known): GPU KV past what they
    # hold runs no more of them, however long the queue.
    max_running_seqs: int | None = Field(default=None, ge=1, strict=True)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.kv_gpu_blocks_min > self.kv_gpu_blocks_max:
            raise _invalid("kv_gpu_blocks_min", f"{self.kv_gpu_blocks_min} exceeds kv_gpu_blocks_max="
                                                f"{self.kv_gpu_blocks_max}")
        return self


class ComputeSheet(ProtocolModel):
    """controller.costmodel.ComputeParams as a message: the step's compute prior (ms), before calibration."""

    step_ms: float = Field(default=0.0, ge=0)
    dense_ms: float = Field(default=0.0, ge=0)
    moe_ms: float = Field(default=0.0, ge=0)
    dense_ms_per_token: float = Field(default=0.0, ge=0)
    attn_ms_per_ctx_token: float = Field(default=0.0, ge=0)
    moe_ms_per_token: float = Field(default=0.0, ge=0)
    moe_ms_per_active_expert: float = Field(default=0.0, ge=0)
    moe_ms_per_miss: float = Field(default=0.0, ge=0)
    # Once per decode step run chunked off its graphs: an engine that measured it (or an operator) gives the first
    # plan what calibration would only learn from the windows that ran so.
    chunked_step_ms: float = Field(default=0.0, ge=0)


class AgentRegistration(ProtocolModel):
    schema_version: Literal[1] = 1
    agent_id: Id
    rank: Count = 0
    group: Id = "default"  # the policy group whose knobs this agent's controller runs with
    engine: Id  # e.g. "tierplan-reference", "vllm"
    shape: ShapeSpec
    hardware: HardwareSheet
    split: SplitSheet
    registered_s: Seconds
    compute: ComputeSheet | None = None  # None: the prior the hardware sheet implies (HBM bandwidth)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.split.kv_block_tokens != self.shape.block_tokens:
            raise _invalid("split.kv_block_tokens", f"{self.split.kv_block_tokens} differs from "
                                                    f"shape.block_tokens={self.shape.block_tokens}")
        return self


class PlanRequest(ProtocolModel):
    """Agent -> sidecar after (re)connecting: the sidecar answers with its cached plan when it is newer."""

    schema_version: Literal[1] = 1
    agent_id: Id
    rank: Count = 0
    since_version: Count  # the newest plan version the agent has already seen


# ---- telemetry ingest ----
class TelemetryBatch(ProtocolModel):
    schema_version: Literal[1] = 1
    windows: tuple[Telemetry, ...] = Field(min_length=1, max_length=MAX_BATCH_WINDOWS)


class WindowRejection(ProtocolModel):
    index: Count  # position in the batch
    agent_id: Id
    window_seq: Count
    code: Id  # controller.state.RejectCode value
    message: Text


class IngestResult(ProtocolModel):
    accepted: Count
    rejected: tuple[WindowRejection, ...] = ()


class WindowSummary(ProtocolModel):
    """What a reader plots of one stored telemetry window (the full window carries per-layer counts)."""

    rank: Count
    window_seq: Count
    window_start_s: Seconds
    window_end_s: Seconds
    expert_hits: Count
    expert_misses: Count
    kv_hits_per_tier: dict[Tier, Count]
    kv_misses_per_tier: dict[Tier, Count]
    stalls: tuple[Stall, ...] = Field(default=(), max_length=len(StallCause))
    step_timings_ms: StepTimings
    applied_plan_version: Count

    @classmethod
    def of(cls, tel: Telemetry) -> WindowSummary:
        return cls(rank=tel.rank, window_seq=tel.window_seq, window_start_s=tel.window_start_s,
                   window_end_s=tel.window_end_s, expert_hits=tel.expert_hits, expert_misses=tel.expert_misses,
                   kv_hits_per_tier=tel.kv.hits_per_tier, kv_misses_per_tier=tel.kv.misses_per_tier,
                   stalls=tel.stalls, step_timings_ms=tel.step_timings_ms,
                   applied_plan_version=tel.applied_plan_version)


# ---- policies (operator -> service) ----
class SolverChoice(StrEnum):
    DP = "dp"
    MILP = "milp"


class PredictorChoice(StrEnum):
    MISS_RATIO = "miss_ratio"  # per-layer LRU miss-ratio curves from the reported step unions (default)
    FREQUENCY = "frequency"  # activation frequencies only


class PolicyKnobs(ProtocolModel):
    """The tuning knobs of one agent group. Every field changes what the controller decides; a knob the
    controller cannot honour is refused by name (extra="forbid"), never accepted and ignored."""

    solver: SolverChoice = SolverChoice.DP
    hysteresis: float = Field(default=0.10, ge=0, lt=1)  # the optimizer needs margin < 1
    cooldown_windows: Count = 0
    horizon_steps: int = Field(default=64, ge=1, strict=True)
    plan_every_windows: int = Field(default=1, ge=1, strict=True)  # windows per agent between two plans
    stall_weight: float = Field(default=1.0, ge=0)  # objective: weight of predicted expert stall per step
    kv_weight: float = Field(default=1.0, ge=0)  # objective: weight of predicted KV deferral per step
    pin_frac: Probability = 0.5
    min_slots_per_layer: int = Field(default=1, ge=1, strict=True)
    max_slots_per_layer: int | None = Field(default=None, ge=1, strict=True)  # None: as many as fit
    pinned_experts: tuple[ExpertKey, ...] = Field(default=(), max_length=MAX_ITEMS)  # always resident
    hbm_budget_bytes: int | None = Field(default=None, ge=1, strict=True)  # None: the agent's registered budget
    link_share: Probability = 0.8
    top_m: int = Field(default=4, ge=1, le=64, strict=True)
    min_prob: Probability = 0.05
    min_score: Probability = 0.5
    min_prefetch_precision: Probability = 0.5  # the prefetch table is withheld while fewer prefetches are used
    predictor: PredictorChoice = PredictorChoice.MISS_RATIO
    shadow_predictor: PredictorChoice | None = None  # evaluated beside `predictor`, promoted only if better
    auto_promote: bool = False  # promote the shadow when it wins (else only report its score)
    calibrate: bool = True
    batch_coupling: bool = True  # value each GPU KV share at the batch it runs (False: at the observed batch)
    weigh_start: bool = True  # weigh the first plan against the split the agent reports it started with
    hold_slots_while_filling: bool = True  # while the batch first fills, slots leave a layer only above a step's union
    quiet_windows: Count = 3  # windows in a row held without planning while like the last planned (0: plan each)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.max_slots_per_layer is not None and self.max_slots_per_layer < self.min_slots_per_layer:
            raise _invalid("max_slots_per_layer", f"{self.max_slots_per_layer} is below min_slots_per_layer="
                                                  f"{self.min_slots_per_layer}")
        if self.shadow_predictor is not None and self.shadow_predictor == self.predictor:
            raise _invalid("shadow_predictor", f"{self.shadow_predictor.value!r} is already the active predictor")
        if self.auto_promote and self.shadow_predictor is None:
            raise _invalid("auto_promote", "needs a shadow_predictor to promote")
        if self.stall_weight == 0 and self.kv_weight == 0:
            raise _invalid("kv_weight", "stall_weight and kv_weight are both 0: nothing left to optimize")
        return self


class PolicyUpdate(ProtocolModel):
    knobs: PolicyKnobs
    why: Text = Field(min_length=1)  # recorded with the change; who is the token's name
    expected_version: Count | None = None  # optimistic concurrency: refuse (409) unless the group is at it


class PolicyRecord(ProtocolModel):
    group: Id
    version: Count  # 0: the built-in defaults, never changed
    knobs: PolicyKnobs
    author: Id
    why: Text
    created_s: Seconds


# ---- records the service returns ----
class AgentState(StrEnum):
    ACTIVE = "active"  # telemetry within the service's stale_after_s
    STALE = "stale"  # registered, nothing heard recently
    NEW = "new"  # registered, no telemetry yet


class AgentStatus(ProtocolModel):
    agent_id: Id
    rank: Count
    group: Id
    engine: Id
    model: Id
    registered_s: Seconds
    last_seen_s: Seconds | None
    state: AgentState
    windows: Count  # accepted telemetry windows
    issued_version: Count  # newest plan issued to it (0: none)
    applied_version: Count  # newest plan it acked as applied


class PlanState(StrEnum):
    ISSUED = "issued"  # no ack yet
    APPLIED = "applied"
    REJECTED = "rejected"
    SUPERSEDED = "superseded"  # a newer plan was issued before this one was acked


class PlanRecord(ProtocolModel):
    plan: Plan
    issued_s: Seconds
    state: PlanState
    ack: PlanAck | None = None


class SplitView(ProtocolModel):
    """The HBM split a decision chose, in the units a reader plots."""

    expert_slots_per_layer: tuple[Count, ...] = Field(max_length=MAX_LAYERS)  # per MoE layer
    expert_bytes: Count
    kv_blocks_per_tier: dict[Tier, Count]
    kv_gpu_bytes: Count


class DecisionOutcome(StrEnum):
    ISSUED = "issued"
    HELD = "held"


class DecisionRecord(ProtocolModel):
    id: Count
    agent_id: Id
    created_s: Seconds
    outcome: DecisionOutcome
    version: Version  # the plan issued, or the one kept
    window: Count  # windows of this agent seen when deciding
    policy_version: Count
    batch_tokens: float = Field(ge=0)
    kv_demand_blocks: float = Field(ge=0)
    split: SplitView
    predicted_step_ms: Millis  # the cost model's step time for the split
    measured_step_ms: Millis | None = None  # mean step p50 of the windows run under this plan (None: none yet)
    reason: Text
