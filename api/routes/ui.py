"""The decisions page: serves the static files under api/ui/ at `/ui` (the page itself reads the JSON API).

Runs in the controller service process (`create_app` includes `router`; `mount_ui(app)` does the same for
another app). The files are package data, found through importlib.resources so an installed wheel serves
them; only the files that exist in that folder are served, by name (no paths, so nothing outside it).
It must never read the database or compute anything about decisions: the page asks the JSON API like any
other client, so what it shows is what the API says.
"""

from __future__ import annotations

from importlib.resources import files
from importlib.resources.abc import Traversable

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

UI_PREFIX = "/ui"
REFRESH_S = 5.0  # how often the page re-reads the API
# Optional read endpoints the page uses when the service has them (path templates as in /openapi.json).
OPTIONAL_PATHS = {"windows": "/v1/agents/{agent_id}/windows"}
_CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
# The page changes with the package; the browser asks again each load (the files are a few KiB).
_NO_CACHE = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}

router = APIRouter(include_in_schema=False)


def _ui_dir() -> Traversable:
    return files("tierplan.api") / "ui"


def _static_file(name: str) -> Traversable | None:
    """The file `name` of the UI folder, or None: a bare file name with a known suffix that exists."""
    if "/" in name or "\\" in name or name.startswith("."):
        return None
    suffix = name[name.rfind("."):] if "." in name else ""
    if suffix not in _CONTENT_TYPES:
        return None
    entry = _ui_dir() / name
    return entry if entry.is_file() else None


@router.get(UI_PREFIX, response_class=HTMLResponse)
def ui_index() -> Response:
    """The decisions page."""
    entry = _static_file("index.html")
    if entry is None:  # a broken install, not a client error
        raise HTTPException(status_code=404, detail="ui: index.html is missing from the installed package")
    return HTMLResponse(entry.read_text(encoding="utf-8"), headers=_NO_CACHE)


@router.get(UI_PREFIX + "/")
def ui_index_slash() -> Response:
    """`/ui/` goes to `/ui`, so the page's relative links resolve one way."""
    return RedirectResponse(UI_PREFIX, status_code=307)


@router.get(UI_PREFIX + "/config.json")
def ui_config(request: Request) -> JSONResponse:
    """What the page needs to know about this service: how often to refresh, which optional read endpoints
    exist (so it never asks for one that would 404), and whether reads need a token."""
    paths = request.app.openapi().get("paths", {})  # public and cached, unlike the routers' internals
    settings = getattr(request.app.state, "settings", None)
    return JSONResponse({
        "refresh_s": REFRESH_S,
        "endpoints": {name: (path if path in paths else None) for name, path in OPTIONAL_PATHS.items()},
        "read_needs_token": bool(getattr(settings, "read_needs_token", False)),
    }, headers=_NO_CACHE)


@router.get(UI_PREFIX + "/static/{name}")
def ui_static(name: str) -> Response:
    """One of the page's files (a script or the style sheet), by bare name."""
    entry = _static_file(name)
    if entry is None:
        raise HTTPException(status_code=404, detail=f"ui: no file {name!r}; the page's files are "
                                                    f"{', '.join(sorted(_file_names()))}")
    suffix = name[name.rfind("."):]
    return Response(entry.read_bytes(), media_type=_CONTENT_TYPES[suffix], headers=_NO_CACHE)


def _file_names() -> list[str]:
    return [e.name for e in _ui_dir().iterdir() if e.is_file() and _static_file(e.name) is not None]


def mount_ui(app: FastAPI) -> None:
    """Serve the decisions page from `app` (what `create_app` does for the service)."""
    app.include_router(router)
