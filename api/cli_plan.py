"""`tierplan plan ...`: the split optimizer (plan bench).

Runs in the user's shell. Heavy modules are imported inside the command.
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from tierplan.bench.plan import PlanBenchResult


class SolverOpt(StrEnum):
    dp = "dp"
    milp = "milp"
    greedy = "greedy"


def register(app: typer.Typer) -> None:
    """Add this module's command(s) to `app` (called from api.cli.main)."""
    app.command("bench")(bench)


def bench(
    layers: Annotated[int, typer.Option(min=1, max=1024, help="MoE layers (one group each).")] = 48,
    experts: Annotated[int, typer.Option(min=1, max=4096, help="Experts per layer (options 0..E slots).")] = 128,
    repeats: Annotated[int, typer.Option(min=1, help="Problems to solve and time (seeds seed..seed+N-1).")] = 50,
    solver: Annotated[SolverOpt, typer.Option(help="dp (exact fast path), milp (HiGHS), greedy (baseline).")] =
        SolverOpt.dp,
    seed: Annotated[int, typer.Option(help="First seed of the curve generator.")] = 0,
    hbm_gib: Annotated[float, typer.Option(min=0.0, help="HBM budget for the model on this GPU, GiB.")] = 40.0,
    batch: Annotated[int, typer.Option(min=1, help="Predicted batch (sets each step's expert union and KV).")] = 16,
    link_budget_gb: Annotated[float, typer.Option(min=0.0, help="Link budget, GB per step; 0 = none.")] = 4.0,
    baselines: Annotated[int, typer.Option(min=0, help="Problems on which to compare the plan with the greedy "
                                                        "and FluxMoE baselines (not timed); 0 = none.")] = 10,
    out: Annotated[Path | None, typer.Option(help="Write plan_bench_<solver>.json/.md/.png here "
                                                  "(e.g. bench/results).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Last stdout line: {p50_ms, p99_ms, solver}.")] = False,
) -> None:
    """Time the split solve on a Qwen3-30B-A3B-sized problem (48 x 128 experts of 9 MiB, KV options, link budget)."""
    from tierplan.api.cli import _io, _progress
    from tierplan.bench.plan import run_plan_bench, write_plan_report
    from tierplan.controller.optimizer import InfeasibleError, ProblemError
    from tierplan.controller.optimizer.synthetic import GIB, BenchShape

    shape = BenchShape(num_layers=layers, num_experts=experts, hbm_budget_bytes=int(hbm_gib * GIB), batch=batch,
                       link_budget_bytes=int(link_budget_gb * 1e9) or None)
    try:
        with _progress("solving", repeats) as advance:
            res = run_plan_bench(shape, solver.value, repeats, seed, baselines, advance)
    except (ProblemError, InfeasibleError) as exc:  # the problem itself cannot be built (e.g. no HBM left)
        _io.err.print(f"error: {exc}")
        raise typer.Exit(2) from None
    if not res.wall_ms:
        _io.err.print(f"error: all {repeats} problems were infeasible for {solver.value} "
                      "(raise --hbm-gib or --link-budget-gb)")
        raise typer.Exit(2)
    _print(_io.out, res)
    if out is not None:
        _io.out.print(f"wrote {write_plan_report(res, out)}")
    if as_json:
        _io.out.print(json.dumps(res.summary()))


def _print(console: Console, res: PlanBenchResult) -> None:
    from rich.table import Table

    sh = res.shape
    t = Table(title=f"plan bench: {sh['num_layers']} layers x {sh['num_experts']} experts, solver={res.solver}")
    t.add_column("measure")
    t.add_column("value", justify="right")
    n = len(res.wall_ms)
    rows = [
        ("problems solved", f"{n} (+{res.infeasible} infeasible)"),
        ("options per problem", f"{res.num_options} in {res.num_groups} groups"),
        ("capacity", f"{res.capacity_units} units of {res.unit_bytes >> 20} MiB"),
        ("solve p50 / p99 / max", f"{res.percentile(50):.1f} / {res.percentile(99):.1f} / {max(res.wall_ms):.1f} ms"),
        ("solve CPU p50 / p99", f"{res.percentile(50, True):.1f} / {res.percentile(99, True):.1f} ms"),
        ("link budget binding", f"{res.link_binding} of {n}"),
        ("proven optimal", f"{sum(g == 0 for g in res.gap_pct)} of {n} (largest proven gap {max(res.gap_pct):.2g}%)"),
        ("mean objective", f"{sum(res.objective_ms) / n:.2f} ms/step"),
    ]
    for name, b in res.baselines.items():
        ratio = "-" if b["stall_ratio"] is None else f"{b['stall_ratio']:.2f}x the stall"
        over = f", {b['over_budget']} over a budget" if b["over_budget"] else ""
        rows.append((name, f"{ratio} ({b['compared']} compared{over})"))
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
