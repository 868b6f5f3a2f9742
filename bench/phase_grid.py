"""The phase diagram's grid: which (model, layers, batch, context, budget) points a sweep runs, and each point's
requests (bundled Mooncake conversations, lengths scaled to the point's context, arrivals on the virtual clock).

Runs in the bench process (`tierplan bench phase`); pure Python, never torch. It decides no placement.

Budgets are given at full depth (the issue's GiB: experts + KV + workspace) and scaled by the kept fraction of
layers; the runner takes the workspace (dense weights of the kept layers plus an activation allowance) out
before a policy sees the budget. `--quick` uses the `tiny` preset, whose budgets are fractions of what the point
could use at most (every expert plus the KV of its `batch` largest requests at once), so that the smoke run
crosses the same regimes (everything fits / experts or KV must give) at CPU sizes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

from tierplan.runtime.engine.workloads import MOONCAKE_BLOCK_TOKENS, Request, load_mooncake

DATA = Path(__file__).resolve().parents[1] / "data"
MOONCAKE = DATA / "requests" / "mooncake_conversation_sample.jsonl"
ROUTING = DATA / "routing" / "flame_moe_290m_sample.npz"
GIB = 2**30


@dataclass(frozen=True)
class ModelSweep:
    name: str  # preset
    layers: int  # layers kept (the preset's first ones)
    full_layers: int  # the preset's depth (the budgets' scale)
    budgets_gib: tuple[float, ...] = ()  # full-depth budgets; empty: `budget_fracs` of the point's need
    budget_fracs: tuple[float, ...] = ()


@dataclass(frozen=True)
class Sizes:
    models: tuple[ModelSweep, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]  # the mean prompt of a point, tokens (the Mooncake lengths scaled to it)
    mean_output_tokens: int
    max_output_tokens: int
    requests_per_batch: float  # requests of a point = ceil(batch * this): the batch fills, then drains
    warm_steps: int  # steps not measured (the first prefills, the caches filling)
    stop_decode_steps: int | None  # a run stops once this many measured steps had no prefill (`RunStop`)
    virtual_step_s: float
    kv_cpu_gib: float  # CPU / NVMe KV tier capacity cap (full depth; the point's need is used when smaller)
    kv_nvme_gib: float
    oracle_max_splits: int  # candidate splits the oracle's search measures
    repeats: int  # runs of each policy at a point, in rounds of alternating order (the report shows the median)
    activation_bytes_per_token: int  # workspace allowance per batch token, taken out of the budget
    quick: bool
    # Discarded runs of these policies at each point before its measured runs, in order (empty: none). The engine
    # compiles its Triton kernels at the first use of each specialisation (prefill lengths, context splits), so
    # without them the point's first policy paid for them: H100 phase runs 30 and 32 (b128 1K, 40 GiB), tierplan's
    # first 16 steps, the same plan, work and misses as mv_wsa's, took 3.0 and 5.6 s against 1.3 and 1.6. One
    # static_lru run did not reach what a KV-first split runs into (more sequences at once, longer contexts): at
    # b256 4K 56 GiB the first KV-first run's prefill steps were slow in one stretch whichever policy it was (by 40
    # prefill steps, tierplan in H100 run 78 105 / 55 / 51 / 84 / 137 / 116 / 82 ms, tierplan_kf in run 79 103 / 55 /
    # 61 / 82 / 142 / 108 / 68) and the next one's were not (mv_wsa 54-59, tierplan run third 44-54); over the saved
    # steps, the point's first run took 1.31x the prefill time of later runs of the same prefill work at the median
    # (15 first runs with such a later run, 10 over 1.15x: b256 4K 56 GiB, b128 1K 40/56 GiB). So the full sweep
    # warms up with mv_wsa (KV first, live) after static_lru.
    warmup_policies: tuple[str, ...] = ("static_lru",)
    # Splits the oracle's search prices first where it holds more than it measures (bench/oracle_estimate.py); at
    # or below `oracle_max_splits`: every one is run, none priced.
    oracle_priced_splits: int = 0
    # CPUs a live policy's controller process may run on beside the engine (0: all of the engine's;
    # bench/baselines/plan_process.py): its solves' bursts then leave the engine's thread the rest.
    planner_cores: int = 4

    @property
    def oracle_pool_splits(self) -> int:
        """Candidate splits of the oracle's search: those priced, or those measured where more."""
        return max(self.oracle_priced_splits, self.oracle_max_splits)


# The grid. qwen3-30b-a3b: 128 experts of 9 MiB in each of 48 layers (~54 GiB), mixtral: 8 of 336 MiB in
# 32 (~84 GiB); both cut to 8 layers so each point's engine builds in seconds and fits beside the store. Outputs
# of 64 tokens on average (at most 128) and 1.25 requests per batch slot: a run at full concurrency is 121-150
# steps (>= 100 measured after the 16 warm-up ones); a policy that runs fewer sequences at once takes more. The
# oracle prices seven candidate splits and runs the best two by that price (bench/oracle_estimate.py: over the
# saved candidates of H100/H200 phase runs 26-45, 31 points with two or more measured, the two best priced held
# the best measured at 30, and one within 12 % of it at the 31st). A run stops once 128 measured steps had no
# prefill (>= 100 decode steps at every point): the lighter points finish first, while a point whose KV share
# holds a few of its sequences at once would otherwise take thousands of steps (the scheduler's replay: mixtral
# b256 16K at 32 GiB 5,285 steps of 3.8 sequences; b128 4K 661), each a link-bound quarter second on the H200, for
# the batch its first ~150 ran already (the replay stops every point at 146-367 steps; the mean batch over them is
# never below the whole run's at b >= 32, up to 30 % above it where the drain is left out).
FULL = Sizes(
    models=(ModelSweep("qwen3-30b-a3b", 8, 48, budgets_gib=(24.0, 40.0, 56.0)),
            ModelSweep("mixtral-8x7b", 8, 32, budgets_gib=(32.0, 56.0, 80.0))),
    batches=(1, 8, 32, 128, 256), contexts=(1024, 4096, 16384), mean_output_tokens=64, max_output_tokens=128,
    requests_per_batch=1.25,
    warm_steps=16, stop_decode_steps=128, virtual_step_s=0.02, kv_cpu_gib=24.0, kv_nvme_gib=48.0, oracle_max_splits=2,
    repeats=1, activation_bytes_per_token=64 << 10, quick=False, oracle_priced_splits=7,
    warmup_policies=("static_lru", "mv_wsa"))
# CPU smoke sizes: the tiny preset (2 layers, 8 experts, top-2); few steps, so its figures are no result.
QUICK = Sizes(
    models=(ModelSweep("tiny", 2, 2, budget_fracs=(0.4, 0.7, 1.0)),),
    batches=(1, 4, 12), contexts=(32, 128), mean_output_tokens=16, max_output_tokens=32, requests_per_batch=1.5,
    warm_steps=8, stop_decode_steps=32,  # the stop is exercised: the longest smoke runs take ~130 steps
    virtual_step_s=0.005, kv_cpu_gib=1.0, kv_nvme_gib=1.0, oracle_max_splits=3, repeats=1,
    activation_bytes_per_token=0, quick=True)


@dataclass
class RunStop:
    """Where a phase run stops (the runner asks `reached` before each step; the oracle's replay of the run,
    bench/baselines/dry_record.py, asks the same): once `decode_steps` steps after the `warm_steps` carried no
    prefill. None: never (the run ends when its last request finishes)."""

    warm_steps: int
    decode_steps: int | None
    steps: int = 0
    measured_decodes: int = 0

    @classmethod
    def of(cls, sizes: Sizes) -> RunStop:
        return cls(sizes.warm_steps, sizes.stop_decode_steps)

    def after_step(self, num_prefills: int) -> None:
        self.steps += 1
        if self.steps > self.warm_steps and num_prefills == 0:
            self.measured_decodes += 1

    @property
    def reached(self) -> bool:
        return self.decode_steps is not None and self.measured_decodes >= self.decode_steps


@dataclass(frozen=True)
class Point:
    model: str
    layers: int
    full_layers: int
    batch: int
    context: int
    budget_label_gib: float  # the full-depth budget the row names (quick: the scaled budget itself)
    budget_frac: float | None  # quick: the budget as a fraction of the point's need (resolved by the runner)

    @property
    def key(self) -> str:
        b = f"f{self.budget_frac:g}" if self.budget_frac is not None else f"g{self.budget_label_gib:g}"
        return f"{self.model}/L{self.layers}/b{self.batch}/c{self.context}/{b}"

    @property
    def kept_frac(self) -> float:
        return self.layers / self.full_layers


def points(sizes: Sizes, models: tuple[str, ...] = ()) -> list[Point]:
    """Every point of the grid (only `models` when given), in sweep order: model, budget, context, batch."""
    out = []
    for m in sizes.models:
        if models and m.name not in models:
            continue
        budgets: list[tuple[float, float | None]] = ([(g, None) for g in m.budgets_gib] if m.budgets_gib
                                                     else [(0.0, f) for f in m.budget_fracs])
        for gib, frac in budgets:
            for ctx in sizes.contexts:
                for b in sizes.batches:
                    out.append(Point(m.name, m.layers, m.full_layers, b, ctx, gib, frac))
    return out


_POINT_RE = re.compile(r"^(?:(?P<model>[A-Za-z0-9._-]+):)?b(?P<batch>\d+)(?:c(?P<ctx>\d+))?(?:g(?P<gib>[\d.]+))?"
                       r"(?:f(?P<frac>[\d.]+))?$")


def select_points(all_points: list[Point], spec: str) -> list[Point]:
    """`--points`: comma-separated patterns `[model:]b<batch>[c<context>][g<GiB>|f<frac>]`, e.g.
    `b1c64,tiny:b6c192f0.8`; each must match at least one grid point. ValueError names a bad pattern and the
    grid's values."""
    picked: list[Point] = []
    for raw in (x.strip() for x in spec.split(",")):
        if not raw:
            continue
        m = _POINT_RE.match(raw)
        if m is None:
            raise ValueError(f"--points: {raw!r} is not [model:]b<batch>[c<context>][g<GiB>|f<frac>] "
                             "(e.g. b32c4096g24)")
        hits = [p for p in all_points
                if (m["model"] is None or p.model == m["model"]) and p.batch == int(m["batch"])
                and (m["ctx"] is None or p.context == int(m["ctx"]))
                and (m["gib"] is None or abs(p.budget_label_gib - float(m["gib"])) < 1e-9)
                and (m["frac"] is None or (p.budget_frac is not None and abs(p.budget_frac - float(m["frac"])) < 1e-9))]
        if not hits:
            grid = sorted({(p.model, p.batch, p.context, p.budget_frac or p.budget_label_gib) for p in all_points})
            raise ValueError(f"--points: {raw!r} matches no point of this grid; its (model, batch, context, "
                             f"budget) are {grid}")
        picked += [p for p in hits if p not in picked]
    return picked


def point_requests(point: Point, sizes: Sizes) -> tuple[tuple[Request, ...], int]:
    """The point's requests and the tokens each Mooncake prefix id covers after scaling. The first
    ceil(batch * requests_per_batch) Mooncake conversations, prompt lengths scaled by one factor so their mean
    is the point's context (each capped at twice it: the trace's long tail would otherwise set the KV need
    alone), outputs by one factor so their mean is `mean_output_tokens` (capped at `max_output_tokens`); a
    prefix id then covers 512 x the prompt factor tokens, so requests sharing leading ids share leading tokens.
    Arrivals keep the trace's order and relative gaps, compressed so the offered load is about twice the batch
    (the batch fills, as a serving engine under load sees it), on the virtual step clock."""
    num = max(1, math.ceil(point.batch * sizes.requests_per_batch))
    base = load_mooncake(MOONCAKE, limit=max(num, 2))[:num]
    p_factor = point.context / (sum(r.prompt_len for r in base) / len(base))
    o_factor = sizes.mean_output_tokens / (sum(r.output_len for r in base) / len(base))
    prefix_tokens = max(1, round(MOONCAKE_BLOCK_TOKENS * p_factor))
    reqs = []
    for r in base:
        prompt = min(2 * point.context, max(1, round(r.prompt_len * p_factor)))
        out = min(sizes.max_output_tokens, max(1, round(r.output_len * o_factor)))
        reqs.append(dataclasses.replace(r, prompt_len=prompt, output_len=out,
                                        prefix_block_ids=r.prefix_block_ids[:math.ceil(prompt / prefix_tokens)]))
    mean_out = sum(r.output_len for r in reqs) / len(reqs)
    span_s = len(reqs) * mean_out * sizes.virtual_step_s / (2 * point.batch)
    last = reqs[-1].arrival_s
    return tuple(dataclasses.replace(r, request_id=i, arrival_s=r.arrival_s / last * span_s if last
                                     else i * span_s / len(reqs)) for i, r in enumerate(reqs)), prefix_tokens
