"""The `tierplan` command line (typer). Runs in the user's shell; builds settings in `main`, nothing at import.

Heavy modules (torch, the runtime) are imported inside commands so `tierplan --help` stays fast.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from tierplan.api import (
    cli_bench_api,
    cli_bench_phase,
    cli_dashboards,
    cli_db,
    cli_eval_kv,
    cli_eval_predictors,
    cli_generate,
    cli_plan,
    cli_serve,
    cli_sidecar,
    cli_sim,
)
from tierplan.api.cli_checks import MAX_SEED, check_device, check_workdir, user_errors

app = typer.Typer(add_completion=False, no_args_is_help=True, help="tierplan: one HBM budget for experts and KV.")
check_app = typer.Typer(no_args_is_help=True, help="Self-checks of the execution substrate.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks; results go to bench/results/.")
app.add_typer(check_app, name="check")
app.add_typer(bench_app, name="bench")
eval_app = typer.Typer(no_args_is_help=True, help="Offline evaluation of the controller's demand models on traces.")
plan_app = typer.Typer(no_args_is_help=True, help="The controller's split optimizer.")
app.add_typer(eval_app, name="eval")
app.add_typer(plan_app, name="plan")

class _Consoles:
    """stdout/stderr consoles, made on first use (nothing is built at import)."""

    @functools.cached_property
    def out(self) -> Console:
        return Console(highlight=False, soft_wrap=True)

    @functools.cached_property
    def err(self) -> Console:
        return Console(stderr=True)


_io = _Consoles()


class DeviceOpt(StrEnum):
    cpu = "cpu"
    cuda = "cuda"


@contextmanager
def _progress(what: str, total: int) -> Iterator[Callable[[int], None]]:
    bar = Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), console=_io.err,
                   disable=not sys.stderr.isatty())
    with bar:
        task = bar.add_task(what, total=total)
        yield lambda n: bar.advance(task, n)


Seed = Annotated[int, typer.Option(min=0, max=MAX_SEED, help="Random seed; the same seed replays the same traffic.")]
Dev = Annotated[DeviceOpt, typer.Option(help="cpu (the twin CI runs) or cuda (one GPU).")]
Workdir = Annotated[Path | None, typer.Option(callback=check_workdir,
                                              help="Folder for the NVMe files (default: a temporary folder).")]
_errors = user_errors(lambda: _io.err)


@check_app.command("tiers")
@_errors
def check_tiers(
    moves: Annotated[int, typer.Option(min=1, help="Number of random moves (KV moves + expert loads).")] = 10_000,
    seed: Seed = 0,
    device: Dev = DeviceOpt.cpu,
    workdir: Workdir = None,
    inject_every: Annotated[int, typer.Option(min=0, help="Flip one NVMe byte every N moves; 0 = never.")] = 500,
    jobs: Annotated[int, typer.Option(min=1, help="Processes to shard the moves over (seeds seed..seed+jobs-1).")] = 1,
) -> None:
    """Random moves over every tier pair, expert and KV traffic interleaved, checksums verified."""
    from tierplan.runtime.selfcheck.tiers import run_tier_check, run_tier_check_jobs

    check_device(device)
    if jobs > 1:
        _io.err.print(f"sharding {moves} moves over {jobs} processes (no progress bar)")
        r = run_tier_check_jobs(moves, seed, device.value, workdir, inject_every=inject_every, jobs=jobs)
    else:
        with _progress("tiers", moves) as tick:
            r = run_tier_check(moves, seed, device.value, workdir, inject_every=inject_every, progress=tick)
    _io.out.print(
        f"kv_moves={r.kv_moves} expert_loads={r.expert_loads} injected={r.injected} "
        f"unexpected_errors={r.unexpected_errors} direct_io={r.direct_io} device={r.device} seconds={r.seconds:.1f}"
    )
    _io.out.print(r.line())
    if not r.ok:
        raise typer.Exit(1)


@check_app.command("slots")
@_errors
def check_slots(
    remaps: Annotated[int, typer.Option(min=1, help="Number of expert loads into slots.")] = 10_000,
    seed: Seed = 0,
    device: Dev = DeviceOpt.cpu,
    workdir: Workdir = None,
) -> None:
    """Random expert remaps with poisoned slots; every read's fingerprint verified."""
    from tierplan.runtime.selfcheck.slots import run_slot_check

    check_device(device)
    with _progress("slots", remaps) as tick:
        r = run_slot_check(remaps, seed, device.value, workdir, progress=tick)
    _io.out.print(
        f"reads_checked={r.reads_checked} poison_reads={r.poison_reads} evictions={r.evictions} pins={r.pins} "
        f"device={r.device} seconds={r.seconds:.1f}"
    )
    _io.out.print(r.line())
    if r.stale_reads:
        raise typer.Exit(1)


@check_app.command("exact")
@_errors
def check_exact(
    preset: Annotated[str | None, typer.Option(
        help="Model preset (tiny, qwen3-30b-a3b, mixtral-8x7b, ...); default tiny.")] = None,
    config: Annotated[Path | None, typer.Option(help="A Hugging Face config.json (or its folder) instead.")] = None,
    model: Annotated[Path | None, typer.Option(help="A local checkpoint folder instead: its real weights.")] = None,
    layers: Annotated[int | None, typer.Option(min=1, help="Keep only the first N layers.")] = None,
    resident_frac: Annotated[float, typer.Option(min=0.0, max=1.0, help="Fraction of experts with a slot.")] = 0.25,
    prompts: Annotated[int, typer.Option(min=1, help="Number of random prompts (3: a padded CUDA-graph bucket).")] = 3,
    new_tokens: Annotated[int, typer.Option(min=1, help="Tokens generated per prompt.")] = 8,
    seed: Seed = 0,
    device: Dev = DeviceOpt.cpu,
    workdir: Workdir = None,
    expert_map_in: Annotated[str, typer.Option(
        help="Second run: when a loading expert's range is mapped: 'beside_copy' (by the link worker in its "
             "waits, beside the copy through the slot window; the default), 'before_copy' (before issuing the "
             "copy) or 'on_read' (never at load: a reader through the ranges maps what it reads). With "
             "--mode all, each mode runs with the map-in it needs (each result line names it).")] = "beside_copy",
    expert_poison: Annotated[bool, typer.Option(
        help="Second run: absent experts' ranges read as NaN poison instead of unmapped (a stray read "
             "faults).")] = False,
    expert_store: Annotated[str, typer.Option(
        help="Second run: where missing experts load from: 'nvme' (disk, then pinned staging; the default) or "
             "'pinned' (pinned host memory, the engine's default store: a step's misses are issued on the "
             "engine thread).")] = "nvme",
    mode: Annotated[str, typer.Option(
        help="Second run's decode steps with experts missing: 'piecewise' (graphs, misses loaded between "
             "layers, GEMMs through the slot table), 'lookahead' (piecewise, two layers prefetched ahead), "
             "'range' (piecewise, GEMMs through the experts' ranges), 'eager', 'on_read' (piecewise through "
             "the slot table, loads mapping no range), or 'all' (each in turn).")
    ] = "piecewise",
    decode_graphs: Annotated[bool | None, typer.Option(
        help="Decode through the graph executors (default: on a GPU; on a CPU the same static buffers run "
             "without capture).")] = None,
) -> None:
    """Same prompts twice: all resident + KV on GPU, then F resident + KV spilled to CPU/NVMe; compare bits."""
    from tierplan.runtime.engine.hf_config import load_hf_config
    from tierplan.runtime.engine.presets import preset as load_preset
    from tierplan.runtime.errors import ConfigError
    from tierplan.runtime.selfcheck.exact import MODES, run_exact_checks
    from tierplan.runtime.weights.loader import StoreKind, map_in_error

    check_device(device)
    named = [f"{flag} {value}" for flag, value in (("--preset", preset), ("--config", config), ("--model", model))
             if value is not None]
    if len(named) > 1:
        count = ("two", "three")[len(named) - 2]
        raise typer.BadParameter(f"{' and '.join(named)} name {count} models; expected one of them",
                                 param_hint="--preset / --config / --model")
    try:
        spec = load_hf_config(config) if config is not None else load_preset(preset or "tiny")
        if model is not None:
            from tierplan.runtime.engine.pretrained import read_pretrained

            if layers is not None:
                raise ConfigError("--model runs the whole checkpoint: drop --layers")
            spec = read_pretrained(model).spec  # the engines then load its weights
        if layers is not None:
            spec = spec.truncated(layers)
        if (why := map_in_error("", expert_map_in)) is not None:
            raise typer.BadParameter(why, param_hint="--expert-map-in")
        stores = {k.value: k for k in StoreKind}
        if expert_store not in stores:
            raise typer.BadParameter(f"{expert_store!r}; expected one of {', '.join(map(repr, stores))}",
                                     param_hint="--expert-store")
        modes = list(MODES) if mode == "all" else [mode]
        if any(m not in MODES for m in modes):
            raise typer.BadParameter(f"{mode!r}; expected one of {', '.join(map(repr, [*MODES, 'all']))}",
                                     param_hint="--mode")
        window = spec.sliding_window > 0  # the reference attention path: not the paged kernel or graphs
        results = run_exact_checks(spec, resident_frac, device.value, num_prompts=prompts, new_tokens=new_tokens,
                                   seed=seed, workdir=workdir, expert_map_in=expert_map_in,  # type: ignore[arg-type]
                                   expert_poison=expert_poison, modes=modes, expert_store=stores[expert_store],
                                   decode_graphs=False if window else decode_graphs,
                                   decode_kernel=False if window else (True if decode_graphs else None))
    except ConfigError as exc:
        _io.err.print(f"error: {exc}")
        raise typer.Exit(2) from None
    for r in results:
        _io.out.print(f"model={spec.name} mode={r.mode} steps={r.steps} expert_misses full={r.expert_misses_full} "
                      f"tight={r.expert_misses_tight} kv_fetches={r.kv_fetches} kv_spills={r.kv_spills} "
                      f"map_in={r.map_in} executors={r.executors} mode_steps={r.mode_steps} device={device.value} "
                      f"seconds={r.seconds:.1f}")
        _io.out.print(r.line())
    if not all(r.ok for r in results):
        raise typer.Exit(1)


def _sections(only: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """`--only a,b` as a tuple of known section names (all of them when empty)."""
    sections = tuple(x.strip() for x in only.split(",") if x.strip()) or allowed
    bad = set(sections) - set(allowed)
    if bad:
        raise typer.BadParameter(f"unknown section(s) {sorted(bad)}; expected some of {', '.join(allowed)}",
                                 param_hint="--only")
    return sections


@bench_app.command("substrate")
@_errors
def bench_substrate(
    out_dir: Annotated[Path, typer.Option(help="Where to write JSON, Markdown and PNG.")] = Path("bench/results"),
    quick: Annotated[bool, typer.Option(help="Small sizes (CPU smoke run).")] = False,
    device: Dev = DeviceOpt.cuda,
    only: Annotated[str, typer.Option(help="Comma-separated sections: raw,loads,map,links,urgent,calls.")] = "",
    load_configs: Annotated[str, typer.Option(
        help="loads: 'all' engine configs, only the 'default' one, 'urgent-stream' (default vs deep bulk "
             "queue with urgent copies on their own stream), 'map-in' (the default: maps in the link worker's "
             "waits beside the copy, published when issued, vs before the copy and/or published when done), or "
             "'submit' (a prefetch list as one load_many call vs one load per expert, inline retire, unmapped "
             "absent experts).")] = "all",
) -> None:
    """Measure the substrate: link bandwidth, expert loads vs raw copies, map cost, urgent-KV queueing."""
    from tierplan.bench.substrate import LOAD_CONFIG_SETS, SECTIONS, run_substrate_bench

    sections = _sections(only, SECTIONS)
    if load_configs not in LOAD_CONFIG_SETS:
        raise typer.BadParameter(f"{load_configs!r}; expected one of {', '.join(map(repr, LOAD_CONFIG_SETS))}",
                                 param_hint="--load-configs")
    check_device(device)
    run_substrate_bench(out_dir, device.value, quick=quick, console=_io.out, sections=sections,
                        load_configs=load_configs)


@bench_app.command("engine")
@_errors
def bench_engine(
    out_dir: Annotated[Path, typer.Option(help="Where to write JSON and Markdown.")] = Path("bench/results"),
    quick: Annotated[bool, typer.Option(help="Small sizes (CPU smoke run).")] = False,
    device: Dev = DeviceOpt.cuda,
    profile: Annotated[bool, typer.Option(help="Also write profile_eager_step.txt and profile_prefill_long.txt "
                                               "(torch.profiler).")] = False,
    only: Annotated[str, typer.Option(help="Comma-separated sections: moe,attention,decode,eager,prefill.")] = "",
    rounds: Annotated[int, typer.Option(min=1, max=50, help="Agent off/on rounds per decode batch.")] = 3,
) -> None:
    """Engine kernels vs bare baselines: MoE layer vs grouped GEMM, paged decode attention vs SDPA."""
    from tierplan.bench.engine import SECTIONS, run_engine_bench

    sections = _sections(only, SECTIONS)
    check_device(device)
    run_engine_bench(out_dir, device.value, quick=quick, console=_io.out, profile=profile, sections=sections,
                     rounds=rounds)


@bench_app.command("offload")
@_errors
def bench_offload(
    out_dir: Annotated[Path, typer.Option(help="Where to write JSON, Markdown and PNG.")] = Path("bench/results"),
    quick: Annotated[bool, typer.Option(help="Small sizes (CPU smoke run).")] = False,
    device: Dev = DeviceOpt.cuda,
    models: Annotated[str, typer.Option(help="Comma-separated presets to run (default: all of the sweep's).")] = "",
    model: Annotated[Path | None, typer.Option(help="A local checkpoint folder instead: run it whole, its real "
                                                    "weights.")] = None,
) -> None:
    """Decode with part of the experts resident and forced real routing: step time vs the link floor."""
    from tierplan.bench.offload import FULL, QUICK, run_offload_bench

    if model is not None and models:
        raise typer.BadParameter(f"--models {models} and --model {model} name two sets of models; expected one",
                                 param_hint="--models / --model")
    check_device(device)
    allowed = tuple(name for name, _ in (QUICK if quick else FULL).models)
    picked = _sections(models, allowed) if models else ()
    run_offload_bench(out_dir, device.value, quick=quick, console=_io.out, models=picked, model_dir=model)


@app.command()
@_errors
def demo(
    workdir: Workdir = None,
    requests: Annotated[int, typer.Option(
        min=3, max=400, help="Requests replayed from the bundled trace, in three phases (light, batch grows, "
                             "context grows).")] = 48,
    serve: Annotated[bool, typer.Option(
        "--serve", help="Keep the controller service (and its decisions page at /ui) up after the run, until "
                        "Ctrl-C.")] = False,
) -> None:
    """The main job on its embedded default (CPU, tiny MoE, bundled real traces, the controller service on
    SQLite with a sidecar); ends with "demo: ok"."""
    from tierplan.api.demo import run_demo

    if not run_demo(_io.out, workdir, requests, serve=serve):
        raise typer.Exit(1)


# Controller commands live in their own modules (one concept each, typer only at import); each adds itself here.
cli_eval_predictors.register(eval_app)
cli_eval_kv.register(eval_app)
cli_plan.register(plan_app)
cli_sim.register(app)
cli_generate.register(app)
cli_dashboards.register(app)
cli_bench_api.register(bench_app)
cli_bench_phase.register(bench_app)
cli_db.register(app)
cli_serve.register(app)
cli_sidecar.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
