"""Every PolicyKnobs field changes what the controller decides: the same telemetry stream (a light phase, then
bigger batches and KV demand) through the knob mapping of api/hub_config.py with the default knobs and with
one knob changed, each test naming the effect (plan_every_windows, which the hub's planner honours, is tested
through the service). calibrate=False keeps the cost model at its priors, so the plans are deterministic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from tests.api.service.conftest import Service, windows
from tierplan.api.bench_api import synthetic_window
from tierplan.api.demo_loop import tiny_registration
from tierplan.api.hub_config import controller_config, knobs_misfit
from tierplan.controller.loop import Controller, Decision, Outcome
from tierplan.controller.protocol import AckStatus, Footprint, Plan, PlanAck, Telemetry
from tierplan.controller.protocol_service import PolicyKnobs

SLOT_BYTES = 3 * 4096
NUM_WINDOWS = 16


@dataclass
class Run:
    ctl: Controller
    plans: list[Plan]
    decisions: list[Decision]

    def splits(self) -> list[tuple[tuple[int, ...], int]]:
        return [(tuple(b // SLOT_BYTES for b in p.expert_bytes_per_layer), p.kv_blocks_per_tier["gpu"])
                for p in self.plans]

    def issued(self) -> int:
        return sum(d.outcome is Outcome.ISSUED for d in self.decisions)


def knobs(**changed: Any) -> PolicyKnobs:
    """Every window planned unless a test says otherwise (`quiet_windows` 0): these tests read each knob's effect
    on the plans window by window; `test_quiet_windows_hold_a_held_split_without_planning` turns it on."""
    return PolicyKnobs.model_validate({"calibrate": False, "quiet_windows": 0, **changed})


def run(k: PolicyKnobs, max_running_seqs: int | None = None, start: tuple[tuple[int, int], int] | None = None
        ) -> Run:
    """Each plan is applied (acked) before the next window, as an agent would. `max_running_seqs`: the engine's
    cap on running sequences, if other than the demo's; `start`: the split the agent reports it started with
    (each MoE layer's slots, GPU KV blocks) until a plan applies."""
    reg = tiny_registration()
    if max_running_seqs is not None:
        reg = reg.model_copy(update={"split": reg.split.model_copy(update={"max_running_seqs": max_running_seqs})})
    ctl = Controller(controller_config(reg, k), "agent-0")
    rng = np.random.default_rng(1)
    applied, plans, decisions = 0, [], []
    for seq in range(NUM_WINDOWS):
        late = seq >= NUM_WINDOWS // 2
        tel = synthetic_window("agent-0", seq, rng, applied_plan_version=applied, batch_tokens=12 if late else 2,
                               kv_blocks=50 if late else 10, hot=seq // 4)
        if start is not None and applied == 0:
            tel = Telemetry.model_validate({**tel.model_dump(), "schema_version": 3, "kv_gpu_limit_blocks": start[1],
                                            "expert_slots": [{"layer": m, "slots": n} for m, n in enumerate(start[0])]})
        ctl.sync_from(tel)
        plan = ctl.step_next()
        decisions += ctl.pop_decisions()
        if plan is not None:
            plans.append(plan)
            fp = Footprint(expert_bytes_per_layer=plan.expert_bytes_per_layer,
                           kv_blocks_per_tier=plan.kv_blocks_per_tier, total_hbm_bytes=plan.hbm_budget_bytes)
            ctl.record_ack(PlanAck(agent_id="agent-0", rank=0, plan_id=plan.plan_id, version=plan.version,
                                   status=AckStatus.APPLIED, applied_s=tel.window_end_s, footprint=fp))
            applied = plan.version
    return Run(ctl, plans, decisions)


@pytest.fixture(scope="module")
def base() -> Run:
    return run(knobs())


def test_the_default_stream_re_splits_when_the_workload_changes(base: Run) -> None:
    assert base.issued() >= 2 and len(set(base.splits())) >= 2


def test_solver_milp_runs_the_highs_milp(monkeypatch: pytest.MonkeyPatch) -> None:
    import tierplan.controller.optimizer.milp as milp

    calls = []
    real = milp.solve_milp
    monkeypatch.setattr(milp, "solve_milp", lambda p: calls.append(1) or real(p))
    got = run(knobs(solver="milp"))
    assert calls and got.splits() == run(knobs()).splits()  # both exact: the same optimum, by another solver


def test_hysteresis_and_cooldown_hold_the_split(base: Run) -> None:
    assert run(knobs(hysteresis=0.9)).issued() < base.issued()
    assert run(knobs(hysteresis=0.0)).issued() > base.issued()
    assert run(knobs(cooldown_windows=20)).issued() < base.issued()


def test_horizon_steps_prices_migration(base: Run) -> None:
    assert run(knobs(horizon_steps=1)).splits() != base.splits()


def test_objective_weights_trade_experts_against_kv(base: Run) -> None:
    no_stall = run(knobs(stall_weight=0.0)).splits()[-1]
    no_kv = run(knobs(kv_weight=0.0)).splits()[-1]
    assert no_kv[1] == 16 and no_kv[1] < base.splits()[-1][1]  # KV at its floor
    assert sum(no_stall[0]) < sum(base.splits()[-1][0])  # experts give way to KV


def test_pin_frac_sets_how_many_hot_experts_are_pinned(base: Run) -> None:
    def pins(r: Run) -> int:
        return len(r.plans[0].pinned_experts)

    # Pins leave room for the union of the most sequences the engine runs (controller.loop): the demo's 16 route to
    # every expert of a layer, so it pins none; an engine of 2 sequences leaves room to pin.
    assert pins(base) == 0
    small = run(knobs(), max_running_seqs=2)
    assert pins(run(knobs(pin_frac=0.0), max_running_seqs=2)) == 0 < pins(run(knobs(pin_frac=0.25),
                                                                               max_running_seqs=2)) < pins(small)
    # Past half the slots the room pins leave for the layer's step union binds (controller.loop.num_pins).
    assert pins(run(knobs(pin_frac=1.0), max_running_seqs=2)) == pins(small)


def test_slot_floor_and_cap_bound_every_layer(base: Run) -> None:
    assert all(min(s) >= 6 for s, _ in run(knobs(min_slots_per_layer=6)).splits())
    assert all(max(s) <= 3 for s, _ in run(knobs(max_slots_per_layer=3)).splits())
    assert max(max(s) for s, _ in base.splits()) > 3 and min(min(s) for s, _ in base.splits()) < 6


def test_pinned_experts_are_always_pinned_with_room_for_them(base: Run) -> None:
    got = run(knobs(pinned_experts=[{"layer": 1, "expert": 7}, {"layer": 1, "expert": 6}]))
    for plan in got.plans:
        assert {(k.layer, k.expert) for k in plan.pinned_experts} >= {(1, 7), (1, 6)}
        assert plan.expert_bytes_per_layer[1] // SLOT_BYTES >= 2 + 2  # the pins plus one token's top-k
    # Without the knob they are not both pinned (the base run keeps layer 1 at its step union or more, valuation's
    # chunking price, so its slot count alone would not show the knob).
    assert any(not {(1, 7), (1, 6)} <= {(k.layer, k.expert) for k in plan.pinned_experts} for plan in base.plans)


def test_hbm_budget_bytes_shrinks_the_split(base: Run) -> None:
    got = run(knobs(hbm_budget_bytes=40 * 4096))
    assert all(p.hbm_budget_bytes == 40 * 4096 for p in got.plans) and got.splits() != base.splits()
    for plan in got.plans:
        assert sum(plan.expert_bytes_per_layer) + plan.kv_blocks_per_tier["gpu"] * 4096 <= 40 * 4096


def test_link_share_caps_what_a_plan_streams(base: Run) -> None:
    got = run(knobs(link_share=0.01))
    assert max(p.prefetch_budget_bytes_per_step for p in got.plans) < \
        max(p.prefetch_budget_bytes_per_step for p in base.plans)


def test_quiet_windows_hold_a_held_split_without_planning(base: Run) -> None:
    """With quiet windows on (the default knob), windows like the last planned go unplanned once the split held,
    so fewer decisions are made than windows seen; the plans still follow the workload's change half-way. A
    negative count is refused by name."""
    got = run(knobs(quiet_windows=3))
    assert got.ctl.windows_quiet > 0 and len(got.decisions) + got.ctl.windows_quiet == len(base.decisions)
    assert got.issued() >= 2 and base.ctl.windows_quiet == 0
    assert PolicyKnobs().quiet_windows == 3
    with pytest.raises(ValidationError, match="quiet_windows"):
        PolicyKnobs.model_validate({"quiet_windows": -1})


def test_local_table_knobs(base: Run) -> None:
    def table(r: Run) -> Any:
        return r.plans[-1].local_predictor

    assert max(len(row.next) for row in table(run(knobs(top_m=1))).rows) == 1 < max(
        len(row.next) for row in table(base).rows)
    assert sum(len(r.next) for r in table(run(knobs(min_prob=0.4))).rows) < sum(len(r.next) for r in table(base).rows)
    assert table(run(knobs(min_score=0.9))).min_score == 0.9 != table(base).min_score


def test_predictor_picks_the_curve_source(base: Run) -> None:
    got = run(knobs(predictor="frequency"))
    assert all("curves: activation frequencies" in d.reason for d in got.decisions)
    assert any("measured LRU curves" in d.reason for d in base.decisions)
    assert got.splits() != base.splits()


def test_a_shadow_is_scored_and_only_promoted_with_auto_promote(base: Run) -> None:
    report = run(knobs(predictor="frequency", shadow_predictor="miss_ratio"))
    assert report.ctl.shadow is not None and report.ctl.shadow.history and not report.ctl.shadow.promotions
    assert "shadow miss_ratio vs active frequency" in report.decisions[-1].reason
    assert report.splits() == run(knobs(predictor="frequency")).splits()  # report only: same plans
    promote = run(knobs(predictor="frequency", shadow_predictor="miss_ratio", auto_promote=True))
    assert promote.ctl.shadow.promotions and promote.ctl.predictor.value == "miss_ratio"
    assert promote.splits() != report.splits()


def test_calibrate_fits_the_cost_model_to_the_windows(base: Run) -> None:
    got = run(knobs(calibrate=True))
    assert got.ctl.cost.compute != base.ctl.cost.compute
    assert [round(d.step_ms, 6) for d in got.decisions] != [round(d.step_ms, 6) for d in base.decisions]


def test_batch_coupling_values_each_kv_share_at_its_batch(base: Run) -> None:
    separable = run(knobs(batch_coupling=False))
    assert [round(d.step_ms, 6) for d in separable.decisions] != [round(d.step_ms, 6) for d in base.decisions]
    assert any("tokens/step; " in p.reason for p in base.plans)  # the batch each share runs, in words
    assert not any("tokens/step; " in p.reason for p in separable.plans)


LOPSIDED = ((8, 2), 34)  # a start the solve would even out: 8 and 2 slots, the rest of the 64 units KV


def test_weigh_start_weighs_the_first_plan_against_the_reported_start() -> None:
    weighed, forced = run(knobs(), start=LOPSIDED), run(knobs(weigh_start=False), start=LOPSIDED)
    assert forced.decisions[0].outcome is Outcome.ISSUED and "first split" in forced.decisions[0].reason
    assert "first split" not in weighed.decisions[0].reason  # its factors read against the start's split


def test_hold_slots_while_filling_keeps_the_start_while_the_batch_first_fills() -> None:
    held, free = run(knobs(), start=LOPSIDED), run(knobs(hold_slots_while_filling=False), start=LOPSIDED)
    assert "while the batch first fills" in held.decisions[0].reason and held.decisions[0].split.slots == (8, 2)
    assert free.decisions[0].outcome is Outcome.ISSUED and min(free.decisions[0].split.slots) > 2


def test_knobs_an_agent_cannot_run_with_are_named() -> None:
    reg = tiny_registration()
    assert "pinned_experts.0" in knobs_misfit(reg, knobs(pinned_experts=[{"layer": 0, "expert": 8}]))
    assert "hbm_budget_bytes" in knobs_misfit(reg, knobs(hbm_budget_bytes=10**9))
    assert "min_slots_per_layer" in knobs_misfit(reg, knobs(min_slots_per_layer=8, hbm_budget_bytes=60 * 4096))
    assert knobs_misfit(reg, knobs()) is None


def test_plan_every_windows_spaces_the_planner_out(svc: Service) -> None:
    from tests.api.service.conftest import AUTH
    from tierplan.controller.protocol_service import PolicyUpdate

    update = PolicyUpdate(knobs=knobs(plan_every_windows=3), why="plan less often")
    assert svc.client.put("/v1/policies/default", content=update.model_dump_json(), headers=AUTH).status_code == 200
    svc.register()
    svc.send(windows("agent-0", 0, 2))
    assert svc.hub.plan_once() == 0
    svc.send(windows("agent-0", 2, 1))
    assert svc.hub.plan_once() == 1


@pytest.mark.parametrize(("threshold", "withheld"), [(0.5, True), (0.2, False)])
def test_min_prefetch_precision_withholds_the_table_below_it(threshold: float, withheld: bool) -> None:
    """The knob reaches the controller through the hub's mapping: 3 of 10 prefetches used withholds the table
    at 0.5 and keeps it at 0.2."""
    from tierplan.controller.protocol import PrefetchCounts

    counts = PrefetchCounts(table_version=1, issued=10, useful=3, wasted=7, skipped_resident=0, skipped_budget=0,
                            skipped_no_slot=0, failed=0)
    ctl = Controller(controller_config(tiny_registration(), knobs(min_prefetch_precision=threshold)), "agent-0")
    rng = np.random.default_rng(1)
    for seq in range(4):
        tel = synthetic_window("agent-0", seq, rng, batch_tokens=8)
        ctl.sync_from(tel.model_copy(update={"local_prefetch": counts}))
    plan = ctl.step_next()
    assert plan is not None
    assert (plan.local_predictor is None) is withheld
    assert ("prefetch table withheld" in plan.reason) is withheld


def test_the_registrations_compute_prior_reaches_every_cost_model_term() -> None:
    """Every term of the cost model's compute prior can be registered (a term the sheet lacked, the chunked step,
    started every controller at 0 whatever the engine knew), and each reaches the controller as given."""
    import dataclasses

    from tierplan.controller.costmodel import ComputeParams
    from tierplan.controller.protocol_service import ComputeSheet

    assert set(ComputeSheet.model_fields) == {f.name for f in dataclasses.fields(ComputeParams)}
    given = {name: 0.5 + i for i, name in enumerate(ComputeSheet.model_fields)}
    reg = tiny_registration().model_copy(update={"compute": ComputeSheet(**given)})
    assert dataclasses.asdict(controller_config(reg, PolicyKnobs()).compute) == given
