"""`tierplan sidecar`: run the sidecar beside an inference server until SIGINT/SIGTERM (the user's process).

Checks every option before anything starts (bad input: `error: ...` on stderr, exit 2, nothing bound), then
builds `SidecarSettings` and runs `agent.sidecar.Sidecar`, printing one line when it listens (socket path,
metrics URL, service URL) and the accounting when it stops. The token comes from `--token` or
`TIERPLAN_TOKEN`. Heavy modules are imported inside the command; nothing at import.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

import typer

MAX_UNIX_PATH_BYTES = 107  # sun_path is 108 bytes on Linux, one for the terminating NUL


class BadOption(ValueError):
    pass


def check_service_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadOption(f"--service {url!r}: expected the controller service's base URL, e.g. http://127.0.0.1:8321")
    try:
        parts.port  # noqa: B018 - raises for a port out of range
    except ValueError as exc:
        raise BadOption(f"--service {url!r}: {exc}; expected a port from 1 to 65535") from None
    if parts.query or parts.fragment:
        raise BadOption(f"--service {url!r}: has a query or fragment; expected only scheme://host[:port][/prefix]")
    return url


def check_socket_path(path: str) -> str:
    where = Path(path).expanduser()
    if len(os.fsencode(str(where))) > MAX_UNIX_PATH_BYTES:
        raise BadOption(f"--socket {path}: {len(os.fsencode(str(where)))} bytes long; a unix socket path must be "
                        f"at most {MAX_UNIX_PATH_BYTES} bytes (pick a shorter folder)")
    if where.is_dir():
        raise BadOption(f"--socket {path}: is a folder; expected the socket file's path, e.g. {where}/tierplan.sock")
    parent = where.parent
    if not parent.is_dir():
        raise BadOption(f"--socket {path}: folder {parent} does not exist; expected an existing folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise BadOption(f"--socket {path}: folder {parent} is not writable; expected one you can write")
    return str(where)


def check_settings(flush_s: float, plan_ttl_s: float, poll_s: float, metrics_port: int) -> None:
    if not flush_s > 0 or flush_s > 3600:
        raise BadOption(f"--flush-s {flush_s}: expected seconds between batch flushes, above 0 and at most 3600")
    if not poll_s > 0 or poll_s > 3600:
        raise BadOption(f"--poll-s {poll_s}: expected seconds between plan polls, above 0 and at most 3600")
    if not plan_ttl_s >= 0 or plan_ttl_s > 7 * 86400:
        raise BadOption(f"--plan-ttl-s {plan_ttl_s}: expected seconds from 0 to 604800 (how long the last good "
                        "plan is served while the service is unreachable)")
    if not 0 <= metrics_port <= 65535:
        raise BadOption(f"--metrics-port {metrics_port}: expected a TCP port from 0 (any free one) to 65535")


def check_limits(backoff_cap_s: float, max_queued_windows: int) -> None:
    if not 0.01 <= backoff_cap_s <= 3600:
        raise BadOption(f"--backoff-cap-s {backoff_cap_s}: expected seconds from 0.01 to 3600")
    if not 1 <= max_queued_windows <= 10_000_000:
        raise BadOption(f"--max-queued-windows {max_queued_windows}: expected a count from 1 to 10000000")


def register(app: typer.Typer) -> None:
    """Add `tierplan sidecar` to `app` (called at the bottom of api/cli.py)."""

    @app.command("sidecar")
    def sidecar(
        service: Annotated[str, typer.Option(help="The controller service's base URL, e.g. http://127.0.0.1:8321.")],
        socket_path: Annotated[str | None, typer.Option(
            "--socket", help="Unix socket the engine's agent connects to (default: $XDG_RUNTIME_DIR or the temp "
                             "folder, tierplan-<agent-id>.sock).")] = None,
        agent_id: Annotated[str, typer.Option(help="Names the default socket path only.")] = "agent-0",
        token: Annotated[str | None, typer.Option(
            help="Bearer token with write scope (default: $TIERPLAN_TOKEN).", envvar="TIERPLAN_TOKEN")] = None,
        metrics_port: Annotated[int, typer.Option(help="Port of the sidecar's /metrics (0: any free one).")] = 9464,
        metrics_host: Annotated[str, typer.Option(help="Address /metrics listens on.")] = "127.0.0.1",
        plan_ttl_s: Annotated[float, typer.Option(
            help="Seconds the last good plan is served while the service is unreachable; then the safe static "
                 "plan (keep what each agent applied).")] = 30.0,
        flush_s: Annotated[float, typer.Option(help="Seconds between telemetry batch flushes.")] = 1.0,
        poll_s: Annotated[float, typer.Option(help="Seconds between plan polls.")] = 1.0,
        backoff_cap_s: Annotated[float, typer.Option(
            help="Longest wait between retries to an unreachable service (full jitter below it).")] = 10.0,
        max_queued_windows: Annotated[int, typer.Option(
            help="Telemetry windows held while the service is away; beyond it the oldest are dropped "
                 "(counted).")] = 16384,
    ) -> None:
        """Run the sidecar: agent socket in, controller service over HTTP, fail-static when it is unreachable."""
        from tierplan.agent.sidecar import Sidecar, SidecarSettings, default_socket_path

        try:
            check_service_url(service)
            path = check_socket_path(socket_path or default_socket_path(agent_id))
            check_settings(flush_s, plan_ttl_s, poll_s, metrics_port)
            check_limits(backoff_cap_s, max_queued_windows)
        except BadOption as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        settings = SidecarSettings(service_url=service, socket_path=path, token=token or None,
                                   metrics_port=metrics_port, metrics_host=metrics_host, plan_ttl_s=plan_ttl_s,
                                   flush_s=flush_s, poll_s=poll_s, backoff_cap_s=backoff_cap_s,
                                   backoff_base_s=min(0.2, backoff_cap_s), max_queued_windows=max_queued_windows)
        car = Sidecar(settings)
        try:
            car.start()
        except OSError as exc:
            typer.echo(f"error: cannot listen ({exc}); expected a free --socket path and --metrics-port", err=True)
            raise typer.Exit(2) from None
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        typer.echo(f"sidecar: agents on {path}, metrics on http://{metrics_host}:{car.metrics_port}/metrics, "
                   f"service {service}")
        sys.stdout.flush()
        while not stop.wait(0.5):  # a timeout so a signal is handled promptly whatever the platform
            pass
        car.stop()
        typer.echo(f"sidecar: stopped {json.dumps(car.stats(), sort_keys=True)}")
