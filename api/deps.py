"""FastAPI dependencies of the controller service: the repository, the hub, the metrics and who is asking.

Read from `request.app.state` (set by `create_app`), so nothing here is global. `WriterDep` guards every
write endpoint (401/403 from api/auth.py); `ReaderDep` asks for a token only when `read_needs_token`.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from tierplan.api.auth import Principal, TokenAuth
from tierplan.api.db.repo import Repository
from tierplan.api.hub import ControllerHub
from tierplan.api.service_metrics import ServiceMetrics
from tierplan.api.settings import Settings

_bearer = HTTPBearer(auto_error=False, description="A token from `tierplan token create` (or TIERPLAN_TOKEN)")


def _repo(request: Request) -> Repository:
    return request.app.state.repo


def _hub(request: Request) -> ControllerHub:
    return request.app.state.hub


def _metrics(request: Request) -> ServiceMetrics:
    return request.app.state.metrics


def _settings(request: Request) -> Settings:
    return request.app.state.settings


def _header(creds: HTTPAuthorizationCredentials | None) -> str | None:
    return None if creds is None else f"{creds.scheme} {creds.credentials}"


def _writer(request: Request, creds: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]) -> Principal:
    auth: TokenAuth = request.app.state.auth
    return auth.writer(request.headers.get("authorization") if creds is None else _header(creds))


def _reader(request: Request, creds: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]
            ) -> Principal | None:
    if not request.app.state.settings.read_needs_token:
        return None
    auth: TokenAuth = request.app.state.auth
    return auth.principal(request.headers.get("authorization") if creds is None else _header(creds))


READS_GUARD = Depends(_reader)  # router dependency of every read endpoint
RepoDep = Annotated[Repository, Depends(_repo)]
HubDep = Annotated[ControllerHub, Depends(_hub)]
MetricsDep = Annotated[ServiceMetrics, Depends(_metrics)]
SettingsDep = Annotated[Settings, Depends(_settings)]
WriterDep = Annotated[Principal, Depends(_writer)]
ReaderDep = Annotated[Principal | None, Depends(_reader)]
