"""ASGI middleware of the controller service: the request body limit (413), the write-token gate (401/403) and
the HTTP request counter.

Runs in the service process, around the FastAPI app (`create_app` installs both). Pure ASGI, not
BaseHTTPMiddleware: a telemetry POST pays no extra task or body copy. `BodyLimit` refuses a declared
Content-Length over the limit before reading anything, and buffers a body sent without one (chunked) only
up to the limit. `WriteGate` checks the bearer token of every write (any method but GET/HEAD/OPTIONS) before
the body is even read, so a write without a token is 401/403 whatever its body holds (FastAPI would parse
the body first). `HttpMetrics` counts each request by its route template (never the raw path, whose
values are unbounded), method and status.
"""

from __future__ import annotations

import json
from typing import Any

import anyio.to_thread
from fastapi import HTTPException

from tierplan.api.auth import TokenAuth
from tierplan.api.db.errors import StoreError
from tierplan.api.service_metrics import ServiceMetrics

READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

Scope = dict[str, Any]


async def _reply(send: Any, code: int, detail: str, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": code,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *(extra or [])]})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    def __init__(self, app: Any, max_body_bytes: int) -> None:
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        headers = dict(scope.get("headers") or ())
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await _reply(send, 400, f"Content-Length: {declared[:40]!r} is not a number of bytes")
                return
            if size > limit:
                await _reply(send, 413, f"body: {size} bytes, over the limit of {limit} bytes")
                return
            await self.app(scope, receive, send)
            return
        if b"transfer-encoding" not in headers:
            await self.app(scope, receive, send)
            return
        body, more = bytearray(), True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > limit:
                await _reply(send, 413, f"body: over the limit of {limit} bytes (chunked)")
                return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class WriteGate:
    def __init__(self, app: Any, auth: TokenAuth) -> None:
        self.app, self.auth = app, auth

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method", "GET") not in READ_METHODS:
            header = dict(scope.get("headers") or ()).get(b"authorization")
            try:  # a cache miss reads the database: off the event loop
                await anyio.to_thread.run_sync(self.auth.writer, header.decode("latin-1") if header else None)
            except HTTPException as exc:
                extra = [(k.lower().encode(), v.encode()) for k, v in (exc.headers or {}).items()]
                await _reply(send, exc.status_code, str(exc.detail), extra)
                return
            except StoreError as exc:  # the token table could not be read: the service, not the client, failed
                await _reply(send, 503, f"database unavailable: {exc}", [(b"retry-after", b"1")])
                return
        await self.app(scope, receive, send)


class IngestFirst:
    """Holds `hub.busy()` over a whole telemetry POST (receiving, validating, storing, answering), so the planner
    thread defers its steps until the request is done (api/hub.py `yield_to_requests`)."""

    def __init__(self, app: Any, hub: Any, path: str = "/v1/telemetry") -> None:
        self.app, self.hub, self.path = app, hub, path

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path") == self.path and scope.get("method") == "POST":
            with self.hub.busy():
                await self.app(scope, receive, send)
            return
        await self.app(scope, receive, send)


class HttpMetrics:
    def __init__(self, app: Any, metrics: ServiceMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        code = [500]

        async def send_status(msg: dict[str, Any]) -> None:
            if msg["type"] == "http.response.start":
                code[0] = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.http.labels(route, scope.get("method", ""), str(code[0])).inc()
