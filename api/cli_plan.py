"""`tierplan plan ...`: the split optimizer (plan bench).

Runs in the user's shell. Heavy modules are imported inside the command.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from controller.optimizer import SplitProblem
    from controller.optimizer.synthetic import BenchShape


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
    as_json: Annotated[bool, typer.Option("--json", help="Last stdout line: {p50_ms, p99_ms, solver}.")] = False,
) -> None:
    """Time the split solve on a Qwen3-30B-A3B-sized problem (48 x 128 experts of 9 MiB, KV options, link budget)."""
    import numpy as np

    from api.cli import _io, _progress
    from controller.optimizer import InfeasibleError, ProblemError, solve
    from controller.optimizer.synthetic import GIB, BenchShape, bench_problem

    shape = BenchShape(num_layers=layers, num_experts=experts, hbm_budget_bytes=int(hbm_gib * GIB), batch=batch,
                       link_budget_bytes=int(link_budget_gb * 1e9) or None)
    times_ms, objectives, binding, gaps, infeasible = [], [], 0, [], 0
    try:
        solve(bench_problem(shape, seed), solver.value)  # warm-up (imports, caches); not timed
    except InfeasibleError:
        pass
    except ProblemError as exc:
        _io.err.print(f"error: {exc}")
        raise typer.Exit(2) from None
    with _progress("solving", repeats) as advance:
        for i in range(repeats):
            try:
                problem = bench_problem(shape, seed + i)
            except (ProblemError, InfeasibleError) as exc:
                _io.err.print(f"error: {exc}")
                raise typer.Exit(2) from None
            try:
                sol = solve(problem, solver.value)
            except InfeasibleError:
                infeasible += 1
                advance(1)
                continue
            times_ms.append(sol.solve_ms)
            objectives.append(sol.objective_ms)
            binding += any(c.value == "link" for c in sol.binding)
            gaps.append(100 * sol.stats.get("gap_ms", 0.0) / max(sol.objective_ms, 1e-12))
            advance(1)
    if not times_ms:
        _io.err.print(f"error: all {repeats} problems were infeasible for {solver.value} "
                      "(raise --hbm-gib or --link-budget-gb)")
        raise typer.Exit(2)
    p50, p99 = (float(np.percentile(times_ms, q)) for q in (50, 99))
    _print_table(_io.out, shape, solver.value, times_ms, objectives, binding, gaps, infeasible, problem)
    if as_json:
        _io.out.print(json.dumps({"p50_ms": round(p50, 3), "p99_ms": round(p99, 3), "solver": solver.value}))


def _print_table(console: Console, shape: BenchShape, solver: str, times_ms: list[float], objectives: list[float],
                 binding: int, gaps: list[float], infeasible: int, problem: SplitProblem) -> None:
    import numpy as np
    from rich.table import Table

    t = Table(title=f"plan bench: {shape.num_layers} layers x {shape.num_experts} experts, solver={solver}")
    t.add_column("measure")
    t.add_column("value", justify="right")
    rows = [
        ("problems solved", f"{len(times_ms)} (+{infeasible} infeasible)"),
        ("options per problem", f"{problem.num_options} in {len(problem.groups)} groups"),
        ("capacity", f"{problem.capacity_units} units of {problem.unit_bytes >> 20} MiB"),
        ("solve p50 / p99 / max", f"{np.percentile(times_ms, 50):.1f} / {np.percentile(times_ms, 99):.1f} / "
                                  f"{max(times_ms):.1f} ms"),
        ("link budget binding", f"{binding} of {len(times_ms)}"),
        ("proven optimal", f"{sum(g == 0 for g in gaps)} of {len(times_ms)} (max gap {max(gaps):.2g}%)"),
        ("mean objective", f"{np.mean(objectives):.2f} ms/step"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
