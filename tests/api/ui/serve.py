"""Test helpers for the decisions page: an app served by uvicorn on a free loopback port in a thread, and a
headless Chromium (Debian's /usr/bin/chromium through Playwright) that records every console error.

Runs in the pytest process only. It never downloads a browser: without the system Chromium the tests skip.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn

CHROMIUM = Path("/usr/bin/chromium")
START_TIMEOUT_S = 20.0
WAIT_MS = 15_000  # what a page wait may take before the test fails (the page draws in well under a second)


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """Serve `app` on 127.0.0.1 (a free port) for the block; yields the base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="ui-test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=START_TIMEOUT_S)


@dataclass
class Browser:
    """A page plus what went wrong in it: console errors, uncaught exceptions and HTTP error responses."""

    page: Any
    errors: list[str] = field(default_factory=list)


def chromium_or_skip() -> Path:
    if not CHROMIUM.exists() and shutil.which("chromium") is None:
        pytest.skip(f"no system Chromium at {CHROMIUM} (Debian package 'chromium'; .ci/system-deps.sh installs "
                    "it); the page test never downloads a browser")
    return CHROMIUM if CHROMIUM.exists() else Path(shutil.which("chromium") or "")


@contextmanager
def browser() -> Iterator[Browser]:
    """A fresh headless Chromium page that records console errors and page errors."""
    from playwright.sync_api import sync_playwright

    executable = chromium_or_skip()
    with sync_playwright() as pw:
        chrome = pw.chromium.launch(executable_path=str(executable), headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = chrome.new_page(viewport={"width": 1280, "height": 1000})
            page.set_default_timeout(WAIT_MS)
            out = Browser(page)
            page.on("console", lambda msg: out.errors.append(f"console: {msg.text}")
                    if msg.type == "error" else None)
            page.on("pageerror", lambda exc: out.errors.append(f"page error: {exc}"))
            page.on("response", lambda r: out.errors.append(f"http {r.status}: {r.url}") if r.status >= 400 else None)
            yield out
        finally:
            chrome.close()
