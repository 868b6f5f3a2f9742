"""Message parts of the local predictor: what the agent counts (Telemetry v2) and what it runs (Plan v2).

Per-token, per-layer prefetch decisions are far below a controller round trip, so the controller trains a
compact model and ships it inside the `Plan`; the agent evaluates it one MoE layer ahead. Today that model is
a sparse transition table: for a source (layer, expert), the top-m experts of the next MoE layer with the
probability that a token routed to the source is routed to each of them. The agent reports the raw counts
the table is trained from (`LayerTransitions`, one window's cross-layer pairs).
Imported by `controller/protocol.py` (which re-exports every name); like it, plain data plus validation:
it must never import torch, runtime or agent, touch the network or disk, or keep state.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Annotated, NamedTuple, Self

from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator

from tierplan.controller.validation import (
    MAX_ITEMS,
    MAX_PAIRS_PER_LAYER,
    Count,
    ExpertIndex,
    LayerIndex,
    Probability,
    Version,
    _invalid,
)

MAX_TOP_M = 64  # successors kept per source expert: a table row is meant to be small
MAX_UNION_STEPS = 1024  # steps per window whose per-layer expert unions are reported


class _Part(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


def _first_repeat(keys: Sequence[object]) -> tuple[int, int] | None:
    first_at: dict[object, int] = {}
    for i, key in enumerate(keys):
        if key in first_at:
            return first_at[key], i
        first_at[key] = i
    return None


# ---- Telemetry v2: what the table is trained from ----
class TransitionPair(NamedTuple):
    """`count` tokens of the window were routed to expert `src` at `layer` and to `dst` at `next_layer`.
    A named tuple for the same reason as CoPair (thousands per window); `[src, dst, count]` in JSON."""

    src: ExpertIndex
    dst: ExpertIndex
    count: Count


class LayerTransitions(_Part):
    """One window's cross-layer pairs from MoE layer `layer` to the next MoE layer `next_layer` (sparse)."""

    layer: LayerIndex
    next_layer: LayerIndex
    num_tokens: Count  # tokens observed at both layers
    pairs: tuple[TransitionPair, ...] = Field(default=(), max_length=MAX_PAIRS_PER_LAYER)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.next_layer <= self.layer:
            raise _invalid("next_layer", f"{self.next_layer} must be greater than layer={self.layer}")
        rep = _first_repeat([(p.src, p.dst) for p in self.pairs])
        if rep is not None:
            p = self.pairs[rep[1]]
            raise _invalid(f"pairs.{rep[1]}", f"({p.src}, {p.dst}) repeats pairs.{rep[0]}")
        return self


class LayerUnions(_Part):
    """The distinct experts MoE layer `layer` needed in each of (a sample of) the window's steps, in step order,
    with each step's token count: what the controller's miss-ratio curves at batch B are estimated from."""

    layer: LayerIndex
    batch_tokens: tuple[Count, ...] = Field(max_length=MAX_UNION_STEPS)
    unions: tuple[tuple[ExpertIndex, ...], ...] = Field(max_length=MAX_UNION_STEPS)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if len(self.unions) != len(self.batch_tokens):
            raise _invalid("unions", f"has {len(self.unions)} steps, batch_tokens has {len(self.batch_tokens)}")
        for i, union in enumerate(self.unions):
            rep = _first_repeat(union)
            if rep is not None:
                raise _invalid(f"unions.{i}.{rep[1]}", f"expert {union[rep[1]]} repeats unions.{i}.{rep[0]}")
        return self


def check_since(msg: BaseModel, version: int, names: Sequence[str], kind: str) -> None:
    """A message older than `version` must leave every field added in `version` at its default (empty, 0 or
    None): an old reader could not parse it."""
    got = getattr(msg, "schema_version", version)
    if got < version:
        for name in names:
            if getattr(msg, name):
                raise _invalid(name, f"needs schema_version {version} (a version-{got} {kind} carries no {name})")


def check_v2_only(msg: BaseModel, names: Sequence[str], kind: str) -> None:
    """A version-1 message must leave every version-2 field at its default (empty, 0 or None)."""
    check_since(msg, 2, names, kind)


def check_transitions(rows: Sequence[LayerTransitions], num_layers: int, num_experts: int) -> None:
    """Telemetry-level checks: layers in range and unique, experts in range (raises a protocol invariant)."""
    for i, row in enumerate(rows):
        for name, layer in (("layer", row.layer), ("next_layer", row.next_layer)):
            if layer >= num_layers:
                raise _invalid(f"transitions.{i}.{name}", f"{layer} is out of range for num_layers={num_layers}")
        for k, p in enumerate(row.pairs):
            for name, e in (("src", p.src), ("dst", p.dst)):
                if e >= num_experts:
                    raise _invalid(f"transitions.{i}.pairs.{k}.{name}",
                                   f"expert {e} is out of range for num_experts={num_experts}")
    rep = _first_repeat([r.layer for r in rows])
    if rep is not None:
        raise _invalid(f"transitions.{rep[1]}.layer", f"{rows[rep[1]].layer} repeats transitions.{rep[0]}.layer")


def check_unions(rows: Sequence[LayerUnions], num_layers: int, num_experts: int) -> None:
    for i, row in enumerate(rows):
        if row.layer >= num_layers:
            raise _invalid(f"step_unions.{i}.layer", f"{row.layer} is out of range for num_layers={num_layers}")
        for k, union in enumerate(row.unions):
            for j, e in enumerate(union):
                if e >= num_experts:
                    raise _invalid(f"step_unions.{i}.unions.{k}.{j}",
                                   f"expert {e} is out of range for num_experts={num_experts}")
    rep = _first_repeat([r.layer for r in rows])
    if rep is not None:
        raise _invalid(f"step_unions.{rep[1]}.layer", f"{rows[rep[1]].layer} repeats step_unions.{rep[0]}.layer")


class PrefetchCounts(_Part):
    """What the agent's layer-ahead predictor did in the window (counts since the previous window)."""

    table_version: Count  # the LocalPredictor.version it ran (0: none installed)
    issued: Count
    useful: Count  # prefetched experts the next layer then needed in the same step
    wasted: Count  # prefetched experts it did not
    skipped_resident: Count
    skipped_budget: Count  # left out: the plan's bytes per step were spent
    skipped_no_slot: Count
    failed: Count


# ---- Plan v2: the predictor the agent runs ----
class PredictorKind(StrEnum):
    TRANSITION_TABLE = "transition_table"


class Successor(NamedTuple):
    """P(`expert` is routed at the next MoE layer | the source expert was routed at this one) = `prob`."""

    expert: ExpertIndex
    prob: Probability


class TransitionRow(_Part):
    layer: LayerIndex  # the source MoE layer (model layer index); successors are in the next MoE layer
    src: ExpertIndex
    next: tuple[Successor, ...] = Field(min_length=1, max_length=MAX_TOP_M)  # most likely first

    @model_validator(mode="after")
    def _ranked_and_distinct(self) -> Self:
        rep = _first_repeat([s.expert for s in self.next])
        if rep is not None:
            raise _invalid(f"next.{rep[1]}.expert", f"{self.next[rep[1]].expert} repeats next.{rep[0]}.expert")
        for k in range(1, len(self.next)):
            if self.next[k].prob > self.next[k - 1].prob:
                raise _invalid(f"next.{k}.prob", f"{self.next[k].prob} exceeds next.{k - 1}.prob="
                                                 f"{self.next[k - 1].prob} (successors are ranked, most likely first)")
        return self


class LocalPredictor(_Part):
    """A versioned transition table. The agent prefetches, one MoE layer ahead, every successor whose score
    (over the step's tokens: 1 - prod(1 - best source prob)) is at least `min_score`, most likely first,
    within the plan's `prefetch_budget_bytes_per_step`."""

    kind: PredictorKind = PredictorKind.TRANSITION_TABLE
    version: Version  # the controller's training version of this table (rises as it learns)
    top_m: Annotated[int, Strict(), Field(ge=1, le=MAX_TOP_M)]
    min_score: Probability
    rows: tuple[TransitionRow, ...] = Field(default=(), max_length=MAX_ITEMS)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        for i, row in enumerate(self.rows):
            if len(row.next) > self.top_m:
                raise _invalid(f"rows.{i}.next", f"has {len(row.next)} successors, over top_m={self.top_m}")
        rep = _first_repeat([(r.layer, r.src) for r in self.rows])
        if rep is not None:
            r = self.rows[rep[1]]
            raise _invalid(f"rows.{rep[1]}", f"(layer {r.layer}, src {r.src}) repeats rows.{rep[0]}")
        return self


def check_predictor(pred: LocalPredictor, num_covered_layers: int) -> None:
    """Plan-level check: every row's layer is one of the plan's layers (experts are checked by the agent)."""
    for i, row in enumerate(pred.rows):
        if row.layer >= num_covered_layers:
            raise _invalid(f"local_predictor.rows.{i}.layer",
                           f"layer {row.layer} is outside the {num_covered_layers} layers of expert_bytes_per_layer")
