"""Every baseline on one tiny CPU point: its plans are APPLIED by the agent's enforcer, the footprint (expert
slots + GPU KV) stays within the point's budget after every step of the replay, and the tokens equal the
resident run's (placement never changes bits). The oracle runs on its recorded access stream."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.bench import baseline_point as bp
from tierplan.bench.baselines import BASELINES, make, oracle_splits
from tierplan.controller.protocol import AckStatus

LIVE = ("tierplan", "mv_wsa", "fluxmoe")


def _baseline(name: str, local_predictor: bool = False) -> Any:
    """The registry's baseline; a live one plans from its cost model's priors (calibrate off), so no wall-clock
    time enters a decision and its plans are the same on every machine."""
    b = make(name)
    if hasattr(b, "calibrate"):
        b.calibrate = False
        b.local_predictor = local_predictor
    return b


def _oracle(workdir: Path) -> Any:
    from tierplan.bench.baselines.oracle import RecordingPass

    eng, ctx = bp.context(workdir)
    eng.close()
    split = oracle_splits(ctx)[-1]
    rec = RecordingPass(split)
    recorded = bp.run(rec, workdir)
    return bp.run(make("oracle"), workdir, future=rec.future(), split=split), recorded


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in BASELINES:
        wd = tmp_path_factory.mktemp(name)
        if name == "oracle":
            out[name], out["oracle_recording"] = _oracle(wd)
        else:
            out[name] = bp.run(_baseline(name), wd)
        if name in LIVE:  # and with the agent's layer-ahead predictor, which they take when asked
            out[f"{name}+local"] = bp.run(_baseline(name, local_predictor=True), tmp_path_factory.mktemp(name))
    return out


def test_registry_lists_the_issue_order_and_refuses_unknown_names() -> None:
    assert BASELINES == ("resident", "static_lru", "static_lfru", "fluxmoe", "kv_tiering", "mv_wsa", "tierplan",
                         "oracle")
    assert [make(n).name for n in BASELINES] == list(BASELINES)
    with pytest.raises(ValueError, match=r"unknown baseline 'lru'.*static_lru"):
        make("lru")


@pytest.mark.parametrize("name", BASELINES)
def test_every_plan_is_applied(results: dict[str, Any], name: str) -> None:
    r = results[name]
    assert r.acks, name
    assert [a.status for a in r.acks] == [AckStatus.APPLIED] * len(r.acks), [a.reason for a in r.acks]
    assert r.acks[0].footprint.total_hbm_bytes <= bp.BUDGET_BYTES


@pytest.mark.parametrize("name", BASELINES)
def test_footprint_stays_within_the_budget_over_the_whole_replay(results: dict[str, Any], name: str) -> None:
    r = results[name]
    assert r.report.steps > 10
    assert r.over_budget_steps == 0
    assert 0 < r.peak_hbm_bytes <= bp.BUDGET_BYTES
    assert r.run.initial_plan.hbm_budget_bytes == bp.BUDGET_BYTES


@pytest.mark.parametrize("name", BASELINES)
def test_tokens_equal_the_resident_run(results: dict[str, Any], name: str) -> None:
    r, ref = results[name], results["resident"]
    assert len(r.outputs) == len(bp.requests())
    assert r.outputs == ref.outputs


def test_live_baselines_replan_through_the_loop(results: dict[str, Any]) -> None:
    for name in LIVE + tuple(f"{n}+local" for n in LIVE):
        loop = results[name].stats["loop"]
        assert loop["windows"] >= 3 and loop["planner_errors"] == 0 and loop["telemetry_refused"] == 0, (name, loop)
        assert loop["peak_over_budget_bytes"] == 0
        if name.startswith("tierplan"):  # the start split, then plans of its own only where they beat it by the margin
            history = results[name].run.source.history
            assert loop["applied"] >= 1 and history, (name, loop)
            assert all(d.reason for d in history) and loop["applied"] == 1 + sum(d.outcome == "issued" for d in history)
        else:  # the baselines' first plan is their allocator's, whatever the start
            assert loop["applied"] >= 2, (name, loop)  # the starting split, then at least one of the controller's


def test_the_oracle_follows_its_record_and_beats_lru_at_its_split(results: dict[str, Any]) -> None:
    oracle, recorded = results["oracle"], results["oracle_recording"]
    order = oracle.run.victim_order
    assert order.diverged_steps == 0 and order.rankings > 0
    assert recorded.report.steps == oracle.report.steps
    # The recording pass ran LRU at the same split: Belady's order misses no more often.
    assert oracle.report.expert_hit_rate >= recorded.report.expert_hit_rate
    assert oracle.report.expert_misses < recorded.report.expert_misses


@pytest.mark.parametrize("name", BASELINES)
def test_the_local_predictor_is_attached_only_to_a_live_policy_that_asks(results: dict[str, Any], name: str) -> None:
    """The layer-ahead predictor observes every MoE layer's routes: no policy runs it by default (a static baseline
    never pays for it), a live one when built with `local_predictor=True`, with the same tokens and budget."""
    r = results[name]
    assert r.run.local_predictor is False and r.stats["local_predictor"] is False
    if name in LIVE:
        on = results[f"{name}+local"]
        assert on.run.local_predictor is True and on.stats["local_predictor"] is True
        assert on.outputs == results["resident"].outputs and on.over_budget_steps == 0
        assert [a.status for a in on.acks] == [AckStatus.APPLIED] * len(on.acks)
        assert on.stats["loop"]["telemetry_refused"] == 0 and on.stats["loop"]["planner_errors"] == 0
