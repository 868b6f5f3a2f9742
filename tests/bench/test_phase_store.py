"""The phase JSON's store: what a rerun skips, which rows a report pairs, what the code id hashes, and that
writers sharing one file never lose a row."""

from __future__ import annotations

import multiprocessing
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tierplan.bench.phase_store import append_row, code_files, code_id, done_keys, latest, load_rows, write_rows


def _r(policy: str, status: str = "ok", point: str = "p", code: str = "new", **extra: Any) -> dict[str, Any]:
    return {"point": point, "policy": policy, "device": "cpu", "code": code, "status": status, **extra}


def test_error_and_refused_rows_are_retried_degraded_ones_are_results() -> None:
    rows = [_r("resident"), _r("tierplan", "degraded"), _r("mv_wsa", "error"), _r("fluxmoe", "refused"),
            _r("oracle", "candidate")]
    assert {k[1] for k in done_keys(rows)} == {"resident", "tierplan"}


def test_latest_pairs_rows_of_one_code_at_a_point() -> None:
    rows = [_r("resident", code="old"), _r("tierplan", code="old"), _r("resident", point="q", code="old"),
            _r("tierplan", code="new", decode_tok_s=1.0), _r("oracle", "candidate", code="new")]
    got = latest(rows, "cpu")
    # At p the newest row is new-code: old-code baselines there are left out; q has only old-code rows.
    assert sorted((r["point"], r["policy"], r["code"]) for r in got) == [("p", "tierplan", "new"),
                                                                         ("q", "resident", "old")]
    later = [*rows, _r("tierplan", "error", code="new")]
    # The newest run of a key is the one shown.
    assert [r["status"] for r in latest(later, "cpu") if r["point"] == "p"] == ["error"]


def test_a_policy_run_several_times_shows_its_median_run() -> None:
    """Repeats of one policy (`--repeats`) are runs of their own key; the report shows the median by tok/s (the
    lower middle of an even count, runs without a throughput only where none has one) and every run's tok/s."""
    rows = [_r("resident", decode_tok_s=10.0, repeat=0), _r("tierplan", decode_tok_s=5.0, repeat=0),
            _r("tierplan", decode_tok_s=9.0, repeat=1), _r("resident", decode_tok_s=30.0, repeat=1),
            _r("resident", decode_tok_s=20.0, repeat=2, tag="mid"), _r("tierplan", "error", repeat=2)]
    assert len(done_keys(rows)) == 5  # each repeat is a run; the error one runs again
    got = {r["policy"]: r for r in latest(rows, "cpu")}
    assert got["resident"]["tag"] == "mid" and got["resident"]["repeat_tok_s"] == [10.0, 20.0, 30.0]
    assert got["tierplan"]["decode_tok_s"] == 5.0 and got["tierplan"]["repeat_tok_s"] == [5.0, 9.0]
    # The policies keep the order their newest runs were written in; a single run is shown as it is.
    assert [r["policy"] for r in latest(rows, "cpu")] == ["resident", "tierplan"]
    assert "repeat_tok_s" not in latest([_r("resident", decode_tok_s=1.0)], "cpu")[0]
    failed = latest([_r("tierplan", "error", repeat=0), _r("tierplan", "refused", repeat=1)], "cpu")
    assert [r["status"] for r in failed] == ["refused"]


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


@pytest.mark.skipif(shutil.which("git") is None, reason="no git here")
def test_code_id_hashes_what_git_would_carry_never_ignored_build_files(tmp_path: Path) -> None:
    (tmp_path / "bench").mkdir()
    (tmp_path / "build" / "lib").mkdir(parents=True)
    (tmp_path / ".gitignore").write_text("build/\n")
    (tmp_path / "bench" / "a.py").write_text("x = 1\n")
    (tmp_path / "build" / "lib" / "stale.py").write_text("old = 1\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text("pass\n")
    no_git = code_id(root=tmp_path)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "bench/a.py", ".gitignore")
    assert code_files(tmp_path) == ["bench/a.py"]
    assert code_id(root=tmp_path) == no_git  # the device's copy (no .git) hashes the same files
    (tmp_path / "build" / "lib" / "stale.py").write_text("old = 2\n")
    (tmp_path / "tests" / "t.py").write_text("pass  # changed\n")
    assert code_id(root=tmp_path) == no_git
    shutil.rmtree(tmp_path / ".git")
    assert code_id(root=tmp_path) == no_git
    (tmp_path / "bench" / "a.py").write_text("x = 2\n")
    assert code_id(root=tmp_path) != no_git


def _append_many(path: str, who: int) -> None:
    for i in range(20):
        append_row(Path(path), _r(f"w{who}", point=f"p{i}"))


def test_writers_sharing_one_file_lose_no_row(tmp_path: Path) -> None:
    path = tmp_path / "phase_m_20000101.json"
    mine = [_r("resident")]
    write_rows(path, mine)
    append_row(path, _r("other"))  # another process wrote after this one read the file
    assert [r["policy"] for r in append_row(path, _r("tierplan"))] == ["resident", "other", "tierplan"]
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_append_many, args=(str(path), w)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    assert all(p.exitcode == 0 for p in procs)
    assert len(load_rows(path)) == 3 + 3 * 20


def test_a_new_file_starts_from_the_seed(tmp_path: Path) -> None:
    path = tmp_path / "phase_m_20000102.json"
    seed = [_r("resident", code="older-day")]
    assert append_row(path, _r("tierplan"), seed) == [*seed, _r("tierplan")]
    assert append_row(path, _r("oracle"), seed)[-2:] == [_r("tierplan"), _r("oracle")]


def test_merging_two_calls_from_one_start_keeps_every_row_once(tmp_path: Path) -> None:
    """Two calls that each started from the committed file (as runs 23 and 24 did) merge into it: the union,
    base first, then each call's own rows in its order; merging either again adds nothing."""
    from tierplan.bench.phase_store import merge_file

    base = [_r("resident", model="m", run_id="r0", when="1"), _r("tierplan", model="m", run_id="r0", when="2")]
    one = [*base, _r("mv_wsa", model="m", run_id="r1", when="3")]
    two = [*base, _r("resident", point="q", model="m", run_id="r2", when="3"),
           _r("resident", model="m", run_id="r2", when="4")]  # the same key measured again: another run
    target, a, b = tmp_path / "t" / "phase_m_1.json", tmp_path / "a.json", tmp_path / "b.json"
    write_rows(target, base)
    write_rows(a, one)
    write_rows(b, two)
    assert merge_file(target, b)[1] == 2 and merge_file(target, a)[1] == 1
    assert load_rows(target) == [*base, *two[2:], one[2]]
    assert merge_file(target, a)[1] == 0 and merge_file(target, b)[1] == 0 and len(load_rows(target)) == 5
    assert merge_file(tmp_path / "new.json", a)[1] == 3  # no file yet: the source's rows as they are


def test_a_merge_refuses_other_models_and_non_rows_naming_the_file(tmp_path: Path) -> None:
    from tierplan.bench.phase_store import merge_file

    target, other, mixed, bad = (tmp_path / n for n in ("t.json", "o.json", "x.json", "bad.json"))
    write_rows(target, [_r("resident", model="m")])
    write_rows(other, [_r("resident", model="n")])
    write_rows(mixed, [_r("resident", model="m"), _r("tierplan", model="n")])
    bad.write_text('{"rows": []}')
    before = target.read_text()
    with pytest.raises(ValueError, match=r"o\.json: rows of \['n'\], but .*t\.json holds \['m'\]"):
        merge_file(target, other)
    with pytest.raises(ValueError, match=r"x\.json: rows of several models \['m', 'n'\]"):
        merge_file(target, mixed)
    with pytest.raises(ValueError, match=r"bad\.json: expected a list of phase rows"):
        merge_file(target, bad)
    assert target.read_text() == before
