"""controller/state.py: windows are mirrored and versioned; a window that does not fit is refused by rule and
changes nothing (deep-compared before and after)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.controller.test_protocol import ack_data, plan_data, telemetry_data
from tierplan.controller.protocol import Plan, PlanAck, RejectReason, Telemetry, parse
from tierplan.controller.state import ControllerState, ModelInfo, RejectCode, TelemetryRejected

MODEL = ModelInfo("tiny-moe", 3, 4, (0, 2))


def window(seq: int, start_s: float, **over: Any) -> Telemetry:
    data = {**telemetry_data(), "window_seq": seq, "window_start_s": start_s, "window_end_s": start_s + 1.0,
            "applied_plan_version": 0, **over}
    return parse(Telemetry, data)


def plan(version: int) -> Plan:
    return parse(Plan, {**plan_data(), "plan_id": f"p{version}", "version": version, "base_version": version - 1})


def snapshot(state: ControllerState) -> dict[str, Any]:
    return copy.deepcopy(vars(state))


@pytest.fixture
def state() -> ControllerState:
    s = ControllerState(MODEL)
    s.sync_from(window(0, 10.0))
    return s


def test_windows_are_mirrored_and_totals_accumulate(state: ControllerState) -> None:
    rec = state.sync_from(window(1, 11.0))
    assert state.version == 2 and rec.num_windows == 2 and rec.last_window_seq == 1
    assert rec.activations[0] == (5, 0, 3, 8) and rec.activations_total[0] == (10, 0, 6, 16)
    assert rec.tokens_total[2] == 4 and rec.expert_hits_total == 240
    assert rec.step_timings_ms is not None and rec.step_timings_ms.p99 == 30.0
    assert rec.fallbacks == {"prefetch_late": 1} and len(rec.recent) == 2


def test_first_window_registers_the_model_when_none_was_given() -> None:
    s = ControllerState()
    s.sync_from(window(0, 1.0))
    assert s.model == ModelInfo("tiny-moe", 3, 4, (0, 2))


def test_json_input_is_parsed_and_garbage_is_refused_as_malformed(state: ControllerState) -> None:
    before = snapshot(state)
    with pytest.raises(TelemetryRejected) as info:
        state.sync_from('{"agent_id": 1}')
    assert info.value.code is RejectCode.MALFORMED and "invalid Telemetry" in str(info.value)
    assert snapshot(state) == before


def test_history_is_bounded() -> None:
    s = ControllerState(MODEL, history=3)
    for i in range(6):
        s.sync_from(window(i, 10.0 + i))
    assert [t.window_seq for t in s.agents[("host0-rank0", 0)].recent] == [3, 4, 5]


def _layer_for_dense(d: dict[str, Any]) -> None:
    d["layers"][1]["layer"] = 1


# fmt: off
REFUSALS = [
    ({"window_seq": 0, "window_start_s": 11.0, "window_end_s": 12.0}, RejectCode.SEQ_NOT_INCREASING,
     "window_seq=0 repeats the last accepted window_seq=0"),
    ({"window_seq": 5, "window_start_s": 10.5, "window_end_s": 12.0}, RejectCode.TIME_BACKWARDS,
     "window_start_s=10.5 is before the last window's window_end_s=11.0"),
    ({"num_experts": 5, "layers": []}, RejectCode.MODEL_MISMATCH, "num_experts=5, the registered model has 4"),
    ({"num_layers": 4}, RejectCode.MODEL_MISMATCH, "num_layers=4, the registered model has 3"),
    ({"model": "other"}, RejectCode.MODEL_MISMATCH, "model='other', the registered model has 'tiny-moe'"),
    ({"applied_plan_version": 1}, RejectCode.PLAN_VERSION_AHEAD,
     "applied_plan_version=1, but the highest plan version issued is 0"),
    ({"agent_id": "newcomer", "applied_plan_version": 7}, RejectCode.PLAN_VERSION_AHEAD,
     "newcomer rank 0 (an agent not seen before): applied_plan_version=7"),
]
# fmt: on


@pytest.mark.parametrize(("over", "code", "text"), REFUSALS, ids=[r[1].value + "-" + r[2][:20] for r in REFUSALS])
def test_malformed_telemetry_is_refused_with_a_reason_and_changes_nothing(
        state: ControllerState, over: dict[str, Any], code: RejectCode, text: str) -> None:
    data = {**telemetry_data(), "window_seq": 1, "window_start_s": 11.0, "window_end_s": 12.0,
            "applied_plan_version": 0, **over}
    before = snapshot(state)
    with pytest.raises(TelemetryRejected) as info:
        state.sync_from(parse(Telemetry, data))
    assert info.value.code is code and text in str(info.value)
    assert snapshot(state) == before


def test_dense_layer_counts_are_refused(state: ControllerState) -> None:
    data = {**telemetry_data(), "window_seq": 1, "window_start_s": 11.0, "window_end_s": 12.0,
            "applied_plan_version": 0}
    _layer_for_dense(data)
    before = snapshot(state)
    with pytest.raises(TelemetryRejected, match=r"layers.1.layer: layer 1 is dense") as info:
        state.sync_from(parse(Telemetry, data))
    assert info.value.code is RejectCode.DENSE_LAYER and snapshot(state) == before


def test_applied_version_may_not_go_back(state: ControllerState) -> None:
    state.record_issued(plan(1))
    state.record_issued(plan(2))
    state.sync_from(window(1, 11.0, applied_plan_version=2))
    before = snapshot(state)
    with pytest.raises(TelemetryRejected, match="applied_plan_version=1 is below the 2") as info:
        state.sync_from(window(2, 12.0, applied_plan_version=1))
    assert info.value.code is RejectCode.PLAN_VERSION_BACKWARDS and snapshot(state) == before


def test_issued_versions_rise_and_acks_are_mirrored(state: ControllerState) -> None:
    state.record_issued(plan(1))
    with pytest.raises(ValueError, match="not above the last issued version 1"):
        state.record_issued(plan(1))
    ack = parse(PlanAck, {**ack_data(), "version": 1, "plan_id": "p1"})
    rec = state.record_ack(ack)
    assert rec.footprint == ack.footprint and state.applied_version() == 1
    before = snapshot(state)
    with pytest.raises(TelemetryRejected, match="ack for plan version 4, but the highest issued is 1"):
        state.record_ack(parse(PlanAck, ack_data()))
    assert snapshot(state) == before


def test_an_ack_from_an_agent_that_sent_no_telemetry_is_refused(state: ControllerState) -> None:
    state.record_issued(plan(1))
    before = snapshot(state)
    stray = parse(PlanAck, {**ack_data(), "agent_id": "stray-rank0", "version": 1, "plan_id": "p1"})
    with pytest.raises(TelemetryRejected, match="stray-rank0 rank 0: ack for plan version 1 from an agent that "
                                                "sent no telemetry") as info:
        state.record_ack(stray)
    assert info.value.code is RejectCode.UNKNOWN_AGENT and snapshot(state) == before
    assert state.applied_version() == 0 and ("stray-rank0", 0) not in state.agents


def test_a_rejected_ack_records_the_version_and_its_reason_code(state: ControllerState) -> None:
    state.record_issued(plan(1))
    refusal = parse(PlanAck, {**ack_data("rejected"), "version": 1, "plan_id": "p1", "reason_code": "over_budget",
                              "reason": "over the budget"})
    state.record_ack(refusal)
    assert state.rejected == {1: RejectReason.OVER_BUDGET} and state.last_issued_rejected()
    assert state.applied_version() == 0
    state.record_issued(plan(2))
    assert not state.last_issued_rejected()
