"""The processes of the end-to-end observability test: `tierplan serve` on SQLite and `tierplan sidecar`, each a
real subprocess on free ports with its log in the test's tmp dir (api/stack.py starts and stops them).

Test code (the pytest process owns them). Only 127.0.0.1 is bound; each is stopped on teardown (`Proc.stop`).
"""

from __future__ import annotations

from pathlib import Path

from tierplan.api.stack import Proc
from tierplan.api.stack import start_service as _start_service
from tierplan.api.stack import start_sidecar as _start_sidecar


def start_service(workdir: Path, port: int, token: str) -> Proc:
    """`tierplan serve` on a SQLite file in `workdir`, the bootstrap write token from TIERPLAN_TOKEN."""
    return _start_service(f"sqlite:///{workdir / 'tierplan.db'}", token, workdir, port=port, timeout_s=60.0).proc


def start_sidecar(workdir: Path, service_url: str, socket_path: str, metrics_port: int, token: str) -> Proc:
    """`tierplan sidecar` beside the engine: its unix socket, short flush and poll intervals, its /metrics."""
    return _start_sidecar(service_url, Path(socket_path), token, workdir, metrics_port,
                          extra_args=("--flush-s", "0.05", "--poll-s", "0.1"), timeout_s=60.0).proc
