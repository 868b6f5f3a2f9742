"""Pushes the tierplan dashboards to a running Grafana over its HTTP API (grafana-client), into one folder.

Runs in the user's shell (`tierplan dashboards push --url --token`). Talks only to the Grafana named; every
failure (unreachable, unauthorized, refused) comes back as a `PushError` with a message for a person, never a
traceback. Overwrites the dashboards of the same uid (a push is how an edited builder reaches Grafana).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError, GrafanaException, GrafanaUnauthorizedError

from tierplan.api.dashboards.export import all_dashboards

DEFAULT_FOLDER = "tierplan"
_TIMEOUT_S = 10.0
_FOLDER_UID = re.compile(r"[A-Za-z0-9_-]{1,40}")
_ERRNO = re.compile(r"\[Errno -?\d+\] ([^'\")]+)")


class PushError(Exception):
    """A push that did not happen, with what, where and what was expected."""


@dataclass(frozen=True)
class Pushed:
    """One dashboard Grafana accepted: its uid, the version Grafana now has and where to open it."""

    uid: str
    version: int
    url: str


def _check_url(url: str) -> None:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise PushError(f"--url {url!r}: expected http(s)://HOST[:PORT][/PATH] of a Grafana server")


def _describe(exc: Exception, url: str, what: str) -> PushError:
    if isinstance(exc, GrafanaUnauthorizedError):
        return PushError(f"Grafana at {url} refused the token while {what} (401 unauthorized); expected a service "
                         "account token with the Editor role")
    if isinstance(exc, GrafanaClientError) and exc.status_code == 403:
        return PushError(f"Grafana at {url} forbade {what} (403); the token's role must be allowed to write "
                         "dashboards and folders")
    if isinstance(exc, GrafanaException) and exc.status_code:
        return PushError(f"Grafana at {url} answered {exc.status_code} while {what}: {exc.message}")
    text = str(exc)  # the socket's reason, not the HTTP library's nested reprs
    errno, unresolved = _ERRNO.search(text), "Failed to resolve" in text or "NameResolution" in text
    reason = "host name does not resolve" if unresolved else errno.group(1) if errno else text
    return PushError(f"cannot reach Grafana at {url} while {what}: {reason}")


def _ensure_folder(api: GrafanaApi, folder_uid: str) -> None:
    try:
        api.folder.get_folder(folder_uid)
    except GrafanaClientError as exc:
        if exc.status_code != 404:
            raise
        api.folder.create_folder(folder_uid, uid=folder_uid)


def push_dashboards(url: str, token: str, folder_uid: str = DEFAULT_FOLDER) -> list[Pushed]:
    """Creates the folder if missing, then writes every dashboard into it (overwriting the same uid)."""
    _check_url(url)
    if not token.strip():
        raise PushError("--token is empty; expected a Grafana service account token")
    if not _FOLDER_UID.fullmatch(folder_uid):
        raise PushError(f"--folder {folder_uid!r}: expected a Grafana folder uid (1-40 of A-Z a-z 0-9 _ -)")
    api = GrafanaApi.from_url(url.rstrip("/"), credential=token, timeout=_TIMEOUT_S)
    what = f"looking up folder {folder_uid!r}"
    try:
        _ensure_folder(api, folder_uid)
        pushed = []
        for stem, data in all_dashboards().items():
            what = f"saving dashboard {stem!r}"
            body: dict[str, Any] = {"dashboard": {**data, "id": None}, "folderUid": folder_uid, "overwrite": True,
                                    "message": "tierplan dashboards push"}
            answer = api.dashboard.update_dashboard(body)
            if not isinstance(answer, dict):
                raise PushError(f"Grafana at {url} answered {answer!r} while {what}; expected a JSON object")
            pushed.append(Pushed(str(answer.get("uid", data["uid"])), int(answer.get("version", 0)),
                                 str(answer.get("url", ""))))
        return pushed
    except PushError:
        raise
    except (GrafanaException, OSError, ValueError) as exc:  # OSError: the HTTP library's connection errors
        raise _describe(exc, url, what) from exc
