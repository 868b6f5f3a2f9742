"""`tierplan bench phase`: the phase diagram (every policy on one engine, batch x context x HBM budget).

Runs in the user's shell; the sweep itself is bench/phase.py. Bad input (an unknown policy, model or point;
`--device cuda` where torch sees no CUDA device) prints `error: ...` and exits 2 before any work. A rich
progress bar counts the runs (only when stderr is a terminal); every run's line goes to stderr too.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def _split(value: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in value.split(",") if x.strip())


def register(bench_app: typer.Typer) -> None:
    """Add `phase` to the `bench` group (called at the bottom of api/cli.py)."""

    @bench_app.command("phase")
    def bench_phase(
        quick: Annotated[bool, typer.Option(help="CPU smoke sizes (the tiny preset, a few steps): every policy and "
                                                 "every output, no figure to quote.")] = False,
        device: Annotated[str, typer.Option(help="cpu or cuda (one GPU).")] = "cpu",
        points: Annotated[str, typer.Option(help="Only these points: comma-separated [model:]b<batch>[c<context>]"
                                                 "[g<GiB>|f<frac>], e.g. b32c4096g24.")] = "",
        policies: Annotated[str, typer.Option(help="Only these policies (comma-separated; default: all).")] = "",
        models: Annotated[str, typer.Option(help="Only these models (comma-separated; default: the sweep's).")] = "",
        fresh: Annotated[bool, typer.Option(help="Measure every selected run again (default: resume, skipping "
                                                 "runs this code measured on this device, ok or degraded; error "
                                                 "and refused ones run again). Rows already in the JSON stay; the "
                                                 "newest of a run is the report's.")] = False,
        out_dir: Annotated[Path, typer.Option(help="Where the JSON, Markdown and PNG go.")] = RESULTS,
        requests_per_batch: Annotated[float | None, typer.Option(
            help="Requests per point = ceil(batch x this) (default: the sweep's; fewer make large-batch runs "
                 "shorter; rows at other sizes are not reused).")] = None,
        oracle_recording: Annotated[str, typer.Option(
            help="How the oracle gets each candidate split's expert access stream: 'dry' (replayed on the CPU "
                 "from the scheduler and the routing table; no engine run) or 'engine' (recorded on an engine "
                 "run, the replay compared with it and the result in the candidate's notes: the check).")] = "dry",
        gpus: Annotated[int, typer.Option(min=1, help="Spread the points over this many GPUs of this host: one bench "
                                                      "process per GPU, all writing the same JSON, one report at "
                                                      "the end (needs --device cuda).")] = 1,
        report: Annotated[bool, typer.Option(help="Write the Markdown and plots at the end (--no-report: rows "
                                                  "only, as each process of a --gpus sweep does).")] = True,
        repeats: Annotated[int | None, typer.Option(
            min=1, help="Runs of each policy at a point, in rounds of alternating order; the report shows each "
                        "policy's median run and every run's tok/s (default: the sweep's, 1; another "
                        "measurement, as --requests-per-batch).")] = None,
        planner_cores: Annotated[int | None, typer.Option(
            help="CPUs a live policy's controller process may run on beside the engine (0: all of them; default: "
                 "the sweep's, 4; it runs at a lower priority either way; another measurement, as "
                 "--requests-per-batch).")] = None,
        unmeasured: Annotated[bool, typer.Option(
            help="Run only the selected points that no row from this device holds yet, whatever its code (a "
                 "device's missing points first; one GPU: with --gpus N, list the points).")] = False,
        save_steps: Annotated[bool, typer.Option(
            help="Also keep every run's per-step records (gzip'd JSON lines, one file per process, beside the "
                 "JSON): for fitting the cost model or studying noise away from the device.")] = False,
        steps_report: Annotated[Path | None, typer.Option(
            help="Measure nothing: read every steps file under this folder (--save-steps' output, subfolders "
                 "too) and write phase_steps_report.md there: per run the decode cycles' mean, median, p90, "
                 "slowest; per policy run twice or more, whether its runs differ by a few slow steps or "
                 "throughout; and the cost model replayed over the steps (runs within 15 %).")] = None,
        queue: Annotated[Path | None, typer.Option(
            help="Take the points one at a time from this queue file instead of --points (how the workers of a "
                 "--gpus sweep share its points; the sweep writes the file).")] = None,
        deadline_s: Annotated[float | None, typer.Option(
            min=1.0, help="Start no point whose runs, timed at the nearest point this device measured (same batch "
                          "and context), would end past this many seconds from now: it is skipped and named, and a "
                          "rerun takes it up (a device call's timeout would cut it off and lose it).")] = None,
        merge: Annotated[list[Path] | None, typer.Option(
            help="Measure nothing: append the rows of this phase JSON (another call's copy, e.g. a device run's) "
                 "that the file of the same name in --out-dir lacks, and rewrite its report; repeatable.")] = None,
    ) -> None:
        """Every policy on the same engine, traces and budget: tok/s, TPOT, TTFT, stalls by cause, predicted vs
        measured step time; writes phase_<model>_<date>.json/.md/.png."""
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        err = Console(stderr=True, highlight=False)

        def fail(msg: str) -> None:
            err.print(f"error: {msg}", markup=False)
            raise typer.Exit(2)

        if steps_report is not None:
            from tierplan.bench.phase_steps_report import report as steps_md
            from tierplan.bench.phase_steps_report import steps_files

            files = steps_files(steps_report) if steps_report.is_dir() else []
            if not files:
                fail(f"--steps-report {steps_report}: no phase_*_steps_*.jsonl.gz under it (a folder that "
                     "`tierplan bench phase --save-steps` wrote to)")
            try:
                text = steps_md(files)
            except ValueError as exc:
                fail(str(exc))
            target = steps_report / "phase_steps_report.md"
            target.write_text(text)
            summary = next((x for x in text.splitlines() if x.startswith("Policies run")), text.splitlines()[2])
            err.print(f"{target} ({len(files)} steps file(s)): {summary}", markup=False)
            return
        if merge:
            from tierplan.bench.phase import merge_results

            try:
                for target, added in merge_results(out_dir, list(merge)):
                    err.print(f"{target}: {added} row(s) added; report rewritten", markup=False)
            except ValueError as exc:
                fail(str(exc))
            return
        if queue is not None and (points or gpus > 1):
            fail(f"--queue {queue}: the points come from the queue; leave out --points and --gpus")
        if queue is not None and not queue.is_file():
            fail(f"--queue {queue}: no such file (a --gpus sweep writes it: phase_queue.json in its --out-dir)")
        if unmeasured and gpus > 1:
            fail(f"--unmeasured selects points on one GPU; with --gpus {gpus}, list them with --points")
        if device not in ("cpu", "cuda"):
            fail(f"--device {device!r}: expected cpu or cuda")
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                fail(f"--device cuda: torch {torch.__version__} sees no CUDA device here "
                     "(torch.cuda.is_available() is False); run with --device cpu")
        from tierplan.bench.phase import OracleRecording, run_phase_bench

        recordings = {r.value: r for r in OracleRecording}
        if oracle_recording not in recordings:
            fail(f"--oracle-recording {oracle_recording!r}: expected one of {', '.join(map(repr, recordings))}")
        from tierplan.controller.protocol import ProtocolError
        from tierplan.runtime.errors import ConfigError

        if gpus > 1:
            if device != "cuda":
                fail(f"--gpus {gpus} spreads the sweep over GPUs: it needs --device cuda")
            import torch

            if torch.cuda.device_count() < gpus:
                fail(f"--gpus {gpus}: torch sees {torch.cuda.device_count()} CUDA device(s) here")
            try:
                failed = sharded(err, out_dir, gpus, "cuda", quick, points, policies, models, fresh,
                                 requests_per_batch, oracle_recording, report, save_steps, repeats, deadline_s,
                                 planner_cores)
            except ValueError as exc:
                fail(str(exc))
            if failed:
                raise typer.Exit(1)
            return

        bar = Progress(TextColumn("phase"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), console=err,
                       disable=not sys.stderr.isatty())
        task: dict[str, Any] = {}

        def on_total(n: int) -> None:
            task["id"] = bar.add_task("phase", total=n)

        try:
            with bar:
                run_phase_bench(out_dir, device, quick=quick, point_spec=points, policies=_split(policies),
                                models=_split(models), fresh=fresh, console=bar.console,
                                progress=lambda n: bar.advance(task["id"], n), on_total=on_total,
                                requests_per_batch=requests_per_batch,
                                oracle_recording=recordings[oracle_recording], report=report,
                                save_steps=save_steps, repeats=repeats, queue=queue, deadline_s=deadline_s,
                                planner_cores=planner_cores, unmeasured=unmeasured)
        except (ValueError, ConfigError, ProtocolError) as exc:
            fail(str(exc))


def sharded(err: Any, out_dir: Path, gpus: int, device: str, quick: bool, points: str, policies: str, models: str,
            fresh: bool, requests_per_batch: float | None, oracle_recording: str, report: bool,
            save_steps: bool = False, repeats: int | None = None, deadline_s: float | None = None,
            planner_cores: int | None = None) -> bool:
    """`--gpus N`: the sweep's points over N worker processes, one per GPU on `device` "cuda" (on "cpu" the
    same workers without GPUs: the CPU test of this path), then one report. True if a worker failed (its rows
    stay: a rerun resumes). ValueError for a bad option, before any worker starts. `deadline_s` is each
    worker's, less the time spent here before they start."""
    import time

    from tierplan.bench.phase import sweep_grid, write_reports
    from tierplan.bench.phase_shards import run_workers

    t0 = time.perf_counter()
    sizes, grid = sweep_grid(quick, points, _split(policies), _split(models), requests_per_batch, repeats,
                             planner_cores)
    day = time.strftime("%Y%m%d")  # the workers' JSON is named by the day they start (before midnight, say)
    args = ["--device", device, "--oracle-recording", oracle_recording, *(["--quick"] if quick else []),
            *(["--fresh"] if fresh else []), *(["--save-steps"] if save_steps else []),
            *(["--policies", policies] if policies else []),
            *(["--models", models] if models else []),
            *(["--requests-per-batch", str(requests_per_batch)] if requests_per_batch is not None else []),
            *(["--repeats", str(repeats)] if repeats is not None else []),
            *(["--planner-cores", str(planner_cores)] if planner_cores is not None else []),
            *(["--deadline-s", f"{max(1.0, deadline_s - (time.perf_counter() - t0)):.1f}"]
              if deadline_s is not None else [])]
    err.print(f"phase: {len(grid)} point(s) over {gpus} worker(s); each one's output in {out_dir}/phase_worker*.log",
              markup=False)

    def done(r: Any) -> None:
        state = "done" if r.returncode == 0 else f"FAILED (exit code {r.returncode})"
        err.print(f"worker {r.index} (GPU {r.device}, {len(r.points)} point(s)) {state}: {r.last_line}", markup=False)

    results = run_workers(grid, gpus, args, out_dir, cuda=device == "cuda", on_done=done)
    if report:
        models_run = list(dict.fromkeys(p.model for p in grid))
        written = write_reports(out_dir, models_run, sizes, day)
        for m in models_run:
            err.print(f"{m}: report from {written[m]}" if m in written else f"{m}: no rows to report", markup=False)
    return any(r.returncode for r in results)
