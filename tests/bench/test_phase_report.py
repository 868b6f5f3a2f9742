"""The phase report's targets and table over made-up rows: nothing that is not "ok" is dropped quietly, and
policies are compared by time per output token, never by step time across runs of different concurrency."""

from __future__ import annotations

from typing import Any

from tierplan.bench.phase_report import markdown, summarize


def _row(policy: str, tok_s: float | None, status: str = "ok", point: str = "p1", batch: int = 8,
         step_ms: float = 10.0, running: float = 4.0, **extra: Any) -> dict[str, Any]:
    ran = tok_s is not None
    return {"model": "m", "layers": 2, "full_layers": 2, "batch": batch, "context": 32, "hbm_budget_gib": 1.0,
            "budget_frac": None, "policy": policy, "device": "cpu", "point": point, "code": "c", "status": status,
            "decode_tok_s": tok_s, "ms_per_token": 1e3 / tok_s if ran else None,
            "tpot_p50_ms": 1.0 if ran else None, "tpot_p99_ms": 1.0 if ran else None,
            "ttft_p50_ms": 1.0 if ran else None, "expert_hit_rate": 0.5 if ran else None,
            "stall_ms_expert": 0.0 if ran else None, "stall_ms_kv": 0.0 if ran else None,
            "stall_ms_both": 0.0 if ran else None, "predicted_step_ms": step_ms if ran else None,
            "measured_step_ms": step_ms if ran else None, "predicted_over_measured": 1.0 if ran else None,
            "mean_running_batch": running if ran else None, "plan_changes": 0, "kv_hits": {}, "link_bytes": {},
            "notes": extra.pop("notes", ""), **extra}


def test_a_degraded_tierplan_counts_as_missed_with_its_reason() -> None:
    rows = [_row("resident", 100.0), _row("tierplan", 40.0, "degraded", notes="19 window(s) the planner failed"),
            _row("resident", 100.0, point="p2"), _row("tierplan", 160.0, point="p2")]
    per, targets = summarize(rows)
    at_every = targets["tierplan >= 0.95x the best static baseline at every point"]
    assert at_every[0] is False and "tierplan not ok at 1 of 2 points (missed)" in at_every[1]
    p1 = next(p for p in per if p["point"] == "p1")
    assert p1["cause"].startswith("missed: tierplan degraded: 19 window(s)")
    assert p1["tierplan_tok_s"] == 40.0 and not p1["tierplan_ok"]
    assert "| 40.0 (degraded) |" in markdown(rows, "t", False, "cpu")


def test_refused_error_and_absent_tierplan_rows_are_missed_points() -> None:
    rows = [_row("resident", 100.0), _row("tierplan", None, "refused", notes="no solver"),
            _row("resident", 100.0, point="p2"), _row("tierplan", None, "error", point="p2", notes="OOM"),
            _row("resident", 100.0, point="p3")]
    per, targets = summarize(rows)
    assert [p["cause"] for p in per] == ["missed: tierplan refused: no solver", "missed: tierplan error: OOM",
                                         "missed: no tierplan row"]
    met, fig = targets["tierplan >= 1.5x the best non-oracle baseline at >= 1 point"]
    assert met is False and "tierplan not ok at 3 of 3 points" in fig


def test_a_degraded_baseline_stays_in_best_and_is_marked() -> None:
    rows = [_row("resident", 100.0), _row("mv_wsa", 300.0, "degraded"), _row("tierplan", 160.0)]
    per, targets = summarize(rows)
    assert per[0]["best"] == "mv_wsa (degraded)" and per[0]["vs_best"] == 160.0 / 300.0
    assert targets["tierplan >= 1.5x the best non-oracle baseline at >= 1 point"][0] is False
    assert "| mv_wsa (degraded) | 300.0 |" in markdown(rows, "t", False, "cpu")


def test_a_tierplan_variant_is_never_the_best_baseline() -> None:
    rows = [_row("resident", 100.0), _row("tierplan_rs", 300.0), _row("tierplan", 160.0)]
    per, _targets = summarize(rows)
    assert per[0]["best"] == "resident" and per[0]["vs_best"] == 1.6


def test_the_oracle_target_compares_time_per_token_not_step_time() -> None:
    # The oracle runs 8 sequences a step at 16 ms, tierplan 2 at 8 ms: the oracle's step is twice as long, yet
    # its time per token is half tierplan's (tok/s 500 vs 250).
    rows = [_row("resident", 250.0), _row("tierplan", 250.0, step_ms=8.0, running=2.0),
            _row("oracle", 500.0, step_ms=16.0, running=8.0)]
    per, targets = summarize(rows)
    assert per[0]["oracle_over_tierplan_tpt"] == 0.5
    met, fig = targets["mean oracle / tierplan time per output token >= 1/1.10"]
    assert met is False and fig.startswith("0.500")


def test_the_cause_compares_per_token_figures() -> None:
    # Same expert stall per step, but tierplan runs half as many sequences a step: its stall per token doubles.
    rows = [_row("resident", 200.0, running=8.0, stall_ms_expert=20.0, preemptions=0),
            _row("tierplan", 100.0, running=4.0, stall_ms_expert=20.0, preemptions=0)]
    (p,), _ = summarize(rows)
    assert p["cause"].startswith("split: experts short (expert stall 5.000 vs 2.500 ms/token)")
    rows = [_row("resident", 200.0, running=8.0), _row("tierplan", 100.0, running=4.0)]  # no stall either
    (p,), _ = summarize(rows)
    assert p["cause"].startswith("split: KV short (4.0 vs 8.0 sequences per step)") and "host link" not in p["cause"]
    # a run that met a slower host link than the best baseline's says so (the machine, not the policy)
    rows = [_row("resident", 200.0, running=8.0, run_link_gb_s=50.0),
            _row("tierplan", 100.0, running=4.0, run_link_gb_s=30.0)]
    (p,), _ = summarize(rows)
    assert p["cause"].endswith("; host link 30.0 vs 50.0 GB/s at the runs' starts"), p["cause"]
    rows[1]["run_link_gb_s"] = 46.0  # within 10 %: not named
    (p,), _ = summarize(rows)
    assert "host link" not in p["cause"]
    rows = [_row("resident", 200.0, running=2.0, engine_step_ms=9.0),
            _row("tierplan", 100.0, running=2.0, step_ms=20.0, engine_step_ms=9.5)]  # 10.5 ms/step between steps
    (p,), _ = summarize(rows)
    assert p["cause"].startswith("engine overhead between steps (KV moves of plan changes and preemptions, planner "
                                 "solves, hooks): 5.250 vs 0.500")
    # H100 run 47, b128 16K 40 GiB: a KV stall beside ~7x as much time between steps; the larger names the cause
    rows = [_row("kv_tiering", 193.2, running=2.7, step_ms=14.1, engine_step_ms=11.8),
            _row("tierplan", 64.2, running=2.6, step_ms=41.0, engine_step_ms=13.0, stall_ms_kv=4.1)]
    (p,), _ = summarize(rows)
    assert p["cause"].startswith("engine overhead between steps") and "10.769 vs 0.852" in p["cause"]
    rows[1]["stall_ms_kv"] = 40.0  # a KV stall larger than the time between steps: the split again
    (p,), _ = summarize(rows)
    assert p["cause"].startswith("split: KV short (KV stall 15.385 vs 0.000 ms/token)")


def test_a_best_run_that_served_a_few_requests_before_the_stop_is_not_the_same_work() -> None:
    """H200 phase run 26, b128 1K 40 GiB: resident's 171 KV blocks ran 2.9 sequences a step and the run stopped
    with 154 of 160 requests unfinished; tierplan served all 160."""
    rows = [_row("resident", 470.0, running=2.9, requests=160, requests_unfinished=154),
            _row("tierplan", 325.0, running=52.1, requests=160, requests_unfinished=0)]
    (p,), _ = summarize(rows)
    assert p["cause"].startswith("not the same work: resident served 6 of 160 requests before the run's stop, "
                                 "tierplan 160 (2.9 vs 52.1 sequences per step)")
    rows[0]["requests_unfinished"] = 40  # 120 of 160: comparable work, the usual causes
    (p,), _ = summarize(rows)
    assert not p["cause"].startswith("not the same work")
    for r in rows:  # rows from before the run stop count no requests
        del r["requests_unfinished"]
    (p,), _ = summarize(rows)
    assert not p["cause"].startswith("not the same work")


def _work(**over: Any) -> dict[str, Any]:
    """The fields `same_work` compares, as two runs that did the same work share them."""
    return {"measured_steps": 120, "output_tokens": 960, "preemptions": 0, "expert_hit_rate": 0.9,
            "executor_steps": {"piecewise/experts_missing": 114, "eager/prefill": 6},
            "link_bytes": {"h2d": 1_000_000, "d2h": 0}, "kv_hits": {"gpu": 5000, "cpu": 0}, **over}


def test_a_shortfall_with_the_same_work_as_the_best_is_named_run_to_run_spread() -> None:
    rows = [_row("static_lru", 120.0, **_work()), _row("tierplan", 100.0, **_work(expert_hit_rate=0.903)),
            _row("resident", 90.0, **_work(link_bytes={"h2d": 2_000_000, "d2h": 0}))]
    per, targets = summarize(rows)
    assert per[0]["cause"].startswith("same work as static_lru (same steps, executors, bytes moved and hits)")
    met, fig = targets["tierplan >= 0.95x the best static baseline at every point"]
    assert met is False and "(1 of them the same work: not a decision)" in fig
    md = markdown(rows, "t", False, "cpu")
    assert ("Run-to-run spread: 1 pairs of runs at 1 points did the same work" in md
            and "20.0% at the median" in md and "(static_lru and tierplan at p1)" in md)


def test_a_same_work_gap_held_by_one_step_kind_is_named_by_it() -> None:
    """H100 runs 71, 74, 75, b256 4K 56 GiB: tierplan did mv_wsa's work at 0.72-0.79x in three runs, decode steps
    alike and its prefill steps 86 vs 60 ms: engine time in the prefills, beside its planner, not spread."""
    rows = [_row("mv_wsa", 120.0, **_work(decode_steps=114), decode_step_ms=12.9, prefill_step_ms=60.0,
                 planner_ms_p50=80.0),
            _row("tierplan", 90.0, **_work(decode_steps=114), decode_step_ms=12.8, prefill_step_ms=85.8,
                 planner_ms_p50=150.0)]
    (p,), _ = summarize(rows)
    assert p["cause"] == ("same work as mv_wsa (same steps, executors, bytes moved and hits): not a decision; engine "
                          "overhead in its prefill steps (85.8 vs 60.0 ms each over 6, 100% of the gap; decode steps "
                          "12.8 vs 12.9 ms), beside a planner of 150 ms a window (mv_wsa 80)")
    rows[1]["decode_step_ms"] = 14.0  # the decode steps hold 69% of the gap now: both kinds slower, spread
    (p,), _ = summarize(rows)
    assert "run-to-run spread, not a decision" in p["cause"]
    rows[1].update(decode_step_ms=12.9, prefill_step_ms=62.0)  # one kind, but its steps barely slower (3%)
    (p,), _ = summarize(rows)
    assert "run-to-run spread, not a decision" in p["cause"]


def test_more_prefills_in_the_window_for_faster_decodes_are_named_as_such() -> None:
    """H100 run 71, b8 16K 56 GiB: tierplan ran 3.3 sequences a step against kv_tiering's 2.5, paid 6 prefill steps
    in its window against 4, and its decode steps made tokens faster: the window, not the split's speed."""
    rows = [_row("kv_tiering", 300.0, running=2.5, measured_steps=132, decode_steps=128, decode_step_ms=3.8,
                 prefill_step_ms=153.8),
            _row("tierplan", 243.0, running=3.3, measured_steps=134, decode_steps=128, decode_step_ms=4.35,
                 prefill_step_ms=212.1)]
    (p,), _ = summarize(rows)
    assert p["cause"].startswith("the window's prefills: its split admitted more sequences (3.3 vs 2.5 a step) and "
                                 "the window charged 6 prefill steps against 4 (212.1 vs 153.8 ms each), while its "
                                 "decode steps made tokens at 1.318 vs 1.520 ms each")
    rows[1]["decode_step_ms"] = 5.2  # its decodes slower per token too: not the window alone
    (p,), _ = summarize(rows)
    assert not p["cause"].startswith("the window's prefills")
    rows[1].update(decode_step_ms=4.35, measured_steps=132)  # as many prefills: not the window either
    (p,), _ = summarize(rows)
    assert not p["cause"].startswith("the window's prefills")


def test_the_static_target_compares_fixed_splits_and_reports_the_live_baselines_beside() -> None:
    # The 0.95x target names the best *static* baseline; the live ones (fluxmoe, mv_wsa re-plan every window)
    # compete for "best" and the 1.5x target, and the static target's figure says how tierplan fares against them.
    rows = [_row("mv_wsa", 200.0), _row("fluxmoe", 150.0), _row("resident", 100.0), _row("static_lfru", 90.0),
            _row("tierplan", 160.0)]
    per, targets = summarize(rows)
    assert (per[0]["best"], per[0]["vs_best"]) == ("mv_wsa", 0.8)
    assert (per[0]["best_static"], per[0]["vs_static"]) == ("resident", 1.6)
    met, fig = targets["tierplan >= 0.95x the best static baseline at every point"]
    assert met is True and fig.startswith("min 1.60x, 0 of 1 compared points below the best of resident, static_lru")
    assert "against every non-oracle baseline (live fluxmoe, mv_wsa too): min 0.80x, 1 of 1 below" in fig
    assert targets["tierplan >= 1.5x the best non-oracle baseline at >= 1 point"][0] is False
    assert "| resident | 1.60 |" in markdown(rows, "t", False, "cpu")
    # a static baseline ahead fails it; a point with only live baselines cannot pass it
    _, targets = summarize([*rows, _row("kv_tiering", 170.0)])
    assert targets["tierplan >= 0.95x the best static baseline at every point"][0] is False
    _, targets = summarize([_row("mv_wsa", 100.0), _row("tierplan", 160.0)])
    met, fig = targets["tierplan >= 0.95x the best static baseline at every point"]
    assert met is False and "1 point(s) with no static baseline that ran" in fig


def test_runs_that_moved_other_bytes_or_ran_other_steps_are_not_the_same_work() -> None:
    from tierplan.bench.phase_spread import same_work, spread

    base = _row("mv_wsa", 120.0, **_work())
    for change in ({"link_bytes": {"h2d": 1_020_000, "d2h": 0}}, {"expert_hit_rate": 0.91},
                   {"executor_steps": {"piecewise/experts_missing": 113, "eager/prefill": 7}},
                   {"kv_hits": {"gpu": 5000, "cpu": 100}}, {"measured_steps": 121}, {"preemptions": 1},
                   {"executor_steps": None}):
        other = _row("tierplan", 100.0, **_work(**change))
        assert not same_work(base, other), change
        (p,), _ = summarize([base, other])
        assert not p["cause"].startswith("same work"), change
    assert not same_work(base, _row("tierplan", 100.0, point="p2", **_work()))
    assert spread([base, _row("tierplan", 100.0, point="p2", **_work())]) is None
    assert "no two runs of one point did the same work" in markdown([base], "t", False, "cpu")


def test_the_cost_model_target_says_how_many_rows_were_priced_a_window_ahead() -> None:
    """Rows since session 39 price each telemetry window ahead (`predicted_ahead_steps`), older ones a whole run:
    where both are counted, the figure says how the window-ahead ones alone fared."""
    rows = [_row("resident", 100.0, predicted_over_measured=1.3), _row("tierplan", 160.0, predicted_ahead_steps=8),
            _row("resident", 100.0, point="p2", predicted_ahead_steps=8, predicted_over_measured=0.8)]
    met, fig = summarize(rows)[1]["cost model within 15% of the measured step at >= 90% of runs"]
    assert met is False and fig.startswith("1 of 3 runs (33%)")
    assert "priced a window ahead (the controller's horizon), 1 of 2, the rest a whole run ahead" in fig
    same = summarize([_row("resident", 100.0, predicted_ahead_steps=8)])[1]
    assert "window ahead" not in same["cost model within 15% of the measured step at >= 90% of runs"][1]
