"""Plan v3's KV retention order and the EngineStats datagram: valid ones round-trip, old versions stay valid,
and bad input is refused naming the field, the place and what was expected."""

from __future__ import annotations

from typing import Any

import pytest

from tests.controller.test_protocol import plan_data
from tierplan.controller.protocol import MAX_RETENTION, Plan, ProtocolError, parse, to_json
from tierplan.controller.protocol_service import EngineStats

HASHES = ["9f3a", "0c11", "77e0"]


def test_a_v3_plan_carries_a_keep_first_order_and_round_trips() -> None:
    plan = parse(Plan, {**plan_data(), "kv_retention": HASHES})
    assert plan.schema_version == 3 and plan.kv_retention == tuple(HASHES)
    assert parse(Plan, to_json(plan)) == plan


@pytest.mark.parametrize("version", [1, 2])
def test_old_plans_without_retention_stay_valid(version: int) -> None:
    plan = parse(Plan, {**plan_data(), "schema_version": version})
    assert plan.schema_version == version and plan.kv_retention == ()


@pytest.mark.parametrize(("bend", "expected"), [
    ({"schema_version": 2, "kv_retention": HASHES},
     "kv_retention: needs schema_version 3 (a version-2 plan carries no kv_retention)"),
    ({"kv_retention": ["9f3a", "0c11", "9f3a"]}, "kv_retention.2: 9f3a repeats kv_retention.0"),
    ({"kv_retention": ["9f3a", "has space"]}, "kv_retention.1: must be non-empty and contain no whitespace"),
    ({"kv_retention": ["9f3a", ""]}, "kv_retention.1: must be non-empty"),
    ({"kv_retention": ["x" * 257]}, "kv_retention.0: String should have at most 256 characters"),
    ({"kv_retention": [f"h{i}" for i in range(MAX_RETENTION + 1)]},
     f"kv_retention: Tuple should have at most {MAX_RETENTION} items"),
    ({"kv_retention": "9f3a"}, "kv_retention: Input should be a valid tuple"),
])
def test_bad_retention_is_refused_with_what_where_and_expected(bend: dict[str, Any], expected: str) -> None:
    with pytest.raises(ProtocolError) as err:
        parse(Plan, {**plan_data(), **bend})
    assert expected in str(err.value)


def test_a_retention_list_at_its_bound_is_accepted() -> None:
    hashes = [f"h{i}" for i in range(MAX_RETENTION)]
    assert len(parse(Plan, {**plan_data(), "kv_retention": hashes}).kv_retention) == MAX_RETENTION


def test_engine_stats_is_a_protocol_message_strict_and_closed() -> None:
    st = parse(EngineStats, '{"gpu_hit_blocks": 3, "gpu_miss_blocks": 7, "gpu_blocks": 25}')
    assert (st.schema_version, st.engine_index, st.gpu_blocks) == (1, 0, 25)
    assert parse(EngineStats, to_json(st)) == st
    for bad, expected in [('{"gpu_hit_blocks": -1, "gpu_miss_blocks": 0, "gpu_blocks": 0}',
                           "gpu_hit_blocks: Input should be greater than or equal to 0"),
                          ('{"gpu_hit_blocks": 1, "gpu_miss_blocks": 0, "gpu_blocks": 0, "extra": 1}',
                           "extra: Extra inputs are not permitted"),
                          ('{"gpu_hit_blocks": 1, "gpu_miss_blocks": 0, "gpu_blocks": 0, "schema_version": 2}',
                           "schema_version: Input should be 1")]:
        with pytest.raises(ProtocolError) as err:
            parse(EngineStats, bad)
        assert expected in str(err.value)
