"""Protocol v2: the local predictor a plan carries, the transition counts telemetry carries, version rules."""

from __future__ import annotations

from typing import Any

import pytest

from tests.controller.test_protocol import _set, plan_data, refused, telemetry_data
from tierplan.controller.protocol import LocalPredictor, Plan, Successor, Telemetry, TransitionPair, parse, to_json


def predictor_data() -> dict[str, Any]:
    return {"version": 3, "top_m": 2, "min_score": 0.3,
            "rows": [{"layer": 0, "src": 3, "next": [[1, 0.8], {"expert": 2, "prob": 0.1}]},
                     {"layer": 1, "src": 0, "next": [[0, 0.5]]}]}


def plan_v2() -> dict[str, Any]:
    return {**plan_data(), "local_predictor": predictor_data(), "prefetch_budget_bytes_per_step": 4096}


def telemetry_v2() -> dict[str, Any]:
    return {**telemetry_data(), "transitions": [{"layer": 0, "next_layer": 2, "num_tokens": 8,
                                                 "pairs": [[0, 1, 4], {"src": 3, "dst": 1, "count": 2}]}],
            "step_unions": [{"layer": 0, "batch_tokens": [2, 1], "unions": [[0, 3, 1], [2]]}], "queued_kv_blocks": 5,
            "local_prefetch": {"table_version": 3, "issued": 4, "useful": 3, "wasted": 1, "skipped_resident": 0,
                               "skipped_budget": 2, "skipped_no_slot": 0, "failed": 0}}


def test_plan_with_a_predictor_round_trips() -> None:
    plan = parse(Plan, plan_v2())
    assert plan.schema_version == 3 and plan.prefetch_budget_bytes_per_step == 4096  # the newest by default
    assert isinstance(plan.local_predictor, LocalPredictor)
    assert plan.local_predictor.rows[0].next[0] == Successor(expert=1, prob=0.8)
    assert parse(Plan, to_json(plan)) == plan


def test_telemetry_with_transitions_round_trips() -> None:
    tel = parse(Telemetry, telemetry_v2())
    assert tel.transitions[0].pairs[1] == TransitionPair(src=3, dst=1, count=2)
    assert parse(Telemetry, to_json(tel)) == tel


def test_version_1_messages_without_the_new_fields_still_parse() -> None:
    plan = parse(Plan, {**plan_data(), "schema_version": 1})
    assert plan.schema_version == 1 and plan.local_predictor is None and plan.prefetch_budget_bytes_per_step == 0
    tel = parse(Telemetry, {**telemetry_data(), "schema_version": 1})
    assert tel.schema_version == 1 and tel.transitions == ()


def _pred(path: str, value: Any) -> Any:
    return _set(f"local_predictor.{path}", value)


# fmt: off
CASES = [
    (Plan, _set("schema_version", 1), "local_predictor: needs schema_version 2"),
    (Plan, lambda d: d.update(schema_version=1, local_predictor=None),
     "prefetch_budget_bytes_per_step: needs schema_version 2"),
    (Plan, _set("prefetch_budget_bytes_per_step", -1), "prefetch_budget_bytes_per_step: Input should be greater"),
    (Plan, _pred("rows.0.next", [[1, 0.1], [2, 0.8]]), "local_predictor.rows.0.next.1.prob: 0.8 exceeds next.0.prob"),
    (Plan, _pred("rows.0.next", [[1, 0.8], [1, 0.1]]), "local_predictor.rows.0.next.1.expert: 1 repeats next.0"),
    (Plan, _pred("rows.0.next", [[1, 0.8], [2, 0.5], [3, 0.1]]),
     "local_predictor.rows.0.next: has 3 successors, over top_m=2"),
    (Plan, _pred("rows.1", {"layer": 0, "src": 3, "next": [[0, 0.5]]}),
     "local_predictor.rows.1: (layer 0, src 3) repeats rows.0"),
    (Plan, _pred("rows.1.layer", 3), "local_predictor.rows.1.layer: layer 3 is outside the 3 layers"),
    (Plan, _pred("rows.0.next", []), "local_predictor.rows.0.next: Tuple should have at least 1 item"),
    (Plan, _pred("rows.0.next.0", [1, 1.5]), "local_predictor.rows.0.next.0.1: Input should be less than or equal"),
    (Plan, _pred("top_m", 0), "local_predictor.top_m: Input should be greater than or equal to 1"),
    (Plan, _pred("kind", "lightgbm"), "local_predictor.kind: Input should be 'transition_table'"),
    (Plan, _pred("version", 0), "local_predictor.version: Input should be greater than or equal to 1"),
    (Telemetry, _set("schema_version", 1), "transitions: needs schema_version 2"),
    (Telemetry, lambda d: d.update(schema_version=1, transitions=[]), "step_unions: needs schema_version 2"),
    (Telemetry, lambda d: d.update(schema_version=1, transitions=[], step_unions=[], queued_kv_blocks=3),
     "queued_kv_blocks: needs schema_version 2"),
    (Telemetry, lambda d: d.update(schema_version=1, transitions=[], step_unions=[], queued_kv_blocks=0,
                                   local_prefetch=None, kv_gpu_limit_blocks=40),
     "kv_gpu_limit_blocks: needs schema_version 2"),
    (Telemetry, lambda d: d.update(kv_gpu_limit_blocks=-1), "kv_gpu_limit_blocks: Input should be greater than"),
    (Telemetry, lambda d: d.update(schema_version=1, transitions=[], step_unions=[], queued_kv_blocks=0),
     "local_prefetch: needs schema_version 2"),
    (Telemetry, _set("local_prefetch.useful", -1), "local_prefetch.useful: Input should be greater than or equal"),
    (Telemetry, _set("step_unions.0.unions.1", [2, 2]), "step_unions.0.unions.1.1: expert 2 repeats unions.1.0"),
    (Telemetry, _set("step_unions.0.unions.1", [4]), "step_unions.0.unions.1.0: expert 4 is out of range"),
    (Telemetry, _set("step_unions.0.batch_tokens", [2]), "step_unions.0.unions: has 2 steps, batch_tokens has 1"),
    (Telemetry, _set("transitions.0.next_layer", 0), "transitions.0.next_layer: 0 must be greater than layer=0"),
    (Telemetry, _set("transitions.0.next_layer", 3), "transitions.0.next_layer: 3 is out of range for num_layers=3"),
    (Telemetry, _set("transitions.0.pairs.1", [0, 1, 9]), "transitions.0.pairs.1: (0, 1) repeats pairs.0"),
    (Telemetry, _set("transitions.0.pairs.1", [3, 4, 1]),
     "transitions.0.pairs.1.dst: expert 4 is out of range for num_experts=4"),
    (Telemetry, lambda d: d["transitions"].append({"layer": 0, "next_layer": 1, "num_tokens": 1}),
     "transitions.1.layer: 0 repeats transitions.0.layer"),
]
# fmt: on


@pytest.mark.parametrize(("kind", "bend", "expected"), CASES, ids=[c[2].split(":")[0] for c in CASES])
def test_invalid_v2_fields_refused_with_field_path(kind: type, bend: Any, expected: str) -> None:
    data = plan_v2() if kind is Plan else telemetry_v2()
    bend(data)
    assert expected in refused(kind, data)
