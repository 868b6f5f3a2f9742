"""The phase runner's run-level rules: the feasibility floor every policy shares, retrying failed runs, the
oracle's search resuming from its saved candidates, the prediction of a static split, the H200 sizes."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from tierplan.api.cli import app
from tierplan.bench.phase_grid import FULL, GIB, QUICK, Point, point_requests, points
from tierplan.runtime.errors import ConfigError


def _run(*args: str) -> Any:
    return CliRunner().invoke(app, ["bench", "phase", "--quick", *args])


def _rows(out: Path) -> list[dict[str, Any]]:
    return json.loads(next(out.glob("phase_tiny_*.json")).read_text())


def test_a_point_below_what_every_policy_needs_is_refused_by_the_shared_rule() -> None:
    from tierplan.bench.phase_run import open_model, point_context
    from tierplan.runtime.device import Device

    h = open_model("tiny", 2, 2, Device("cpu"), lambda *_: None)
    try:
        p = Point("tiny", 2, 2, 4, 32, 0.0, None)
        reqs, _ = point_requests(p, QUICK)
        largest = max(-(-(r.prompt_len + r.output_len) // h.block_tokens) for r in reqs)
        slots = h.spec.top_k * len(h.spec.moe_layers) * h.stride_bytes
        # The old floor (top_k slots and ONE KV block) passes here; the policies' rule needs the largest request.
        def at(budget: int) -> Point:  # the budget a policy sees, the workspace (dense weights here) on top
            return dataclasses.replace(p, budget_label_gib=(budget + h.dense_bytes + 0.5) / GIB)

        for budget in (slots + h.kv_block_bytes, slots + largest * h.kv_block_bytes):
            with pytest.raises(ConfigError, match=r"infeasible: .* plus the largest request's \d+ KV blocks"):
                point_context(h, at(budget), QUICK)
        ctx, _ = point_context(h, at(slots + (largest + 1) * h.kv_block_bytes), QUICK)
        assert ctx.hbm_budget_bytes == slots + (largest + 1) * h.kv_block_bytes
    finally:
        h.close()


def test_error_rows_run_again_on_a_rerun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tierplan.bench.phase as phase

    real = phase.make

    def broken(name: str) -> Any:
        raise MemoryError("out of memory, once")

    args = ("--points", "b1c32f0.7", "--policies", "resident", "--out-dir", str(tmp_path))
    monkeypatch.setattr(phase, "make", broken)
    assert _run(*args).exit_code == 0
    monkeypatch.setattr(phase, "make", real)
    assert _run(*args).exit_code == 0
    assert [r["status"] for r in _rows(tmp_path)] == ["error", "ok"]
    assert _run(*args).exit_code == 0
    assert len(_rows(tmp_path)) == 2  # the ok row is a result: not run a third time
    assert _run(*args, "--fresh").exit_code == 0  # measured again; the rows already there stay
    assert [r["status"] for r in _rows(tmp_path)] == ["error", "ok", "ok"]
    md = next(tmp_path.glob("phase_tiny_*.md")).read_text()
    assert "| resident | ok |" in md and "| resident | error |" not in md


def test_the_oracle_resumes_its_search_from_the_candidates_it_saved(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import tierplan.bench.phase as phase

    real, calls = phase.measure, []

    def measure(h: Any, ctx: Any, policy: Any, *a: Any, **kw: Any) -> Any:
        if policy.name == "oracle":
            calls.append(ctx.split)
            if len(calls) == 2 and fail["on"]:
                raise RuntimeError("the call's time ran out")
        return real(h, ctx, policy, *a, **kw)

    fail = {"on": True}
    monkeypatch.setattr(phase, "measure", measure)
    args = ("--points", "b4c32f0.7", "--policies", "oracle", "--out-dir", str(tmp_path))
    assert _run(*args).exit_code == 0
    rows = _rows(tmp_path)
    assert [r["status"] for r in rows] == ["candidate", "error"]
    first = calls[0]
    fail["on"], calls[:] = False, []
    assert _run(*args).exit_code == 0
    assert first not in calls and len(calls) == QUICK.oracle_max_splits - 1  # the saved candidate is not rerun
    rows = _rows(tmp_path)
    assert [r["status"] for r in rows] == ["candidate", "error", "candidate", "candidate", "ok"]
    assert "(saved)" in rows[-1]["notes"] and rows[-1]["oracle_split"] in rows[-1]["notes"]


def _predictor(routes: bool = True) -> Any:
    """The phase rows' Predictor for a 2-layer model of 8 experts (top-2), with a random routing table or none."""
    from tierplan.bench.phase_predictor import Predictor

    h = type("H", (), {})()
    h.spec = type("S", (), {"name": "t", "num_layers": 2, "moe_layers": (0, 1), "num_experts": 8, "top_k": 2})()
    h.stride_bytes, h.kv_block_bytes, h.block_tokens, h.link_bytes_per_s = 4096, 1024, 16, 1e9
    h.dev = type("D", (), {"torch_device": "cpu"})()
    h.router = (type("R", (), {"ids_host": np.random.default_rng(0).integers(0, 8, (512, 2, 2))})() if routes
                else None)
    return Predictor.for_model(h)


def test_a_static_split_is_predicted_from_the_replayed_residency_not_the_measured_misses() -> None:
    from tierplan.bench.phase_run import StepRecord

    pred = _predictor()

    def step(misses: int) -> StepRecord:
        return StepRecord(step_s=0.01, cycle_s=0.01, num_prefills=0, num_decodes=4, tokens_out=4, batch_tokens=4,
                          context_tokens=64, expert_hits=0, expert_misses=misses, expert_stall_ms=0.0,
                          kv_stall_ms=0.0, kv_gpu_hits=0, kv_fetch={}, link_bytes={})

    few, many = [step(0)] * 4, [step(64)] * 4
    assert pred.split_step_ms(few, (4, 4)) == pred.split_step_ms(many, (4, 4))
    assert pred.step_ms(few) < pred.step_ms(many)
    # Fewer slots: the residency misses more, so a longer step; every expert resident: no miss at all.
    assert pred.split_step_ms(few, (2, 2)) > pred.split_step_ms(few, (4, 4)) > pred.split_step_ms(few, (8, 8))
    assert all(load.misses == (0, 0) for load in pred.loads_at(few, [(8, 8)] * 4))
    assert sum(sum(load.misses) for load in pred.loads_at(few, [(2, 2)] * 4)) > 0


def test_the_predictor_learns_a_step_time_from_the_measured_steps() -> None:
    """Steps whose cycle is 2 ms + 0.05 ms a token, plus 1 ms per expert loaded on demand (its stall), each with 4
    distinct experts: folded in step by step, the cost model prices new steps within 2 %, each at its measured
    distinct experts (fitted on them, priced on them); before, its priors miss them by far."""
    from tierplan.bench.phase_run import StepRecord

    pred = _predictor(routes=False)
    rng = np.random.default_rng(0)

    def step(tokens: int, misses: int) -> StepRecord:
        stall = 1.0 * misses
        return StepRecord(step_s=0.0, cycle_s=(2.0 + 0.05 * tokens + stall) / 1e3, num_prefills=int(tokens > 8),
                          num_decodes=1, tokens_out=1, batch_tokens=tokens, context_tokens=64,
                          expert_hits=4 - min(4, misses), expert_misses=misses, expert_stall_ms=stall,
                          kv_stall_ms=0.0, kv_gpu_hits=0, kv_fetch={}, link_bytes={})

    held_out = [step(4, 0), step(200, 0), step(4, 3), step(64, 1)]
    truth = [s.cycle_s * 1e3 for s in held_out]
    before = pred.step_prices(held_out)
    assert max(abs(p / t - 1) for p, t in zip(before, truth, strict=True)) > 0.5
    pred.calibrate([step(int(rng.choice([1, 4, 16, 128, 256])), int(rng.integers(0, 4))) for _ in range(600)])
    after = pred.step_prices(held_out)
    assert max(abs(p / t - 1) for p, t in zip(after, truth, strict=True)) < 0.02, (after, truth)


def test_a_prefills_steps_and_the_decode_steps_are_priced_by_fits_of_their_own() -> None:
    """Decode steps of 3 ms whatever their batch (a graph replay's fixed cost) beside prefill steps of 0.2 ms a
    token: each kind is priced by its own fit, so a small decode step keeps its fixed cost; one fit over both (the
    predictor before session 38) prices it at half or less."""
    from tierplan.bench.phase_run import StepRecord

    def step(tokens: int, prefill: bool) -> StepRecord:
        ms = 0.2 * tokens if prefill else 3.0
        return StepRecord(step_s=0.0, cycle_s=ms / 1e3, num_prefills=int(prefill), num_decodes=tokens,
                          tokens_out=tokens, batch_tokens=tokens, context_tokens=64 * tokens, expert_hits=4,
                          expert_misses=0, expert_stall_ms=0.0, kv_stall_ms=0.0, kv_gpu_hits=0, kv_fetch={},
                          link_bytes={})

    rng = np.random.default_rng(0)
    seen = [step(int(rng.choice([512, 1024, 2048])), True) if i % 4 == 0 else step(int(rng.choice([16, 32, 64])),
                                                                                      False) for i in range(400)]
    two, one = _predictor(routes=False), _predictor(routes=False)
    one.prefill = None  # `cost` learns and prices every step
    for pred in (two, one):
        pred.calibrate(seen)
    small, long = step(1, False), step(1024, True)
    assert two.model_for(small) is two.cost and two.model_for(long) is two.prefill
    got = two.step_prices([small, long])
    assert abs(got[0] / 3.0 - 1) < 0.05 and abs(got[1] / 204.8 - 1) < 0.05, got
    assert one.step_prices([small])[0] < 1.5


def test_each_step_is_predicted_at_the_split_of_the_plan_it_ran_under() -> None:
    """A live policy's steps are priced at the split in force at each (the plan version the step ran under),
    by the rule a static split's are; the controller's own figure is kept apart."""
    from tierplan.bench.phase_metrics import controller_step_ms
    from tierplan.bench.phase_predictor import plan_step_prices, predict_at_plans
    from tierplan.bench.phase_run import StepRecord

    pred = _predictor()

    def plan(slots: int) -> object:
        return type("P", (), {"expert_bytes_per_layer": (slots * 4096, slots * 4096)})()

    def step(version: int) -> StepRecord:
        return StepRecord(step_s=0.01, cycle_s=0.01, num_prefills=0, num_decodes=4, tokens_out=4, batch_tokens=4,
                          context_tokens=64, expert_hits=0, expert_misses=0, expert_stall_ms=0.0,
                          kv_stall_ms=0.0, kv_gpu_hits=0, kv_fetch={}, link_bytes={}, plan_version=version)

    def outcome(versions: list[int], decisions: list[tuple[int, float]]) -> object:
        o = type("O", (), {})()
        o.initial_plan, o.window_steps = plan(2), 4
        o.extra = {"plans_applied": {1: plan(2), 2: plan(8)}, "decisions": decisions}
        return o, [step(v) for v in versions]

    def predict(pred: object, o: object, steps: list[StepRecord]) -> tuple[float, str]:
        return predict_at_plans(pred, o.extra["plans_applied"], o.initial_plan, steps)

    o, steps = outcome([1, 1, 2, 2], [(1, 99.0)])
    prices, _ = plan_step_prices(pred, o.extra["plans_applied"], o.initial_plan, steps)
    high = pred.split_step_ms(steps[2:], (8, 8))  # every expert resident: no miss
    assert prices[2] == prices[3] == pytest.approx(high) and min(prices[:2]) > high
    ms, source = predict(pred, o, steps)
    assert ms == pytest.approx(sum(prices) / 4) and "2 plans" in source
    o, steps = outcome([1, 1, 1, 1], [])  # a static split: one plan throughout
    assert predict(pred, o, steps)[0] == pytest.approx(pred.split_step_ms(steps, (2, 2)))
    o, steps = outcome([0, 0], [])  # a version the run never applied: the initial plan's split
    assert predict(pred, o, steps)[0] == pytest.approx(pred.split_step_ms(steps, (2, 2)))
    # The controller's figure: its decision's step_ms from the step the decision took effect (window 1 x 4).
    assert controller_step_ms(*outcome([1] * 8, [(1, 99.0)])[:1], warm=2, num_timed=6) == 99.0
    assert controller_step_ms(*outcome([1] * 8, [])[:1], warm=2, num_timed=6) is None


def test_h200_sizes_measure_at_least_100_steps_at_every_point() -> None:
    # Whatever the concurrency, a run takes at least as many steps as its longest request has output tokens,
    # and at least its output tokens over the batch (one token per running sequence a step).
    for p in points(FULL):
        reqs, _ = point_requests(p, FULL)
        least = max(max(r.output_len for r in reqs), sum(r.output_len for r in reqs) / p.batch)
        assert least >= FULL.warm_steps + 100, p.key
    assert FULL.stop_decode_steps is None or FULL.stop_decode_steps >= 100  # a stop leaves 100 decode steps


def test_a_run_stops_once_enough_measured_steps_had_no_prefill() -> None:
    from tierplan.bench.phase_grid import RunStop

    stop = RunStop(warm_steps=2, decode_steps=3)
    seen = []
    for prefills in (0, 0, 1, 0, 2, 0, 0, 0):  # the warm-up's decodes and the steps with a prefill do not count
        seen.append(stop.reached)
        stop.after_step(prefills)
    assert seen == [False] * 7 + [True] and stop.measured_decodes == 4
    never = RunStop(warm_steps=0, decode_steps=None)
    for _ in range(1000):
        never.after_step(0)
    assert not never.reached


def test_the_dense_weights_are_drawn_once_per_model_and_lent_to_every_run(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Each engine drawing its own synthetic dense weights took seconds a run on the H200's host: the model's
    handle draws them once, and every run's engine (the oracle's candidates too) borrows them."""
    import tierplan.bench.phase_run as pr
    import tierplan.runtime.engine.weights as weights

    draws: list[str] = []
    real = weights.synthetic_dense_weights

    def counted(spec: Any, device: Any, seed: int = 0) -> Any:
        if device.type != "meta":  # the meta ones only check a lent set's shapes
            draws.append(spec.name)
        return real(spec, device, seed=seed)

    monkeypatch.setattr(weights, "synthetic_dense_weights", counted)
    monkeypatch.setattr(pr, "synthetic_dense_weights", counted)
    r = _run("--points", "b4c32f1.0", "--policies", "resident,tierplan,oracle", "--out-dir", str(tmp_path))
    assert r.exit_code == 0, r.output
    assert len({row["policy"] for row in _rows(tmp_path)}) == 3
    assert draws == ["tiny"]


def test_the_compute_prior_reads_an_active_expert_at_the_measured_memory_bandwidth() -> None:
    """Calibration cannot move the per-active-expert term where every step has about the same active experts: its
    prior is the expert's bytes at the bandwidth `open_model` measured, for the live controllers (a fixed 0.05 ms
    where none was measured) and the static rows' predictor alike."""
    from tierplan.bench.baselines.tierplan_live import active_expert_prior_ms
    from tierplan.bench.phase_run import open_model, point_context
    from tierplan.runtime.device import Device

    h = open_model("tiny", 2, 2, Device("cpu"), lambda *_: None)
    try:
        assert h.memory_bytes_per_s > 0
        ctx, _ = point_context(h, Point("tiny", 2, 2, 4, 32, 0.0, 1.0), QUICK)
        assert ctx.memory_bytes_per_s == h.memory_bytes_per_s
        assert active_expert_prior_ms(ctx) == pytest.approx(h.stride_bytes / h.memory_bytes_per_s * 1e3)
        assert active_expert_prior_ms(dataclasses.replace(ctx, memory_bytes_per_s=0.0)) == 0.05
        # The static rows' predictor starts from the same prior.
        from tierplan.bench.phase_predictor import Predictor

        prior = Predictor.for_model(h).cost.compute.moe_ms_per_active_expert
        assert prior == pytest.approx(active_expert_prior_ms(ctx))
    finally:
        h.close()


def test_each_step_carries_the_collector_pauses_of_its_cycle(tmp_path: Path) -> None:
    """A collection forced in every other step's hook shows up in those steps' records and in the row's gc_ms
    (a gap between two runs that did the same work may be the collector's: the row says how much was)."""
    import gc

    from tierplan.bench.baselines import make
    from tierplan.bench.phase_metrics import timing
    from tierplan.bench.phase_run import measure, open_model, point_context
    from tierplan.runtime.device import Device

    h = open_model("tiny", 2, 2, Device("cpu"), lambda *_: None)
    try:
        ctx, prefix = point_context(h, Point("tiny", 2, 2, 4, 32, 0.0, 1.0), QUICK)
        policy, seen = make("resident"), {"n": 0}
        start = policy.start

        def collect_every_other_step(b: Any, s: float) -> None:
            seen["n"] += 1
            if seen["n"] % 2 == 0:
                gc.collect()

        def start_collecting(eng: Any, c: Any) -> Any:
            run = start(eng, c)
            run.on_step = collect_every_other_step
            return run

        policy.start = start_collecting  # type: ignore[method-assign]
        out = measure(h, ctx, policy, QUICK, tmp_path, prefix)
    finally:
        h.close()
    # Step i's hook runs after its cycle ended: the pauses of hooks 2, 4, ... (steps 1, 3, ...) fall in the cycles
    # of steps 2, 4, ..., as their wall time does.
    assert len(out.steps) >= 6
    assert all(s.gc_ms > 0 for s in out.steps[2::2])
    assert sum(s.gc_ms for s in out.steps[2::2]) > 3 * sum(s.gc_ms for s in out.steps[1::2])
    assert timing(out.steps)["gc_ms"] == pytest.approx(sum(s.gc_ms for s in out.steps))
    assert not [c for c in gc.callbacks if "GcWatch" in repr(c)]  # the watch let go of the collector


def test_each_step_records_the_plan_it_ran_under(tmp_path: Path) -> None:
    """The runner tags each step with the plan version in force when it ran (a plan applied at a window's end
    is the next step's), and keeps every applied plan by version: what the prediction prices a step at."""
    from tierplan.bench.baselines import make
    from tierplan.bench.phase_run import measure, open_model, point_context
    from tierplan.runtime.device import Device

    class Again:  # a plan source that re-issues the starting split once, as version 2
        def __init__(self, plan: Any) -> None:
            self.plan, self.sent = plan, False
            self.host_spans = [(0.0, 1e12)]  # a source busy all along: every step's whole cycle
            self.solve_spans = [(0.0, 1e9, 2e9)]  # and a planner on two cores all along

        def sync_from(self, telemetry: Any) -> None:
            return None

        def step_next(self) -> Any:
            if self.sent:
                return None
            self.sent = True
            return self.plan.model_copy(update={"version": 2, "base_version": 1, "plan_id": "again-2"})

        def record_ack(self, ack: Any) -> None:
            return None

    h = open_model("tiny", 2, 2, Device("cpu"), lambda *_: None)
    try:
        ctx, prefix = point_context(h, Point("tiny", 2, 2, 4, 32, 0.0, 1.0), QUICK)
        policy = make("resident")
        start = policy.start

        def start_with_source(eng: Any, c: Any) -> Any:
            run = start(eng, c)
            return dataclasses.replace(run, source=Again(run.initial_plan), window_steps=2)

        policy.start = start_with_source  # type: ignore[method-assign]
        out = measure(h, ctx, policy, QUICK, tmp_path, prefix)
    finally:
        h.close()
    versions = [s.plan_version for s in out.steps]
    assert versions[:2] == [1, 1] and versions[-1] == 2 and versions == sorted(versions), versions
    assert all(s.outbox_ms >= s.cycle_s * 1e3 * 0.999 for s in out.steps)  # the source's spans reach the steps
    assert all(s.planner_ms >= s.cycle_s * 1e3 * 0.999 for s in out.steps)
    assert all(s.planner_cpu_ms == pytest.approx(2 * s.planner_ms) for s in out.steps)
    first = versions.index(2)
    assert first % 2 == 0  # from a window's first step
    assert sorted(out.extra["plans_applied"]) == [1, 2]


def test_timing_reports_the_median_and_slowest_decode_cycle() -> None:
    from tierplan.bench.phase_metrics import timing
    from tierplan.bench.phase_run import StepRecord

    def step(cycle_s: float, prefills: int = 0, gc_ms: float = 0.0) -> StepRecord:
        return StepRecord(step_s=cycle_s, cycle_s=cycle_s, num_prefills=prefills, num_decodes=2, tokens_out=2,
                          batch_tokens=2, context_tokens=8, expert_hits=0, expert_misses=0, expert_stall_ms=0.0,
                          kv_stall_ms=0.0, kv_gpu_hits=0, kv_fetch={}, link_bytes={}, gc_ms=gc_ms)

    t = timing([step(0.010), step(0.012), step(0.050, gc_ms=30.0), step(0.200, prefills=1)])
    assert t["decode_step_ms_p50"] == pytest.approx(12.0) and t["decode_step_ms_max"] == pytest.approx(50.0)
    assert t["gc_ms"] == 30.0
    assert timing([step(0.2, prefills=1)])["decode_step_ms_p50"] is None


def test_steady_throughput_charges_a_window_for_the_prompt_tokens_its_output_implies() -> None:
    """A run stopped early under a small KV share outputs tokens whose prefills fell before its window (or never
    ran): `steady_tok_s` charges the point's mean prompt for each request they imply, at the run's own cost a
    prompt token; a window that holds its prefills keeps its tok/s, and two windows that prefilled different
    prompts for the same output are charged the same prompt tokens."""
    from types import SimpleNamespace

    from tierplan.bench.phase_metrics import prefill_ms_per_token, steady_tok_s

    def step(cycle_s: float, prefills: int, decodes: int, prompt: int = 0) -> SimpleNamespace:
        return SimpleNamespace(cycle_s=cycle_s, num_prefills=prefills, num_decodes=decodes,
                               tokens_out=prefills + decodes, batch_tokens=prompt + decodes)

    # 5 ms a sequence decoding; a 100-token prompt costs 40 ms beside two decodes (0.4 ms a prompt token).
    dec, pre = step(0.010, 0, 2), step(0.050, 1, 2, prompt=100)
    assert prefill_ms_per_token([dec, pre, dec]) == pytest.approx(0.4)
    assert prefill_ms_per_token([dec, dec]) == 0.0
    # Ten decode steps: 20 tokens, 4 requests' worth at 5 tokens a request, none of their prompts in the window.
    warm, window = [pre] * 4, [dec] * 10
    assert steady_tok_s(warm + window, window, 5.0, 100.0) == pytest.approx(20 / (0.1 + 400 * 0.0004))
    # Four prefills and four decode steps: 12 + 8 = 20 tokens, the window computed the 400 prompt tokens implied.
    window = [pre] * 4 + [dec] * 4
    assert steady_tok_s(window, window, 5.0, 100.0) == pytest.approx(20 / 0.24)
    # The same output, one window holding a 300-token prompt (120 ms), the other a 100-token one: both are charged
    # the 400 prompt tokens their 4 requests imply, so the long prompt the first happened to hold costs it nothing.
    long = step(0.130, 1, 2, prompt=300)
    a, b = [long] + [dec] * 8, [pre] + [dec] * 8
    assert steady_tok_s(a, a, 5.0, 100.0) == pytest.approx(steady_tok_s(b, b, 5.0, 100.0))
    assert sum(s.tokens_out for s in a) / sum(s.cycle_s for s in a) < 0.7 * sum(s.tokens_out for s in b) / sum(
        s.cycle_s for s in b)
    assert steady_tok_s(window, [], 5.0, 100.0) is None and steady_tok_s(window, window, 0.0, 100.0) is None
    assert steady_tok_s(window, window, 5.0, 0.0) is None


def test_the_replayed_misses_a_step_shows_issued_ahead_are_priced_as_streamed() -> None:
    """A step whose loads were half prefetched prices half the replayed misses as streamed loads (the part behind
    a layer's compute free), so below the same step with none; a step with no prefetch prices as before."""
    from tierplan.bench.phase_run import StepRecord

    pred = _predictor()

    def step(misses: int, ahead: int) -> StepRecord:
        return StepRecord(step_s=0.01, cycle_s=0.01, num_prefills=0, num_decodes=4, tokens_out=4, batch_tokens=4,
                          context_tokens=64, expert_hits=ahead, expert_misses=misses, expert_stall_ms=0.0,
                          kv_stall_ms=0.0, kv_gpu_hits=0, kv_fetch={}, link_bytes={}, expert_prefetch_hits=ahead)

    pred.calibrate([step(0, 0)] * 8)  # 10 ms of compute a step: what a streamed load can hide behind
    demand = pred.split_step_ms([step(4, 0)], (2, 2))
    assert pred.split_step_ms([step(9, 0)], (2, 2)) == demand  # the replayed misses, not the measured ones
    half, most = pred.split_step_ms([step(4, 4)], (2, 2)), pred.split_step_ms([step(1, 7)], (2, 2))
    assert most <= half < demand  # a streamed share behind the compute is free, whatever its size
    assert pred.split_step_ms([step(0, 0)], (8, 8)) == pred.split_step_ms([step(0, 5)], (8, 8))  # nothing missed


def test_each_step_counts_the_loads_its_layers_found_issued_ahead() -> None:
    """The recorder takes each step's prefetch hits from the engine's counter, as it takes its hits."""
    from types import SimpleNamespace as NS

    from tierplan.bench.phase_run import _Recorder

    experts = NS(hits=0, prefetch_hits=0, misses=0, stalls_ms=0.0)
    eng = NS(experts=experts, cache=NS(fetch_s=0.0, gpu_hits=0, misses_by_tier={}),
             transfer=NS(stats=lambda: {"links": {}}), executors=NS(runs={}),
             graphs=NS(take_gpu_ms=iter([2.0, None, 3.5, None]).__next__,  # cleared at start, then a step each
                       capture_s=0.5))  # captured before the run: none of its steps' time
    rec = _Recorder(eng)  # type: ignore[arg-type]
    batch = NS(prefills=[], decodes=[NS(num_tokens=2)])
    for hits, ahead, captured_s in ((5, 2, 0.5), (9, 2, 0.56), (12, 6, 0.56)):
        experts.hits, experts.prefetch_hits, eng.graphs.capture_s = hits, ahead, captured_s
        rec.after_step(batch, 0.01, 0.01, 0.0)  # type: ignore[arg-type]
    assert [(s.expert_hits, s.expert_prefetch_hits) for s in rec.steps] == [(5, 2), (4, 0), (3, 4)]
    assert [s.graph_gpu_ms for s in rec.steps] == [None, 3.5, None]
    assert [round(s.capture_ms, 6) for s in rec.steps] == [0.0, 60.0, 0.0]  # the step that captured a bucket


def test_the_runs_clocks_leave_out_graph_captures() -> None:
    """A server captures its buckets at start-up: a run's clock stands still while the engine captures."""
    from types import SimpleNamespace as NS

    from tierplan.bench.phase_run import server_clock

    eng = NS(graphs=NS(capture_s=0.0))
    clock = server_clock(eng)  # type: ignore[arg-type]
    t0 = clock()
    eng.graphs.capture_s = 100.0  # 100 s of captures since t0
    assert clock() - t0 < -99.0
    assert server_clock(NS(graphs=None))() == pytest.approx(time.perf_counter(), abs=1.0)  # type: ignore[arg-type]


def test_a_steps_outbox_time_is_the_union_of_the_spans_over_its_cycle() -> None:
    """Spans of the outbox's builds and a planner's messages, overlapping or not, are counted once per cycle."""
    from tierplan.bench.phase_run import overlap_ms

    cycles = [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]
    spans = [(0.5, 1.5), (1.2, 1.4), (2.9, 4.0), (-1.0, 0.1)]
    assert overlap_ms(cycles, spans) == pytest.approx([600.0, 500.0, 100.0])
    assert overlap_ms(cycles, []) == [0.0, 0.0, 0.0]


def test_a_planners_cpu_time_is_spread_over_its_call_and_split_between_cycles() -> None:
    from tierplan.bench.phase_run import cpu_overlap_ms

    cycles = [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]
    spans = [(0.5, 1.5, 2.0), (2.5, 2.5, 1.0)]  # 2 CPU s over 1 s of wall (two cores); a call of no wall: nothing
    assert cpu_overlap_ms(cycles, spans) == pytest.approx([1000.0, 1000.0, 0.0])
