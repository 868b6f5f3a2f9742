"""`tierplan dashboards push` against a small local HTTP server that records requests and answers like Grafana.

No Grafana server is packaged for this machine (not in Debian, PyPI or npm as a runnable server), so the
stand-in speaks the few endpoints push uses: GET/POST /api/folders, POST /api/dashboards/db, with bearer-token
checks. The story: a good token creates the folder once and saves both dashboards; a wrong token, a closed
port, a refusing server each end in `error: ...` and exit 2.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.api.obs.prom import free_port
from tierplan.api.cli import app
from tierplan.api.dashboards.export import all_dashboards

TOKEN = "glsa_good"


class _FakeGrafana(ThreadingHTTPServer):
    def __init__(self, port: int, status_override: int | None = None) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.requests: list[dict[str, Any]] = []
        self.folders: set[str] = set()
        self.versions: dict[str, int] = {}
        self.status_override = status_override


class _Handler(BaseHTTPRequestHandler):
    server: _FakeGrafana

    def log_message(self, *args: Any) -> None:  # keep pytest's output clean
        pass

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _handle(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.server.requests.append({"method": method, "path": self.path, "auth": self.headers.get("Authorization"),
                                     "body": body})
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._answer(401, {"message": "invalid API key"})
        if self.server.status_override:
            return self._answer(self.server.status_override, {"message": "permission denied"})
        if method == "GET" and self.path.startswith("/api/folders/"):
            uid = self.path.rsplit("/", 1)[1]
            if uid in self.server.folders:
                return self._answer(200, {"uid": uid, "title": uid})
            return self._answer(404, {"message": "folder not found"})
        if method == "POST" and self.path == "/api/folders":
            self.server.folders.add(body["uid"])
            return self._answer(200, {"uid": body["uid"], "title": body["title"]})
        if method == "POST" and self.path == "/api/dashboards/db":
            uid = body["dashboard"]["uid"]
            if body.get("folderUid") not in self.server.folders:
                return self._answer(400, {"message": "folder not found"})
            self.server.versions[uid] = self.server.versions.get(uid, 0) + 1
            return self._answer(200, {"status": "success", "uid": uid, "version": self.server.versions[uid],
                                      "url": f"/d/{uid}/x"})
        return self._answer(404, {"message": "not found"})

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")


def _serving(status_override: int | None = None) -> Iterator[_FakeGrafana]:
    server = _FakeGrafana(free_port(), status_override)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def grafana() -> Iterator[_FakeGrafana]:
    yield from _serving()


@pytest.fixture
def forbidding() -> Iterator[_FakeGrafana]:
    yield from _serving(403)


def _push(server: _FakeGrafana, token: str = TOKEN, *extra: str) -> Any:
    url = f"http://127.0.0.1:{server.server_address[1]}"
    return CliRunner().invoke(app, ["dashboards", "push", "--url", url, "--token", token, *extra])


def test_push_creates_the_folder_once_and_saves_every_dashboard(grafana: _FakeGrafana) -> None:
    result = _push(grafana)
    assert result.exit_code == 0, result.output
    assert "tierplan-overview: version 1" in result.output and "tierplan-service: version 1" in result.output
    saved = [r for r in grafana.requests if r["path"] == "/api/dashboards/db"]
    assert all(r["auth"] == f"Bearer {TOKEN}" for r in grafana.requests)
    assert [r["body"]["dashboard"]["uid"] for r in saved] == ["tierplan-overview", "tierplan-service"]
    assert all(r["body"]["overwrite"] is True and r["body"]["folderUid"] == "tierplan" for r in saved)
    overview = all_dashboards()["tierplan-overview"]
    assert saved[0]["body"]["dashboard"] == {**overview, "id": None}

    again = _push(grafana)
    assert again.exit_code == 0 and "tierplan-overview: version 2" in again.output
    assert len([r for r in grafana.requests if r["path"] == "/api/folders"]) == 1


def test_push_into_another_folder(grafana: _FakeGrafana) -> None:
    result = _push(grafana, TOKEN, "--folder", "inference")
    assert result.exit_code == 0, result.output
    assert grafana.folders == {"inference"}


def test_a_wrong_token_is_refused_without_a_traceback(grafana: _FakeGrafana) -> None:
    result = _push(grafana, "glsa_wrong")
    assert result.exit_code == 2
    assert "error: Grafana at http://127.0.0.1:" in result.output and "401 unauthorized" in result.output
    assert "Traceback" not in result.output
    assert [r["path"] for r in grafana.requests] == ["/api/folders/tierplan"]  # stopped at the first refusal


def test_a_forbidding_grafana_says_so(forbidding: _FakeGrafana) -> None:
    result = _push(forbidding)
    assert result.exit_code == 2 and "forbade looking up folder 'tierplan' (403)" in result.output


def test_an_unreachable_grafana_is_a_clear_error() -> None:
    result = CliRunner().invoke(app, ["dashboards", "push", "--url", f"http://127.0.0.1:{free_port()}",
                                      "--token", TOKEN])
    assert result.exit_code == 2
    assert "error: cannot reach Grafana at http://127.0.0.1:" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("args", "message"), [
    (["--url", "localhost:3000", "--token", TOKEN], "--url 'localhost:3000': expected http(s)://"),
    (["--url", "http://127.0.0.1:1", "--token", " "], "--token is empty"),
    (["--url", "http://127.0.0.1:1"], "--token missing"),
    (["--url", "http://127.0.0.1:1", "--token", TOKEN, "--folder", "a/b"], "--folder 'a/b': expected a Grafana"),
])
def test_bad_arguments_are_named(args: list[str], message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRAFANA_TOKEN", raising=False)
    result = CliRunner().invoke(app, ["dashboards", "push", *args])
    assert result.exit_code == 2 and f"error: {message}" in result.output
