"""agent/local_predictor.py: the plan's table evaluated one MoE layer ahead, prefetches within the byte budget,
counted issued / skipped / useful / wasted; the window's transitions and step unions reported."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.agent import Agent, build_agent, make_plan
from tierplan.agent.local_predictor import LayerAheadPredictor
from tierplan.controller.protocol import LocalPredictor, Plan, Successor, Telemetry, TransitionRow
from tierplan.runtime.memory.slots import ExpertState


@pytest.fixture
def agent(tmp_path: Path) -> Agent:
    a = build_agent(tmp_path)
    yield a
    a.close()


def _predictor(agent: Agent) -> LayerAheadPredictor:
    eng = agent.engine
    return LayerAheadPredictor(eng.spec.moe_layers, eng.spec.num_experts, eng.experts, agent.policy,
                               agent.stride_bytes)


def _plan(agent: Agent, budget_slots: int, rows: list[TransitionRow], version: int = 1) -> Plan:
    table = LocalPredictor(version=7, top_m=3, min_score=0.5, rows=tuple(rows))
    return make_plan(agent, version=version, local_predictor=table,
                     prefetch_budget_bytes_per_step=budget_slots * agent.stride_bytes)


def _ids(*rows: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)  # [N, k]


def _plain(fields: dict) -> dict:
    """A window's fields as plain data (the parts are protocol models, made off the engine thread)."""
    return {"transitions": [t.model_dump() for t in fields["transitions"]],
            "step_unions": [u.model_dump() for u in fields["step_unions"]], "local_prefetch": fields["local_prefetch"]}


def _pairs(trans: dict) -> dict[tuple[int, int], int]:
    return {(s, d): c for s, d, c in trans["pairs"]}


def test_prefetches_the_next_layers_likely_experts_within_the_budget(agent: Agent) -> None:
    pred = _predictor(agent)
    rows = [TransitionRow(layer=0, src=0, next=(Successor(5, 0.9), Successor(6, 0.8), Successor(7, 0.6))),
            TransitionRow(layer=0, src=1, next=(Successor(4, 0.2),))]
    assert agent.enforcer.apply(_plan(agent, budget_slots=2, rows=rows)).status.value == "applied"
    pred.install(_plan(agent, budget_slots=2, rows=rows))
    pool = agent.engine.pool
    assert not any(pool.is_resident(1, e) for e in (4, 5, 6, 7))
    pred.on_route(0, _ids((0, 1)))
    assert pred.counts["issued"] == 2 and pred.counts["skipped_budget"] == 1  # 5 and 6 fit, 7 does not
    agent.engine.experts.ensure(1, [5, 6])  # waits for the two prefetched loads
    assert pool.is_resident(1, 5) and pool.is_resident(1, 6)
    assert pool.state(1, 4) is ExpertState.ABSENT and pool.state(1, 7) is ExpertState.ABSENT  # 0.2 < min_score
    pred.on_route(1, _ids((5, 2)))
    assert pred.counts["useful"] == pred.counts["wasted"] == 0  # the books close with the step (one host copy)
    pred.end_step()
    assert pred.counts["useful"] == 1 and pred.counts["wasted"] == 1  # 5 was needed, 6 was not
    pred.on_route(0, _ids((0, 3)))  # a new step: the budget is fresh, 5 and 6 are resident
    assert pred.counts["skipped_resident"] == 2 and pred.counts["issued"] == 3


def test_no_table_no_prefetch_but_observation_goes_on(agent: Agent) -> None:
    pred = _predictor(agent)
    pred.install(make_plan(agent))  # a plan without a local predictor
    pred.on_route(0, _ids((0, 1), (2, 3)))
    pred.on_route(1, _ids((4, 5), (4, 6)))
    pred.end_step()
    assert pred.counts["issued"] == 0
    fields = _plain(pred.window_fields())
    trans = fields["transitions"][0]
    assert trans["layer"] == 0 and trans["next_layer"] == 1 and trans["num_tokens"] == 2
    assert _pairs(trans)[(0, 4)] == 1
    assert set(_pairs(trans)) == {(0, 4), (0, 5), (1, 4), (1, 5), (2, 4), (2, 6), (3, 4), (3, 6)}
    assert fields["step_unions"][1] == {"layer": 1, "batch_tokens": (2,), "unions": ((4, 5, 6),)}
    assert fields["local_prefetch"]["issued"] == 0 and fields["local_prefetch"]["table_version"] == 0
    again = _plain(pred.window_fields())  # reset after reporting
    assert again["transitions"] == [] and again["step_unions"] == [] and again["local_prefetch"]["useful"] == 0


def test_window_fields_make_a_valid_telemetry_v2(agent: Agent) -> None:
    pred = _predictor(agent)
    pred.on_route(0, _ids((0, 1)))
    pred.on_route(1, _ids((2, 3)))
    pred.end_step()
    base = {"agent_id": "a", "rank": 0, "window_seq": 0, "window_start_s": 0.0, "window_end_s": 1.0,
            "model": "tiny", "num_layers": 2, "num_experts": 8, "layers": [],
            "kv": {"blocks_per_tier": {}, "hits_per_tier": {}, "misses_per_tier": {}},
            "step_timings_ms": {"num_steps": 1, "mean": 1.0, "p50": 1.0, "p99": 1.0}, "expert_hits": 0,
            "expert_misses": 0, "applied_plan_version": 0}
    tel = Telemetry(**base, **pred.window_fields())
    assert tel.transitions[0].pairs and tel.step_unions[0].unions == ((0, 1),)
    assert tel.local_prefetch is not None and tel.local_prefetch.issued == 0
    # The parts are made without re-validation: what a process boundary validates from their JSON is the same.
    assert Telemetry.model_validate_json(tel.model_dump_json()) == tel


def test_a_prefill_step_counts_a_sample_of_its_pairs_weighted_to_all_its_rows(agent: Agent) -> None:
    """A thousand-row step reads PAIR_ROWS rows for its pairs, each standing for N / PAIR_ROWS rows: the counts
    stay what all rows would give where the rows are alike, at a bounded cost on the engine thread."""
    from tierplan.agent import local_predictor as lp

    pred = _predictor(agent)
    pred.install(make_plan(agent))
    n = 1000
    src = torch.tensor([(0, 1)] * n)  # [N, 2] every row routes to experts 0, 1 then 4, 5
    dst = torch.tensor([(4, 5)] * n)
    sizes = []
    real = torch.Tensor.index_add_
    torch.Tensor.index_add_ = lambda t, dim, idx, src_, **kw: sizes.append(idx.numel()) or real(t, dim, idx, src_, **kw)
    try:
        pred.on_route(0, src)
        pred.on_route(1, dst)
    finally:
        torch.Tensor.index_add_ = real
    pred.end_step()
    assert sizes == [lp.PAIR_ROWS * 2 * 2]  # the sample's pairs, not the step's 4000
    fields = _plain(pred.window_fields())
    trans = fields["transitions"][0]
    assert trans["num_tokens"] == n
    assert _pairs(trans) == {(0, 4): n, (0, 5): n, (1, 4): n, (1, 5): n}
    assert fields["step_unions"][0]["unions"] == ((0, 1),) and fields["step_unions"][1]["unions"] == ((4, 5),)


def test_a_window_of_eager_and_replayed_steps_is_observed(agent: Agent) -> None:
    """Eager steps (a prefill) call the route hook inside inference mode, graph replays outside it: the
    window's counts take both. Int32 routes and an empty step are observed too."""
    pred = _predictor(agent)
    pred.install(make_plan(agent))
    with torch.inference_mode():
        pred.on_route(0, _ids((0, 1), (2, 3)))
        pred.on_route(1, _ids((4, 5), (4, 6)))
    pred.end_step()
    pred.on_route(0, _ids((0, 1)).int())
    pred.on_route(1, _ids((4, 5)))
    pred.end_step()
    pred.on_route(0, torch.zeros((0, 2), dtype=torch.int64))
    pred.on_route(1, torch.zeros((0, 2), dtype=torch.int64))
    pred.end_step()
    fields = _plain(pred.window_fields())
    assert _pairs(fields["transitions"][0])[(0, 4)] == 2
    assert fields["step_unions"][0]["unions"] == ((0, 1, 2, 3), (0, 1), ())
    assert fields["step_unions"][0]["batch_tokens"] == (2, 1, 0)


def test_a_replayed_steps_routes_at_once_are_observed_as_layer_by_layer_and_never_prefetch(agent: Agent) -> None:
    """`observe_all` (after a graph replay: every layer has run) reports the window `on_route` would, and issues
    no prefetch even with a table that scores the next layer's experts."""
    rows = [TransitionRow(layer=0, src=e, next=(Successor(7, 0.9),)) for e in range(8)]
    assert agent.enforcer.apply(_plan(agent, budget_slots=2, rows=rows)).status.value == "applied"
    by_layer, at_once = _predictor(agent), _predictor(agent)
    by_layer.install(make_plan(agent))  # no table: observing only
    at_once.install(_plan(agent, budget_slots=2, rows=rows))
    gen = torch.Generator().manual_seed(3)
    for n in (1, 3, 100):  # 100 rows: past PAIR_ROWS, so both sample the same rows for the pairs
        ids = torch.randint(0, 8, (2, n, 2), generator=gen)  # [L, N, k]
        for m, layer in enumerate(agent.engine.spec.moe_layers):
            by_layer.on_route(layer, ids[m])
        at_once.observe_all(ids.int())
        by_layer.end_step()
        at_once.end_step()
    assert at_once.counts["issued"] == 0 and at_once.counts == by_layer.counts
    got, want = _plain(at_once.window_fields()), _plain(by_layer.window_fields())
    assert got["transitions"] == want["transitions"] and got["step_unions"] == want["step_unions"]
    assert got["transitions"][0]["num_tokens"] == 104


def test_the_adapters_route_hook_observes_a_replay_at_once(tmp_path: Path) -> None:
    from tests.agent import tiny_engine
    from tierplan.agent.adapters.reference import ReferenceAdapter

    eng = tiny_engine(tmp_path)
    try:
        adapter = ReferenceAdapter(eng, local_predictor=True)
        hook = eng.model.route_tap
        assert hook is not None and hasattr(hook, "add_all")
        seen = []
        adapter.predictor.observe_all = seen.append  # type: ignore[method-assign, union-attr]
        ids = torch.zeros((2, 1, 2), dtype=torch.int64)
        hook.add_all(ids, torch.full((2, 1, 2), 0.5))
        assert len(seen) == 1 and seen[0] is ids
    finally:
        eng.close()
