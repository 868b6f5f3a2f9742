"""`tierplan bench api`: telemetry ingest of the controller service on loopback, SQLite and PostgreSQL.

Runs in the user's shell. For each database it starts `tierplan serve` as a real subprocess, POSTs batches of
telemetry windows shaped like the tiny engine's (api/bench_api.py), and compares the service's rate with the
same batches stored straight through a Repository in this process (the baseline, in the same run). Writes
`api_ingest.json`, `.md` and `.png` to the output folder. `--db sqlite` (a fresh file) and `--db postgresql`
(a throwaway server started from the distribution's binaries, removed afterwards) are built in; any other
value is a SQLAlchemy URL of a database you provide (its tables are created by the service's migrations).
It reports against the target (>= 2,000 windows/s, p99 <= 20 ms per POST); it never asserts.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
BUILTIN = ("sqlite", "postgresql")


@contextmanager
def _database(kind: str, tmp: Path) -> Iterator[str]:
    """A database URL for `kind`: a fresh SQLite file, a throwaway PostgreSQL, or the URL given."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp / 'bench.db'}"
    elif kind == "postgresql":
        from tierplan.api.db.throwaway_pg import create_database, start_cluster

        cluster = start_cluster()
        if cluster is None:
            raise typer.BadParameter("no PostgreSQL binaries found (Debian: apt-get install postgresql); give a "
                                     "URL of your own server instead", param_hint="--db")
        try:
            yield create_database(cluster.url(), prefix="bench")
        finally:
            cluster.stop()
    else:
        if "://" not in kind:
            raise typer.BadParameter(f"{kind!r}: expected 'sqlite', 'postgresql' or a SQLAlchemy URL "
                                     "(e.g. postgresql+psycopg://user@host/db)", param_hint="--db")
        yield kind


def _markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| database | windows/s | p50 ms | p99 ms | max ms | direct windows/s | service / direct | "
            "target met |\n|---|---|---|---|---|---|---|---|\n")
    body = "".join(f"| {r['db']} | {r['windows_per_s']:.0f} | {r['post_ms_p50']:.2f} | {r['post_ms_p99']:.2f} | "
                   f"{r['post_ms_max']:.2f} | {r['direct_windows_per_s']:.0f} | {r['service_to_direct']:.2f} | "
                   f"{'yes' if r['meets_target'] else 'no'} |\n" for r in rows)
    r0 = rows[0]
    return (f"# Telemetry ingest on loopback\n\n{r0['batches']} POSTs of {r0['batch_windows']} windows per database, "
            f"{r0['clients']} client(s), {r0['cpu_count']} CPUs; target >= {r0['target_windows_per_s']:.0f} "
            f"windows/s with p99 <= {r0['target_p99_ms']:.0f} ms per POST. 'direct' is the same batches parsed "
            "and stored through a Repository in the bench's process (no HTTP), measured in the same run.\n\n"
            + head + body)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["db"] for r in rows]
    a.bar(names, [r["windows_per_s"] for r in rows], label="service")
    a.plot(names, [r["direct_windows_per_s"] for r in rows], "k_", markersize=30, label="direct (no HTTP)")
    a.axhline(rows[0]["target_windows_per_s"], color="r", linestyle="--", label="target")
    a.set_ylabel("windows / s")
    a.legend(fontsize=8)
    b.bar(names, [r["post_ms_p99"] for r in rows], label="p99")
    b.bar(names, [r["post_ms_p50"] for r in rows], label="p50")
    b.axhline(rows[0]["target_p99_ms"], color="r", linestyle="--", label="p99 target")
    b.set_ylabel("ms per POST")
    b.legend(fontsize=8)
    fig.suptitle("tierplan serve: telemetry ingest on loopback")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def register(bench_app: typer.Typer) -> None:
    """Add `api` to the `bench` group (called at the bottom of api/cli.py)."""

    @bench_app.command("api")
    def bench_api(
        db: Annotated[list[str] | None, typer.Option(
            help="'sqlite', 'postgresql' (a throwaway server) or a SQLAlchemy URL; repeat for several.")] = None,
        batches: Annotated[int, typer.Option(min=10, max=100_000, help="Timed POSTs per database.")] = 200,
        batch_windows: Annotated[int, typer.Option(min=1, max=256, help="Windows per POST.")] = 64,
        clients: Annotated[int, typer.Option(min=1, max=64, help="Agents posting at once.")] = 1,
        out_dir: Annotated[Path, typer.Option(help="Where the JSON, Markdown and PNG go.")] = RESULTS,
    ) -> None:
        """Telemetry ingest of `tierplan serve` on loopback against the target (2,000 windows/s, p99 20 ms)."""
        from rich.console import Console

        from tierplan.api.bench_api import run_ingest_bench

        console = Console(stderr=True)
        kinds = db or list(BUILTIN)
        rows: list[dict[str, Any]] = []
        with tempfile.TemporaryDirectory(prefix="tierplan-bench-api-") as tmp:
            for kind in kinds:
                with _database(kind, Path(tmp)) as url:
                    console.print(f"bench api: {kind}: {batches} POSTs of {batch_windows} windows ...")
                    row = run_ingest_bench(url, num_batches=batches, batch_windows=batch_windows, clients=clients)
                    row["db"] = kind if kind in BUILTIN else row["db"]
                    rows.append(row)
                    console.print(f"  {row['windows_per_s']:.0f} windows/s, p99 {row['post_ms_p99']:.2f} ms, "
                                  f"{row['service_to_direct']:.2f} of direct")
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "api_ingest.json").write_text(json.dumps(rows, indent=1) + "\n")
        md = _markdown(rows)
        (out_dir / "api_ingest.md").write_text(md)
        _plot(rows, out_dir / "api_ingest.png")
        typer.echo(md)
