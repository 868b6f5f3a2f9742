"""`tierplan sidecar` refuses bad options with `error: ...` naming the option and what was expected (exit 2),
before it binds anything; a socket path that is taken is refused the same way."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tierplan.api.cli import app

runner = CliRunner()


def refused(args: list[str], *says: str) -> None:
    r = runner.invoke(app, ["sidecar", *args])
    out = " ".join(re.sub("[│╭╮╰╯─]", " ", r.output).split())
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
    for s in says:
        assert s in out, out


@pytest.mark.parametrize("url,says", [("ftp://host", "--service 'ftp://host'"), ("localhost:8321", "base URL"),
                                      ("http://h:99999", "port from 1 to 65535"), ("http://h/?q=1", "query")])
def test_a_bad_service_url(tmp_path: Path, url: str, says: str) -> None:
    refused(["--service", url, "--socket", str(tmp_path / "s.sock")], "error:", says)


def test_bad_socket_paths(tmp_path: Path) -> None:
    svc = ["--service", "http://127.0.0.1:8321"]
    refused([*svc, "--socket", str(tmp_path / "missing" / "s.sock")], "error: --socket", "does not exist")
    refused([*svc, "--socket", str(tmp_path)], "is a folder")
    refused([*svc, "--socket", str(tmp_path / ("x" * 120))], "at most 107 bytes")


@pytest.mark.parametrize("opt,value,says", [("--flush-s", "0", "--flush-s 0.0"), ("--poll-s", "-1", "--poll-s"),
                                            ("--plan-ttl-s", "-5", "--plan-ttl-s -5.0"),
                                            ("--metrics-port", "70000", "--metrics-port 70000"),
                                            ("--backoff-cap-s", "0", "--backoff-cap-s 0.0"),
                                            ("--max-queued-windows", "0", "--max-queued-windows 0")])
def test_bad_numbers(tmp_path: Path, opt: str, value: str, says: str) -> None:
    refused(["--service", "http://127.0.0.1:8321", "--socket", str(tmp_path / "s.sock"), opt, value], "error:", says)


def test_a_taken_socket_path_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "live.sock"
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(path))
    live.listen(1)
    try:
        refused(["--service", "http://127.0.0.1:8321", "--socket", str(path), "--metrics-port", "0"],
                "error: cannot listen", "another process is listening")
    finally:
        live.close()
