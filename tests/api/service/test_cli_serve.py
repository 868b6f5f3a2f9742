"""`tierplan token create` prints a token once and stores only its hash; `tierplan serve` refuses bad settings
and an unusable database with `error: ...` and exit 2 before uvicorn starts; a served process answers with
the token it was given (TIERPLAN_TOKEN)."""

from __future__ import annotations

from pathlib import Path

import httpx
from typer.testing import CliRunner

from tierplan.api.auth import hash_token
from tierplan.api.bench_api import serve_process
from tierplan.api.cli import app
from tierplan.api.db.engine import make_engine
from tierplan.api.db.repo import Repository, Scope
from tierplan.api.demo_loop import tiny_registration


def test_token_create_prints_the_token_once_and_stores_its_hash(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 't.db'}"
    out = CliRunner().invoke(app, ["token", "create", "--db", url, "--name", "ops", "--scope", "read"])
    assert out.exit_code == 0, out.output
    raw = out.stdout.strip()
    assert raw.startswith("tp_") and len(raw) > 30
    rec = Repository(make_engine(url)).token_by_hash(hash_token(raw))
    assert rec is not None and rec.name == "ops" and rec.scope is Scope.READ
    assert raw.encode() not in (tmp_path / "t.db").read_bytes()


def test_serve_refuses_bad_settings_and_databases(tmp_path: Path) -> None:
    runner = CliRunner()
    bad_url = runner.invoke(app, ["serve", "--db", "mysql://nowhere/x"])
    assert bad_url.exit_code == 2 and bad_url.stderr.startswith("error: --db"), bad_url.output
    bad_port = runner.invoke(app, ["serve", "--port", "70000"])
    assert bad_port.exit_code == 2
    bad_env = runner.invoke(app, ["serve", "--db", f"sqlite:///{tmp_path / 'x.db'}"],
                            env={"TIERPLAN_MAX_BODY_BYTES": "lots"})
    assert bad_env.exit_code == 2 and "max_body_bytes" in bad_env.stderr, bad_env.output
    name = runner.invoke(app, ["token", "create", "--db", f"sqlite:///{tmp_path / 'x.db'}", "--name", "a b"])
    assert name.exit_code == 2 and "--name" in name.stderr


def test_a_served_process_accepts_its_bootstrap_token(tmp_path: Path) -> None:
    with serve_process(f"sqlite:///{tmp_path / 's.db'}", "tp_bootstrap_for_test") as url:
        reg = tiny_registration().model_dump_json()
        ok = httpx.post(f"{url}/v1/agents", content=reg, headers={
            "Authorization": "Bearer tp_bootstrap_for_test", "Content-Type": "application/json"})
        assert ok.status_code == 201
        assert httpx.post(f"{url}/v1/agents", content=reg).status_code == 401
        assert httpx.get(f"{url}/readyz").json() == {"status": "ready"}


def test_the_ingest_bench_runs_end_to_end(tmp_path: Path) -> None:
    from tierplan.api.bench_api import run_ingest_bench

    r = run_ingest_bench(f"sqlite:///{tmp_path / 'b.db'}", num_batches=3, batch_windows=8, warmup_batches=1)
    assert r["windows_accepted"] == 24 and r["windows_rejected"] == 0 and r["posts_failed"] == 0
    assert r["batches"] == 3 and r["windows_per_s"] > 0 and r["direct_windows_per_s"] > 0
    assert set(r) >= {"post_ms_p50", "post_ms_p99", "post_ms_max", "meets_target", "service_to_direct"}
