"""controller/protocol.py: JSON round trips, immutability, refusals that name the field, and no torch import.

Builders return plain dicts (what arrives off the wire), so a test bends one field and parses the rest as is.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tierplan.controller.protocol import (
    MESSAGE_TYPES,
    NUM_ERRORS_SHOWN,
    AckStatus,
    ExpertKey,
    Forecast,
    Link,
    Plan,
    PlanAck,
    ProtocolError,
    RejectReason,
    Telemetry,
    Tier,
    parse,
    to_json,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_LAYERS = 3
NUM_EXPERTS = 4


def telemetry_data() -> dict[str, Any]:
    return {
        "agent_id": "host0-rank0",
        "rank": 0,
        "window_seq": 7,
        "window_start_s": 10.0,
        "window_end_s": 11.5,
        "model": "tiny-moe",
        "num_layers": NUM_LAYERS,
        "num_experts": NUM_EXPERTS,
        "layers": [
            {
                "layer": 0,
                "activation_counts": [5, 0, 3, 8],
                "cooccurrence": [{"a": 0, "b": 3, "count": 4}, {"a": 2, "b": 3, "count": 1}],
                "router_entropy_mean": 1.2,
                "num_tokens": 8,
            },
            {"layer": 2, "activation_counts": [1, 1, 1, 1], "router_entropy_mean": 1.38, "num_tokens": 2},
        ],
        "kv": {
            "blocks_per_tier": {"gpu": 100, "cpu": 400},
            "hits_per_tier": {"gpu": 90, "cpu": 6},
            "misses_per_tier": {"nvme": 2},
            "reuse_events": [{"prefix_hash": "ab12cd", "age_s": 3.5, "tier": "cpu"}],
        },
        "links": [{"link": "h2d", "bytes": 1 << 20, "queue_delay_ms_mean": 0.4, "queue_delay_ms_max": 2.0}],
        "stalls": [{"cause": "expert_miss", "count": 2, "total_ms": 3.1}],
        "step_timings_ms": {"num_steps": 40, "mean": 12.0, "p50": 11.0, "p99": 30.0},
        "expert_hits": 120,
        "expert_misses": 4,
        "applied_plan_version": 3,
        "fallbacks": {"prefetch_late": 1},
    }


def forecast_data() -> dict[str, Any]:
    return {
        "model": "tiny-moe",
        "num_layers": NUM_LAYERS,
        "num_experts": NUM_EXPERTS,
        "horizon_steps": 16,
        "created_s": 12.0,
        "layers": [{"layer": 0, "probs": [0.9, 0.1, 0.5, 1.0]}, {"layer": 1, "probs": [0.0, 0.2, 0.2, 0.3]}],
        "kv_reuse_scores": {"ab12cd": 0.75},
    }


def plan_data() -> dict[str, Any]:
    return {
        "plan_id": "plan-4",
        "version": 4,
        "base_version": 3,
        "created_s": 12.5,
        "hbm_budget_bytes": 10_000,
        "expert_bytes_per_layer": [2000, 1000, 3000],
        "kv_blocks_per_tier": {"gpu": 64, "cpu": 512, "nvme": 4096},
        "pinned_experts": [{"layer": 0, "expert": 3}, {"layer": 2, "expert": 0}, {"layer": 1, "expert": 1}],
        "eviction_priority": [{"layer": 0, "order": [1, 2, 0, 3]}],
        "prefetch": [{"key": {"layer": 1, "expert": 2}, "deadline_ms": 5.0, "priority": 0}],
        "link_shares": {"h2d": 0.7, "disk2h": 0.3},
        "reason": "layer 2 experts hot; KV reuse low",
    }


def ack_data(status: str = "applied") -> dict[str, Any]:
    data: dict[str, Any] = {
        "agent_id": "host0-rank0",
        "rank": 0,
        "plan_id": "plan-4",
        "version": 4,
        "status": status,
        "applied_s": 12.6,
        "footprint": {
            "expert_bytes_per_layer": [2000, 1000, 3000],
            "kv_blocks_per_tier": {"gpu": 64},
            "total_hbm_bytes": 9000,
        },
    }
    if status == "rejected":
        data |= {"reason_code": "stale", "reason": "base_version 3 != applied 5"}
    return data


BUILDERS = {
    Telemetry: telemetry_data,
    Forecast: forecast_data,
    Plan: plan_data,
    PlanAck: ack_data,
}


def refused(kind: type, data: dict[str, Any]) -> str:
    with pytest.raises(ProtocolError) as info:
        parse(kind, data)
    return str(info.value)


# ---- round trips ----


@pytest.mark.parametrize("kind", list(BUILDERS), ids=lambda k: k.__name__)
def test_round_trip_through_json_text_bytes_and_dict(kind: type) -> None:
    msg = parse(kind, BUILDERS[kind]())
    text = to_json(msg)
    assert parse(kind, text) == msg
    assert parse(kind, text.encode()) == msg
    assert parse(kind, msg.model_dump(mode="json")) == msg
    assert msg.schema_version == {Telemetry: 3, Plan: 3}.get(kind, 1)  # v3: KV retention; the decode split


def test_rejected_ack_round_trips() -> None:
    ack = parse(PlanAck, ack_data("rejected"))
    assert ack.status is AckStatus.REJECTED and ack.reason_code is RejectReason.STALE
    assert parse(PlanAck, to_json(ack)) == ack


def test_enum_keys_and_values_parse_to_enums() -> None:
    tel = parse(Telemetry, telemetry_data())
    assert tel.kv.blocks_per_tier[Tier.GPU] == 100
    assert tel.links[0].link is Link.H2D
    plan = parse(Plan, plan_data())
    assert plan.link_shares[Link.DISK2H] == 0.3
    assert ExpertKey(layer=0, expert=3) in plan.pinned_experts


def test_registry_names_the_top_level_messages() -> None:
    assert dict(MESSAGE_TYPES) == {"Telemetry": Telemetry, "Forecast": Forecast, "Plan": Plan, "PlanAck": PlanAck}
    with pytest.raises(TypeError):
        MESSAGE_TYPES["Other"] = Plan  # type: ignore[index]


# ---- immutability and unknown fields ----


def test_messages_are_frozen_all_the_way_down() -> None:
    plan = parse(Plan, plan_data())
    with pytest.raises(ValidationError, match="frozen"):
        plan.version = 9  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        plan.pinned_experts[0].layer = 1  # type: ignore[misc]
    assert isinstance(plan.pinned_experts, tuple)  # no .append on a frozen message
    assert hash(plan.pinned_experts[0]) == hash(ExpertKey(layer=0, expert=3))


@pytest.mark.parametrize(
    ("kind", "bend", "path"),
    [
        (Telemetry, lambda d: d.update(bogus=1), "bogus"),
        (Telemetry, lambda d: d["kv"].update(blocks_total=1), "kv.blocks_total"),
        (Plan, lambda d: d["prefetch"][0]["key"].update(slot=2), "prefetch.0.key.slot"),
        (PlanAck, lambda d: d["footprint"].update(extra_bytes=1), "footprint.extra_bytes"),
    ],
)
def test_extra_fields_refused_by_name(kind: type, bend: Any, path: str) -> None:
    data = BUILDERS[kind]()
    bend(data)
    assert f"{path}: Extra inputs are not permitted" in refused(kind, data)


# ---- validators: each refusal names the field path ----


def _set(path: str, value: Any) -> Any:
    """A bend that sets the value at dotted `path` (ints index lists)."""

    def bend(data: dict[str, Any]) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        target: Any = data
        for part in parents:
            target = target[part]
        target[last] = value

    return bend


# fmt: off
CASES = [
    # negative bytes and counts
    (Plan, _set("expert_bytes_per_layer.1", -5), "expert_bytes_per_layer.1: Input should be greater than or equal"),
    (Telemetry, _set("links.0.bytes", -1), "links.0.bytes: Input should be greater than or equal to 0"),
    (PlanAck, _set("footprint.total_hbm_bytes", -1), "footprint.total_hbm_bytes: Input should be greater than"),
    (Telemetry, _set("kv.hits_per_tier.gpu", -3), "kv.hits_per_tier.gpu: Input should be greater than or equal to 0"),
    # telemetry shape against num_layers / num_experts
    (Telemetry, _set("layers.1.activation_counts", [1, 2, 3]),
     "layers.1.activation_counts: has 3 entries, expected num_experts=4"),
    (Telemetry, _set("layers.1.layer", 3), "layers.1.layer: 3 is out of range for num_layers=3"),
    (Telemetry, _set("layers.1.layer", 0), "layers.1.layer: 0 repeats layers.0.layer"),
    (Telemetry, _set("expert_slots", [{"layer": 3, "slots": 1}]),
     "expert_slots.0.layer: layer 3 is out of range for num_layers=3"),
    (Telemetry, _set("expert_slots", [{"layer": 1, "slots": 5}]), "expert_slots.0.slots: 5 exceed num_experts=4"),
    (Telemetry, _set("expert_slots", [{"layer": 1, "slots": 2}, {"layer": 1, "slots": 3}]),
     "expert_slots.1.layer: 1 repeats expert_slots.0.layer"),
    (Telemetry, _set("layers.0.cooccurrence.1", {"a": 2, "b": 4, "count": 1}),
     "layers.0.cooccurrence.1.b: expert 4 is out of range for num_experts=4"),
    (Telemetry, _set("layers.0.cooccurrence.1", {"a": 3, "b": 0, "count": 1}),
     "layers.0.cooccurrence.1.b: 0 must be greater than a=3"),
    (Telemetry, _set("layers.0.cooccurrence.1", {"a": 0, "b": 3, "count": 9}),
     "layers.0.cooccurrence.1: (0, 3) repeats cooccurrence.0"),
    (Telemetry, _set("window_end_s", 9.0), "window_end_s: 9.0 is before window_start_s=10.0"),
    (Telemetry, _set("step_timings_ms.p50", 31.0), "step_timings_ms.p50: 31.0 exceeds p99=30.0"),
    (Telemetry, _set("links.0.queue_delay_ms_mean", 2.5),
     "links.0.queue_delay_ms_mean: 2.5 exceeds queue_delay_ms_max=2.0"),
    (Telemetry, lambda d: d["stalls"].append({"cause": "expert_miss", "count": 1, "total_ms": 1.0}),
     "stalls.1.cause: expert_miss repeats stalls.0.cause"),
    # unknown names
    (Telemetry, _set("links.0.link", "pcie"), "links.0.link: Input should be 'h2d', 'd2h', 'disk2h' or 'h2disk'"),
    (Plan, _set("link_shares.pcie", 0.5), "link_shares.pcie.[key]: Input should be 'h2d', 'd2h', 'disk2h' or 'h2disk'"),
    (Plan, _set("kv_blocks_per_tier.tpu", 1), "kv_blocks_per_tier.tpu.[key]: Input should be 'gpu', 'cpu' or 'nvme'"),
    (Telemetry, _set("stalls.0.cause", "slow"), "stalls.0.cause: Input should be 'expert_miss', 'kv_miss' or 'both'"),
    # probabilities and shares
    (Forecast, _set("layers.1.probs.2", 1.5), "layers.1.probs.2: Input should be less than or equal to 1"),
    (Forecast, _set("kv_reuse_scores.ab12cd", -0.1), "kv_reuse_scores.ab12cd: Input should be greater than or equal"),
    (Forecast, _set("layers.0.probs", [0.5]), "layers.0.probs: has 1 entries, expected num_experts=4"),
    (Plan, _set("link_shares.h2d", 1.01), "link_shares.h2d: Input should be less than or equal to 1"),
    (Plan, _set("link_shares.d2h", 0.5), "link_shares: sum to 1.5; expected at most 1"),
    # plan invariants
    (Plan, _set("version", 3), "version: 3 must be greater than base_version=3"),
    (Plan, _set("base_version", 7), "version: 4 must be greater than base_version=7"),
    (Plan, _set("version", 0), "version: Input should be greater than or equal to 1"),
    (Plan, _set("pinned_experts.2", {"layer": 0, "expert": 3}),
     "pinned_experts.2: layer=0 expert=3 repeats pinned_experts.0"),
    (Plan, _set("pinned_experts.2", {"layer": 3, "expert": 0}),
     "pinned_experts.2.layer: layer 3 is outside the 3 layers of expert_bytes_per_layer"),
    (Plan, _set("eviction_priority.0.order", [1, 2, 1]), "eviction_priority.0.order.2: 1 repeats order.0"),
    (Plan, _set("hbm_budget_bytes", 5999), "expert_bytes_per_layer: sums to 6000 bytes, over hbm_budget_bytes=5999"),
    (Plan, _set("prefetch.0.priority", 4), "prefetch.0.priority: Input should be less than or equal to 3"),
    (Plan, _set("prefetch.0.deadline_ms", -1.0), "prefetch.0.deadline_ms: Input should be greater than or equal to 0"),
    (Plan, _set("reason", "   "), "reason: must contain a non-whitespace character"),
    (Plan, _set("plan_id", ""), "plan_id: must be non-empty and contain no whitespace"),
    # acks
    (PlanAck, _set("status", "rejected"), "reason_code: is required when status is 'rejected'"),
    (PlanAck, lambda d: d.update(status="rejected", reason_code="over_budget"),
     "reason: must be non-blank when status is 'rejected'"),
    (PlanAck, _set("reason_code", "stale"), "reason_code: must be absent when status is 'applied', got 'stale'"),
    (PlanAck, _set("footprint.total_hbm_bytes", 10), "footprint.total_hbm_bytes: 10 is below the 6000 expert bytes"),
    # types, NaN and versions
    (Telemetry, _set("rank", "3"), "rank: Input should be a valid integer"),
    (Telemetry, _set("expert_hits", 2.0), "expert_hits: Input should be a valid integer"),
    (Forecast, _set("created_s", float("nan")), "created_s: Input should be a finite number"),
    (Plan, _set("schema_version", 4), "schema_version: Input should be 1, 2 or 3"),
    (PlanAck, _set("schema_version", 2), "schema_version: Input should be 1"),
]
# fmt: on


@pytest.mark.parametrize(("kind", "bend", "expected"), CASES, ids=[c[2].split(":")[0] for c in CASES])
def test_invalid_message_refused_with_field_path(kind: type, bend: Any, expected: str) -> None:
    data = BUILDERS[kind]()
    bend(data)
    message = refused(kind, data)
    assert message.startswith(f"invalid {kind.__name__}: ")
    assert expected in message


def test_error_lists_first_few_problems_without_traceback_noise() -> None:
    data = plan_data()
    data["expert_bytes_per_layer"] = [-1] * 8
    with pytest.raises(ProtocolError) as info:
        parse(Plan, data)
    err = info.value
    assert isinstance(err, ValueError)
    assert len(err.problems) == 8
    assert str(err).count("Input should be greater than or equal to 0") == NUM_ERRORS_SHOWN
    assert str(err).endswith("(+3 more)")
    assert "errors.pydantic.dev" not in str(err) and "input_value" not in str(err)
    assert err.__cause__ is None and err.__suppress_context__


def test_malformed_json_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match=r"invalid Plan: \(message\): Invalid JSON"):
        parse(Plan, '{"plan_id": ')


@pytest.mark.parametrize("data", [None, 42, ["plan"]], ids=["None", "int", "list"])
def test_something_that_is_not_a_message_is_a_protocol_error(data: object) -> None:
    with pytest.raises(ProtocolError, match=r"invalid Plan: \(message\): expected JSON text or a mapping, got "):
        parse(Plan, data)  # type: ignore[arg-type]


def test_direct_construction_refuses_too() -> None:
    with pytest.raises(ValidationError, match="version: 1 must be greater than base_version=1"):
        Plan(**{**plan_data(), "version": 1, "base_version": 1})


# ---- property: any valid window round-trips ----

counts = st.integers(min_value=0, max_value=2**40)
seconds = st.floats(min_value=0, max_value=1e9, allow_nan=False, allow_infinity=False)
ids = st.text(alphabet=st.characters(blacklist_categories=("Z", "C")), min_size=1, max_size=12)
tiers = st.sampled_from([t.value for t in Tier])


@st.composite
def telemetry_windows(draw: st.DrawFn) -> dict[str, Any]:
    num_layers = draw(st.integers(1, 6))
    num_experts = draw(st.integers(1, 8))
    layer_ids = draw(st.lists(st.integers(0, num_layers - 1), unique=True, max_size=num_layers))
    all_pairs = list(itertools.combinations(range(num_experts), 2))  # each (a, b) with a < b
    pairs = st.lists(st.sampled_from(all_pairs), unique=True, max_size=4) if all_pairs else st.just([])
    layers = [
        {
            "layer": layer,
            "activation_counts": draw(st.lists(counts, min_size=num_experts, max_size=num_experts)),
            "cooccurrence": [{"a": a, "b": b, "count": draw(counts)} for a, b in draw(pairs)],
            "router_entropy_mean": draw(seconds),
            "num_tokens": draw(counts),
        }
        for layer in layer_ids
    ]
    start_s = draw(seconds)
    delays = sorted(draw(st.lists(seconds, min_size=2, max_size=2)))
    p50, p99 = sorted(draw(st.lists(seconds, min_size=2, max_size=2)))
    return {
        "agent_id": draw(ids),
        "rank": draw(st.integers(0, 64)),
        "window_seq": draw(counts),
        "window_start_s": start_s,
        "window_end_s": start_s + draw(st.floats(0, 1e3)),
        "model": draw(ids),
        "num_layers": num_layers,
        "num_experts": num_experts,
        "layers": layers,
        "kv": {
            "blocks_per_tier": draw(st.dictionaries(tiers, counts)),
            "hits_per_tier": draw(st.dictionaries(tiers, counts)),
            "misses_per_tier": draw(st.dictionaries(tiers, counts)),
            "reuse_events": draw(
                st.lists(st.fixed_dictionaries({"prefix_hash": ids, "age_s": seconds, "tier": tiers}), max_size=4)
            ),
        },
        "links": [
            {"link": link, "bytes": draw(counts), "queue_delay_ms_mean": delays[0], "queue_delay_ms_max": delays[1]}
            for link in draw(st.lists(st.sampled_from([x.value for x in Link]), unique=True))
        ],
        "stalls": [
            {"cause": cause, "count": draw(counts), "total_ms": draw(seconds)}
            for cause in draw(st.lists(st.sampled_from(["expert_miss", "kv_miss", "both"]), unique=True))
        ],
        "step_timings_ms": {"num_steps": draw(counts), "mean": draw(seconds), "p50": p50, "p99": p99},
        "expert_hits": draw(counts),
        "expert_misses": draw(counts),
        "applied_plan_version": draw(counts),
        "fallbacks": draw(st.dictionaries(ids, counts, max_size=3)),
        "expert_slots": [{"layer": layer, "slots": draw(st.integers(0, num_experts))}
                         for layer in draw(st.lists(st.integers(0, num_layers - 1), unique=True, max_size=num_layers))],
    }


@settings(max_examples=150, deadline=None)
@given(telemetry_windows())
def test_any_valid_telemetry_window_round_trips_equal(data: dict[str, Any]) -> None:
    msg = parse(Telemetry, data)
    assert parse(Telemetry, to_json(msg)) == msg
    assert parse(Telemetry, to_json(msg).encode()) == msg


# ---- dependency direction ----


def test_protocol_imports_no_torch_runtime_or_agent() -> None:
    code = (
        "import tierplan.controller.protocol, sys; "
        "bad = [m for m in ('torch', 'tierplan.runtime', 'tierplan.agent') if m in sys.modules]; "
        "assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
