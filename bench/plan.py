"""`tierplan plan bench`: times the split solve on seeded model-sized problems and writes what it measured.

Runs in the bench/CLI process; pure Python + numpy (+ matplotlib for the plot, imported on use). Never imports
torch, runtime or agent. Each repeat solves a fresh problem (seed, seed+1, ...), so the percentiles cover the
variety of curves, not one problem's timing noise. Building a problem is not timed; solving it is (wall and CPU).
Baselines are compared on the same problems, as ratios of expected stall.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from tierplan.controller.optimizer import Constraint, InfeasibleError, solve
from tierplan.controller.optimizer.greedy import fluxmoe_split, solve_greedy
from tierplan.controller.optimizer.synthetic import BenchShape, bench_problem


@dataclass
class PlanBenchResult:
    shape: dict
    solver: str
    seeds: list[int] = field(default_factory=list)  # the problems solved (infeasible ones left out, counted)
    wall_ms: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)
    objective_ms: list[float] = field(default_factory=list)
    gap_pct: list[float] = field(default_factory=list)  # proven distance from optimal; 0 = proven optimal
    link_binding: int = 0
    infeasible: int = 0
    num_options: int = 0
    num_groups: int = 0
    capacity_units: int = 0
    unit_bytes: int = 0
    baselines: dict[str, dict] = field(default_factory=dict)  # name -> {stall_ratio, compared, over_budget}

    def percentile(self, q: float, cpu: bool = False) -> float:
        return float(np.percentile(self.cpu_ms if cpu else self.wall_ms, q))

    def summary(self) -> dict:
        return {"p50_ms": round(self.percentile(50), 3), "p99_ms": round(self.percentile(99), 3),
                "solver": self.solver}


def run_plan_bench(shape: BenchShape, solver: str, repeats: int, seed: int, num_baseline: int,
                   advance: Callable[[int], None] = lambda n: None) -> PlanBenchResult:
    """Solve `repeats` seeded problems with `solver` (after one untimed warm-up) and compare baselines."""
    res = PlanBenchResult(shape=asdict(shape), solver=solver)
    with contextlib.suppress(InfeasibleError):
        solve(bench_problem(shape, seed), solver)  # warm-up: imports and caches, not timed
    for i in range(repeats):
        problem = bench_problem(shape, seed + i)
        res.num_options, res.num_groups = problem.num_options, len(problem.groups)
        res.capacity_units, res.unit_bytes = problem.capacity_units, problem.unit_bytes
        cpu0 = time.process_time()
        try:
            sol = solve(problem, solver)
        except InfeasibleError:
            res.infeasible += 1
            advance(1)
            continue
        res.cpu_ms.append((time.process_time() - cpu0) * 1e3)
        res.wall_ms.append(sol.solve_ms)
        res.seeds.append(seed + i)
        res.objective_ms.append(sol.objective_ms)
        res.link_binding += Constraint.LINK in sol.binding
        res.gap_pct.append(100 * sol.stats.get("gap_ms", 0.0) / max(sol.objective_ms, 1e-12))
        advance(1)
    if num_baseline:
        res.baselines = _baselines(shape, res, num_baseline)
    return res


def _baselines(shape: BenchShape, res: PlanBenchResult, num: int) -> dict[str, dict]:
    compute_ms = shape.num_layers * shape.layer_compute_ms
    rules = {
        "equal-marginal greedy (WiSP-style)": solve_greedy,
        "FluxMoE rho rule": lambda p: fluxmoe_split(p, compute_ms, shape.link_gb_per_s * 1e6),
    }
    out = {}
    for name, rule in rules.items():
        ratios, over = [], 0
        for s, objective in list(zip(res.seeds, res.objective_ms, strict=True))[:num]:
            try:
                # 1 µs/step added to both sides: a problem both solve with no stall counts as a tie
                ratios.append((rule(bench_problem(shape, s)).objective_ms + 1e-3) / (objective + 1e-3))
            except InfeasibleError:
                over += 1
        ratio = float(np.exp(np.mean(np.log(ratios)))) if ratios else None
        out[name] = {"stall_ratio": ratio, "compared": len(ratios), "over_budget": over}
    return out


def write_plan_report(res: PlanBenchResult, out_dir: Path) -> Path:
    """plan_bench_<solver>.json, .md and .png (solve-time CDF) in `out_dir`; returns the JSON path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"plan_bench_{res.solver}"
    data = asdict(res) | {"summary": res.summary(), "cpu_p50_ms": res.percentile(50, cpu=True),
                          "cpu_p99_ms": res.percentile(99, cpu=True)}
    stem.with_suffix(".json").write_text(json.dumps(data, indent=2))
    sh = res.shape
    md = [f"# plan bench: {sh['num_layers']} layers x {sh['num_experts']} experts, solver {res.solver}", "",
          f"{len(res.wall_ms)} problems (seeds {res.seeds[0]}..{res.seeds[-1]}, {res.infeasible} infeasible), "
          f"{res.num_options} options in {res.num_groups} groups, capacity {res.capacity_units} units of "
          f"{res.unit_bytes >> 20} MiB, link budget {sh['link_budget_bytes']} bytes/step.", "",
          "| measure | p50 | p99 | max |", "|---|---|---|---|",
          f"| solve wall ms | {res.percentile(50):.1f} | {res.percentile(99):.1f} | {max(res.wall_ms):.1f} |",
          f"| solve CPU ms | {res.percentile(50, True):.1f} | {res.percentile(99, True):.1f} | "
          f"{max(res.cpu_ms):.1f} |", "",
          f"Link budget binding in {res.link_binding} of {len(res.wall_ms)}; proven optimal in "
          f"{sum(g == 0 for g in res.gap_pct)} (largest proven gap {max(res.gap_pct):.2g}%).", "",
          "| baseline | stall vs this plan (geometric mean) | compared | ended over a budget |", "|---|---|---|---|"]
    md += [f"| {k} | {_ratio(v['stall_ratio'])} | {v['compared']} | {v['over_budget']} |"
           for k, v in res.baselines.items()]
    stem.with_suffix(".md").write_text("\n".join(md) + "\n")
    _plot(stem.with_suffix(".png"), res)
    return stem.with_suffix(".json")


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _plot(path: Path, res: PlanBenchResult) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, xs in (("wall", res.wall_ms), ("CPU", res.cpu_ms)):
        xs = np.sort(xs)
        ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label=label)
    ax.axvline(50, color="grey", linestyle="--", linewidth=1, label="50 ms target")
    ax.set_xlabel("solve ms")
    ax.set_ylabel("fraction of problems")
    ax.set_title(f"split solve time, {res.solver}, {res.shape['num_layers']}x{res.shape['num_experts']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
