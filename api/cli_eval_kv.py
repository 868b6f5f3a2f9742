"""`tierplan eval kv-reuse`: KV prefix-reuse scorers on a Mooncake request trace.

Runs in the user's shell. Heavy modules are imported inside the command.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    """Add this module's command(s) to `app` (called from api.cli.main)."""
    app.command("kv-reuse")(eval_kv_reuse)


def eval_kv_reuse(
    trace: Annotated[Path, typer.Option(help="Mooncake request trace (jsonl: timestamp ms, input_length, "
                                             "output_length, hash_ids).")],
    horizon_min: Annotated[float, typer.Option(help="A block counts as reused if accessed again within N minutes.")],
    scorers: Annotated[str, typer.Option(help="Comma-separated scorers (default: all): count, recency, logistic, "
                                              "lightgbm, logistic_online.")] = "",
    json_out: Annotated[bool, typer.Option("--json", help="Last stdout line: one JSON object {scorer: auc}.")] = False,
) -> None:
    """AUC of KV block reuse scorers: train on the first half of the trace in time, test on the second."""
    from rich.table import Table

    from tierplan.api.cli import _io, _progress
    from tierplan.controller.eval.kv_reuse import DEFAULT_SCORERS, EvalError, evaluate_kv_reuse, progress_total
    from tierplan.controller.requests_jsonl import TraceError, load_request_trace

    def fail(message: str) -> None:
        typer.echo(f"error: {message}", err=True)  # one unwrapped line, whatever the terminal width
        raise typer.Exit(2)

    if not (math.isfinite(horizon_min) and horizon_min > 0):
        fail(f"--horizon-min must be a positive number of minutes, got {horizon_min!r}")
    names = tuple(s.strip() for s in scorers.split(",") if s.strip()) or DEFAULT_SCORERS
    bad = [s for s in names if s not in DEFAULT_SCORERS]
    if bad:
        fail(f"--scorers: unknown scorer(s) {bad}; expected some of {', '.join(DEFAULT_SCORERS)}")
    try:
        requests = load_request_trace(trace)
        with _progress("kv-reuse", progress_total(requests, names)) as tick:
            report = evaluate_kv_reuse(requests, horizon_min * 60.0, names, progress=tick)
    except (TraceError, EvalError) as exc:
        fail(str(exc))
        return
    _io.out.print(requests.summary(), markup=False)
    table = Table(title=f"KV block reuse within {horizon_min:g} min: AUC on the second half ({report.num_test} "
                        f"events, {report.num_test_reused / report.num_test:.1%} reused)")
    table.add_column("scorer")
    table.add_column("AUC", justify="right")
    for name, value in report.auc.items():
        table.add_row(name, f"{value:.3f}")
    _io.out.print(table)
    _io.out.print(f"Dynamo KVBM freq>=2 rule: precision {report.kvbm_freq2_precision:.2f} at recall "
                  f"{report.kvbm_freq2_recall:.2f}", markup=False)
    _io.out.print(f"events: {report.num_events} total, {report.num_train} train ({report.num_train_reused} reused), "
                  f"{report.num_test} test; excluded: {report.num_excluded_end} whose horizon runs past the trace "
                  f"end, {report.num_excluded_crossing} first-half events whose horizon crosses the middle",
                  markup=False)
    for note in report.notes:
        _io.out.print(note, markup=False)
    if json_out:
        _io.out.print(json.dumps({name: round(value, 6) for name, value in report.auc.items()}), markup=False,
                      highlight=False, soft_wrap=True)
