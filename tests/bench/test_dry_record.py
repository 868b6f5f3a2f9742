"""The oracle's dry record (bench/baselines/dry_record.py) against the engine's: the quick sweep's tiny model and
points (the bench's own grid and point builder), every candidate split of each, some preempting and some not.
The replay equals the engine recording step for step and layer for layer, the oracle run on it follows it with
no diverged step, the KV split really changes the stream (the equality is not vacuous), and the phase runner
spends no engine run on a recording unless asked to (then its notes check the replay)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tierplan.bench.baselines import make, oracle_splits
from tierplan.bench.baselines.base import ExpertFuture, Split
from tierplan.bench.baselines.dry_record import difference, dry_record
from tierplan.bench.baselines.oracle import RecordingPass
from tierplan.bench.oracle_estimate import DryStep
from tierplan.bench.phase_grid import QUICK, RunStop, points, select_points
from tierplan.bench.phase_run import ModelHandle, engine_config, measure, open_model, point_context
from tierplan.runtime.device import Device
from tierplan.runtime.errors import ConfigError

# Batch 1/4/12, contexts 32/128, budgets from "KV must give" (0.4: preemptions at every batch > 1) to "it all fits".
POINTS = "b1c32f0.4,b4c32f0.4,b12c32f0.4,b4c128f0.4,b12c128f0.7,b1c128f1,b12c32f1"
# The grid's requests all arrive within a few steps; these points' come in waves of three instead, after quiet
# gaps the runner's clock jumps over exactly to the next arrival, the wave's others half a tick apart (a clock
# that stepped over the gap by ticks would admit two of them in one step).
GAPS = ("b4c32f0.4", "b12c128f0.7")


def _with_gaps(ctx: Any) -> Any:
    reqs = [dataclasses.replace(r, arrival_s=(i // 3) * 0.7013 + (i % 3) * QUICK.virtual_step_s / 2)
            for i, r in enumerate(ctx.requests)]
    return dataclasses.replace(ctx, requests=tuple(reqs))


@dataclasses.dataclass
class Case:
    point: str
    ctx: Any
    split: Split
    dry: ExpertFuture
    engine: ExpertFuture
    preemptions: int
    oracle_steps: int
    diverged_steps: int | None
    prefills: tuple[int, ...]  # prefills in each step of the engine's recording run
    prefix_tokens: int
    # Each step's (prefills, decodes, tokens computed, context tokens): the engine's recording run, the dry replay
    engine_loads: tuple[tuple[int, int, int, int], ...] = ()
    dry_loads: tuple[tuple[int, int, int, int], ...] = ()


@pytest.fixture(scope="module")
def model() -> Iterator[ModelHandle]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the phase runner on a CPU: the tiny model's ops are too small to share
    h = open_model("tiny", 2, 2, Device("cpu"), lambda _msg: None)
    try:
        yield h
    finally:
        h.close()
        torch.set_num_threads(threads)


# The cases run to the end (the later waves, the preemptions); the stop has a test of its own.
WHOLE = dataclasses.replace(QUICK, stop_decode_steps=None)


def _dry(h: ModelHandle, ctx: Any, split: Split, workdir: Path, stop: bool = False,
         steps_out: list[DryStep] | None = None) -> ExpertFuture:
    """The dry record, stopped where the phase runner stops a run at the QUICK sizes (`stop`) or run out."""
    return dry_record(ctx, split, h.router, virtual_step_s=QUICK.virtual_step_s,
                      engine_gpu_blocks=engine_config(h, ctx, {}, workdir).kv_gpu_blocks,
                      stop=RunStop.of(QUICK) if stop else None, steps_out=steps_out)


def _loads(steps: list[Any]) -> tuple[tuple[int, int, int, int], ...]:
    return tuple((s.num_prefills, s.num_decodes, s.batch_tokens, s.context_tokens) for s in steps)


@pytest.fixture(scope="module")
def cases(model: ModelHandle, tmp_path_factory: pytest.TempPathFactory) -> list[Case]:
    out = []
    runs = []
    for spec, late in ((POINTS, False), (",".join(GAPS), True)):
        for p in select_points(points(QUICK), spec):
            ctx, prefix = point_context(model, p, QUICK)
            runs.append((f"{p.key} gaps" if late else p.key, _with_gaps(ctx) if late else ctx, prefix))
    for key, ctx, prefix in runs:
        for split in oracle_splits(ctx, QUICK.oracle_max_splits):
            wd = tmp_path_factory.mktemp("dry")
            rec = RecordingPass(split)
            recorded = measure(model, ctx, rec, WHOLE, wd, prefix)
            dry_steps: list[DryStep] = []
            dry = _dry(model, ctx, split, wd, steps_out=dry_steps)
            ran = measure(model, dataclasses.replace(ctx, future=dry, split=split), make("oracle"), WHOLE, wd, prefix)
            out.append(Case(key, ctx, split, dry, rec.future(), recorded.report.summary()["preemptions"],
                            ran.report.steps, ran.extra["diverged_steps"],
                            tuple(s.num_prefills for s in recorded.steps), prefix, _loads(recorded.steps),
                            _loads(dry_steps)))
    return out


def test_the_dry_record_equals_the_engine_recording_step_for_step(cases: list[Case]) -> None:
    for c in cases:
        assert difference(c.dry, c.engine) is None, (c.point, c.split, difference(c.dry, c.engine))
        assert c.dry == c.engine and c.dry.steps == c.engine.steps, (c.point, c.split)  # every step, every layer
        assert c.dry.kv_gpu_blocks == c.split.kv_gpu_blocks


def test_the_dry_steps_carry_the_engine_runs_loads_step_for_step(cases: list[Case]) -> None:
    """What the oracle's search prices (bench/oracle_estimate.py): each replayed step's prefills, decodes, tokens
    computed and context are the engine run's."""
    for c in cases:
        assert c.dry_loads == c.engine_loads, (c.point, c.split)


def test_the_cases_cross_preempting_calm_and_gapped_runs(cases: list[Case]) -> None:
    preempting = [c for c in cases if c.preemptions]
    assert len(preempting) >= 5 and len(cases) - len(preempting) >= 5, [(c.point, c.preemptions) for c in cases]
    assert {c.point.split("/")[2] for c in preempting} >= {"b4", "b12"}
    # The late waves really leave the runner idle: it reached the last arrival in fewer ticks than it is away,
    # so its clock jumped over the gaps.
    gapped = [c for c in cases if c.point.endswith(" gaps")]
    assert len(gapped) >= 4 and any(c.preemptions for c in gapped)
    for c in gapped:
        assert c.dry.num_steps * QUICK.virtual_step_s < max(r.arrival_s for r in c.ctx.requests), c.point


def test_the_oracle_follows_the_dry_record_with_no_diverged_step(cases: list[Case]) -> None:
    for c in cases:
        assert c.diverged_steps == 0, (c.point, c.split)
        assert c.oracle_steps == c.dry.num_steps, (c.point, c.split)


def test_the_kv_split_changes_the_stream_so_the_equality_has_teeth(model: ModelHandle, cases: list[Case],
                                                                     tmp_path: Path) -> None:
    # The same point with the engine's whole GPU tier as the KV share: no preemption, another schedule.
    changed = 0
    for c in (c for c in cases if c.preemptions):
        wide = Split(c.split.expert_slots_per_layer, engine_config(model, c.ctx, {}, tmp_path).kv_gpu_blocks)
        changed += _dry(model, c.ctx, wide, tmp_path).steps != c.engine.steps
    assert changed >= 3


def test_a_step_cap_cuts_the_record_where_the_runner_stops(model: ModelHandle, cases: list[Case],
                                                          tmp_path: Path) -> None:
    """At the QUICK sizes' stop the dry record is the whole run's first steps, cut once QUICK.stop_decode_steps
    measured steps had no prefill, and an engine run under that stop records those same steps."""
    capped = []
    for c in cases:
        stopped = _dry(model, c.ctx, c.split, tmp_path, stop=True)
        assert c.dry.steps[: stopped.num_steps] == stopped.steps, c.point
        if stopped.num_steps < c.dry.num_steps:
            capped.append((c, stopped))
            rule = RunStop.of(QUICK)
            for t, n in enumerate(c.prefills[: stopped.num_steps]):
                assert not rule.reached, (c.point, t)
                rule.after_step(n)
            assert rule.reached, c.point
    assert len(capped) >= 3, [(c.point, c.dry.num_steps) for c in cases]
    c, stopped = capped[0]
    rec = RecordingPass(c.split)
    measure(model, c.ctx, rec, QUICK, tmp_path, c.prefix_tokens)
    assert rec.future() == stopped


def test_a_run_the_runner_would_refuse_is_refused_by_name(model: ModelHandle, tmp_path: Path) -> None:
    p = select_points(points(QUICK), "b4c32f0.4")[0]
    ctx, _ = point_context(model, p, QUICK)
    split = oracle_splits(ctx, 1)[0]
    with pytest.raises(ConfigError, match=r"can never fit the GPU KV budget of 2 blocks"):
        _dry(model, ctx, Split(split.expert_slots_per_layer, 2), tmp_path)
    with pytest.raises(ConfigError, match=r"virtual_step_s must be > 0, got 0"):
        dry_record(ctx, split, model.router, engine_gpu_blocks=64, virtual_step_s=0.0)


def test_the_phase_runner_records_no_future_on_an_engine_unless_asked(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import tierplan.bench.phase as phase

    real, seen = phase.measure, []

    def spy(h: Any, ctx: Any, policy: Any, *a: Any, **kw: Any) -> Any:
        seen.append(policy.name)
        return real(h, ctx, policy, *a, **kw)

    monkeypatch.setattr(phase, "measure", spy)
    kw: dict[str, Any] = {"quick": True, "point_spec": "b4c32f0.4", "policies": ("oracle",)}
    quiet = type("Quiet", (), {"print": staticmethod(lambda *_a, **_k: None)})()
    path = phase.run_phase_bench(tmp_path / "dry", console=quiet, **kw)["tiny"]
    # The cost model's calibration pass, the point's warm-up, then one run per candidate split and no recording run.
    assert seen == ["resident", *QUICK.warmup_policies] + ["oracle"] * QUICK.oracle_max_splits
    dry_rows = phase.load_rows(path)
    seen.clear()
    path = phase.run_phase_bench(tmp_path / "engine", console=quiet, oracle_recording=phase.OracleRecording.ENGINE,
                                 **kw)["tiny"]
    assert seen == ["resident", *QUICK.warmup_policies] + ["oracle-recording", "oracle"] * QUICK.oracle_max_splits
    rows = [r for r in phase.load_rows(path) if r["status"] == "candidate"]
    assert len(rows) == QUICK.oracle_max_splits
    assert all("the dry replay equals it" in r["notes"] for r in rows), [r["notes"] for r in rows]
    assert [r["oracle_split"] for r in rows] == [r["oracle_split"] for r in dry_rows if r["status"] == "candidate"]
