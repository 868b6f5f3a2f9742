"""The KV reuse predictor fed live from telemetry's reuse events, and the plan's KV retention made from it: a
prefix reused often is kept before one reused rarely (first by counts, then by the fitted model), every event
past the cap or window behind the clock is counted, and a held split is re-issued only when the order moves."""

from __future__ import annotations

import dataclasses

from tests.controller.loop_fixtures import Windows, ack, make_controller
from tierplan.controller.kv_reuse_feed import KvReuseConfig, KvReuseFeed, RetentionBasis
from tierplan.controller.loop import Controller, Outcome
from tierplan.controller.protocol import Forecast, Plan, Telemetry, parse, to_json


def kv(*hashes: str, age_s: float = 1.0) -> dict:
    return {"blocks_per_tier": {"gpu": 10}, "hits_per_tier": {}, "misses_per_tier": {},
            "reuse_events": [{"prefix_hash": h, "age_s": age_s, "tier": "cpu"} for h in hashes]}


def window(win: Windows, *hashes: str) -> Telemetry:
    return win.next(2, 10, kv=kv(*hashes))


def small_model(**over: object) -> KvReuseConfig:
    return KvReuseConfig(**{"horizon_s": 0.05, "min_fit_events": 40, "refit_every_events": 200, **over})


def controller(**over: object) -> Controller:
    base = make_controller().config
    return Controller(dataclasses.replace(base, **over))


def test_events_feed_the_predictor_and_the_often_reused_prefix_ranks_first() -> None:
    feed, win = KvReuseFeed(), Windows()
    for i in range(6):
        fed = feed.observe(window(win, "A", "A", *(("B",) if i == 0 else ())))
        assert fed == (3 if i == 0 else 2)
    ret = feed.retention(10)
    assert ret.hashes == ("A", "B") and ret.basis is RetentionBasis.COUNT  # 2 events: far from a fit
    assert ret.scores == (12.0, 1.0)
    assert "by accesses so far" in ret.describe() and "not fitted yet" in ret.describe()
    assert feed.stats()["events_fed"] == 13 and feed.reuse_scores() == {}  # no model, no probabilities
    assert feed.retention(1).hashes == ("A",)


def test_events_past_the_cap_and_windows_behind_the_clock_are_counted() -> None:
    feed, win = KvReuseFeed(KvReuseConfig(max_events_per_window=2)), Windows()
    assert feed.observe(window(win, "A", "B", "C")) == 2
    late = window(Windows(), "C")  # another rank whose clock is behind
    feed.observe(win.next(2, 10, kv=kv("D")))
    feed.observe(late)
    st = feed.stats()
    assert st["events_over_cap"] == 1 and st["windows_clock_behind"] == 1 and st["events_fed"] == 4
    assert "C" in feed.retention(10).hashes  # fed at the feed's time, not lost


def test_the_model_fits_live_and_keeps_the_often_reused_prefix_first() -> None:
    feed, win = KvReuseFeed(small_model()), Windows()
    for i in range(200):  # A every window; B every 8th; one-off prefixes that never come back
        feed.observe(window(win, "A", f"once-{i}", f"once-{i}-b", *(("B",) if i % 8 == 0 else ())))
    assert feed.predictor.is_fitted and feed.stats()["fits"] >= 1
    ret = feed.retention(100)
    assert ret.basis is RetentionBasis.MODEL and ret.hashes[0] == "A"
    assert "by P(reused within 0.05 s) from the reuse model" in ret.describe()
    scores = feed.reuse_scores()
    assert all(0.0 <= p <= 1.0 for p in scores.values()) and scores["A"] == max(scores.values())


def test_a_plan_keeps_the_often_reused_prefix_first_and_says_so() -> None:
    ctl, win = make_controller(), Windows()
    ctl.sync_from(window(win, "A", "B", "A"))
    ctl.sync_from(window(win, "A", "A"))
    plan = ctl.step_next()
    assert plan is not None and plan.kv_retention == ("A", "B")
    assert parse(Plan, to_json(plan)) == plan and plan.schema_version == 3
    assert "KV retention: 2 prefixes kept first, by accesses so far" in plan.reason
    assert ctl.history[-1].reason == plan.reason
    assert ctl.stats()["kv_reuse_events_fed"] == 5


def test_the_fitted_model_orders_the_plans_retention() -> None:
    ctl, win = controller(kv_reuse=small_model()), Windows()
    for i in range(200):
        ctl.sync_from(window(win, "A", f"once-{i}", *(("B",) if i % 8 == 0 else ())))
    plan = ctl.step_next()
    assert plan is not None and plan.kv_retention[0] == "A"  # B was last seen beyond the horizon: not ranked
    assert "B" not in plan.kv_retention and "from the reuse model" in plan.reason
    fc = parse(Forecast, to_json(ctl.forecast_message()))
    assert fc.kv_reuse_scores["A"] == max(fc.kv_reuse_scores.values())


def test_retention_is_bounded_by_what_the_cpu_and_nvme_tiers_hold() -> None:
    ctl, win = controller(kv_cpu_blocks=2, kv_nvme_blocks=1), Windows()
    ctl.sync_from(window(win, "A", "A", "A", "B", "B", "C", "D", "E"))
    plan = ctl.step_next()
    assert plan is not None and plan.kv_retention == ("A", "B", "C")


def test_a_held_split_is_reissued_only_when_the_retention_moves() -> None:
    ctl, win = make_controller(hysteresis=0.5), Windows()
    ctl.sync_from(window(win, "A", "B"))
    first = ctl.step_next()
    assert first is not None and set(first.kv_retention) == {"A", "B"}
    ctl.record_ack(ack(first))
    win.applied = first.version
    ctl.sync_from(window(win, "A", "B"))
    assert ctl.step_next() is None and ctl.history[-1].outcome is Outcome.HELD  # same prefixes: nothing to send
    ctl.sync_from(window(win, "C", "C", "D", "D", "E", "E"))
    again = ctl.step_next()
    assert again is not None and again.version == 2 and again.kv_retention[:3] == ("C", "D", "E")
    assert again.expert_bytes_per_layer == first.expert_bytes_per_layer
    assert again.kv_blocks_per_tier == first.kv_blocks_per_tier
    assert again.reason.startswith("kept split (") and "KV retention: 5 prefixes" in again.reason


def test_windows_without_reuse_events_give_plans_without_retention() -> None:
    ctl, win = make_controller(), Windows()
    ctl.sync_from(win.next(2, 10))
    plan = ctl.step_next()
    assert plan is not None and plan.kv_retention == () and "KV retention" not in plan.reason
