"""The sidecar's HTTP client for the controller service (httpx; the `/v1` API of the service contract).

Runs in the sidecar process, on its uplink thread only. One method per call the sidecar makes; each returns
the parsed answer or raises one of two errors: `ServiceUnavailable` (no usable answer: connect error, timeout,
a broken response, 5xx: retry later with backoff; `maybe_delivered` says whether the service may have acted
on it anyway) or `ServiceRefused` (a 4xx: the same request will be refused again, so it is not retried).
The transport comes in through the constructor (httpx.MockTransport in tests). It must never retry or sleep
itself (the uplink owns the schedule) nor run on an agent-facing thread.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

import httpx

from tierplan.controller.protocol import Plan, PlanAck, ProtocolError, ProtocolModel, parse
from tierplan.controller.protocol_service import AgentRegistration, AgentStatus, IngestResult, PlanRecord

M = TypeVar("M", bound=ProtocolModel)


class ErrorKind(StrEnum):  # `kind` label of tierplan_sidecar_service_errors_total
    CONNECT = "connect"
    TIMEOUT = "timeout"
    BROKEN = "broken"  # the connection dropped mid-exchange, or the answer was not the message expected
    HTTP_5XX = "http_5xx"
    HTTP_4XX = "http_4xx"


class ServiceUnavailable(Exception):
    def __init__(self, kind: ErrorKind, message: str, maybe_delivered: bool) -> None:
        super().__init__(message)
        self.kind, self.maybe_delivered = kind, maybe_delivered


class ServiceRefused(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status, self.detail = status, detail


class PollStatus(StrEnum):
    NEW = "new"  # 200: a plan record
    NOT_MODIFIED = "not_modified"  # 304: nothing newer than since_version / the ETag
    NO_PLAN = "no_plan"  # 204: nothing issued yet


@dataclass(frozen=True)
class PlanPoll:
    status: PollStatus
    plan: Plan | None = None
    etag: str | None = None


def _detail(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return resp.text[:500]
    return str(body.get("detail", body))[:500] if isinstance(body, dict) else str(body)[:500]


class ServiceClient:
    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 5.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s,
                                  transport=transport)

    def close(self) -> None:
        self._http.close()

    def register(self, reg: AgentRegistration) -> AgentStatus:
        return self._parse(AgentStatus, self._send("POST", "/v1/agents", reg.model_dump_json().encode()))

    def post_telemetry(self, batch_json: bytes) -> IngestResult:
        """`batch_json`: a TelemetryBatch as JSON bytes (the uplink joins the windows' own JSON texts)."""
        return self._parse(IngestResult, self._send("POST", "/v1/telemetry", batch_json))

    def post_ack(self, ack: PlanAck) -> PlanRecord:
        return self._parse(PlanRecord, self._send("POST", "/v1/acks", ack.model_dump_json().encode()))

    def get_plan(self, agent_id: str, since_version: int, etag: str | None = None) -> PlanPoll:
        headers = {"If-None-Match": etag} if etag else {}
        resp = self._send("GET", f"/v1/agents/{agent_id}/plan", None, params={"since_version": since_version},
                          headers=headers)
        if resp.status_code == 304:
            return PlanPoll(PollStatus.NOT_MODIFIED, etag=etag)
        if resp.status_code == 204:
            return PlanPoll(PollStatus.NO_PLAN)
        record = self._parse(PlanRecord, resp)
        return PlanPoll(PollStatus.NEW, record.plan, resp.headers.get("ETag"))

    def _send(self, method: str, path: str, body: bytes | None, params: dict[str, int] | None = None,
              headers: dict[str, str] | None = None) -> httpx.Response:
        hdrs = {"Content-Type": "application/json", **(headers or {})} if body is not None else (headers or {})
        try:
            resp = self._http.request(method, path, content=body, params=params, headers=hdrs)
        except httpx.ConnectError as exc:
            raise ServiceUnavailable(ErrorKind.CONNECT, f"{method} {path}: {exc}", maybe_delivered=False) from None
        except httpx.ConnectTimeout as exc:
            raise ServiceUnavailable(ErrorKind.TIMEOUT, f"{method} {path}: connect timed out ({exc})",
                                     maybe_delivered=False) from None
        except httpx.TimeoutException as exc:
            raise ServiceUnavailable(ErrorKind.TIMEOUT, f"{method} {path}: timed out ({exc})",
                                     maybe_delivered=True) from None
        except httpx.TransportError as exc:  # reset, closed mid-response, protocol error
            raise ServiceUnavailable(ErrorKind.BROKEN, f"{method} {path}: {type(exc).__name__}: {exc}",
                                     maybe_delivered=True) from None
        if resp.status_code >= 500:
            raise ServiceUnavailable(ErrorKind.HTTP_5XX, f"{method} {path}: HTTP {resp.status_code}: "
                                     f"{_detail(resp)}", maybe_delivered=True)
        if resp.status_code >= 400:
            raise ServiceRefused(resp.status_code, f"{method} {path}: {_detail(resp)}")
        return resp

    @staticmethod
    def _parse(kind: type[M], resp: httpx.Response) -> M:
        try:
            return parse(kind, resp.content)
        except ProtocolError as exc:
            raise ServiceUnavailable(ErrorKind.BROKEN, f"HTTP {resp.status_code} {resp.request.url.path}: {exc}",
                                     maybe_delivered=True) from None
