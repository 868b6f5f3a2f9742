"""The decisions page in headless Chromium against the development stand-in API (tests/api/ui/fake_api.py):
the empty state, a many-layer model's grouped split, and the router's file serving."""

from __future__ import annotations

import httpx
import pytest

from tests.api.ui.fake_api import fake_app, sample_records
from tests.api.ui.serve import browser, chromium_or_skip, serving

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_router_serves_the_page_files_and_refuses_others() -> None:
    with serving(fake_app(sample_records())) as base:
        page = httpx.get(f"{base}/ui")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert 'src="/ui/static/app.js"' in page.text
        for name, kind in (("app.js", "javascript"), ("charts.js", "javascript"), ("style.css", "css")):
            r = httpx.get(f"{base}/ui/static/{name}")
            assert r.status_code == 200 and kind in r.headers["content-type"], name
        for bad in ("../routes/ui.py", "..%2Fapp.py", "nope.js", "ui.py", ".hidden.js"):
            r = httpx.get(f"{base}/ui/static/{bad}")
            assert r.status_code == 404, bad
        config = httpx.get(f"{base}/ui/config.json").json()
        assert config["endpoints"] == {"windows": None}  # the stand-in serves no telemetry windows
        assert httpx.get(f"{base}/ui/", follow_redirects=False).status_code == 307


def test_empty_service_says_what_to_do() -> None:
    chromium_or_skip()
    records = {"agents": [], "decisions": {}, "plans": {}, "policies": {}}
    with serving(fake_app(records)) as base, browser() as b:
        b.page.goto(f"{base}/ui")
        b.page.wait_for_selector("#empty:not([hidden])")
        text = b.page.inner_text("#empty")
        assert "No agents" in text and "tierplan sidecar" in text and "make demo" in text
        assert b.page.is_hidden("#main")
        assert b.errors == []


def test_many_layers_are_grouped_and_every_record_is_shown() -> None:
    chromium_or_skip()
    records = sample_records(num_layers=48, num_decisions=12)
    with serving(fake_app(records)) as base, browser() as b:
        b.page.goto(f"{base}/ui?agent=agent-a")
        b.page.wait_for_selector("#plans tbody tr[data-version]")
        names = b.page.eval_on_selector_all("#split-chart path.area", "ps => ps.map(p => p.dataset.series)")
        assert len(names) == 8 + 1 and names[-1] == "KV cache on GPU"  # 8 layer groups + KV
        assert names[0] == "experts, MoE layers 0–5"
        assert b.page.locator("#plans tbody tr").count() == len(records["plans"]["agent-a"])
        assert b.page.locator("#decisions tbody tr").count() == 12
        assert b.page.locator("#policies tbody tr").count() == 2
        assert "hysteresis: 0.1 → 0.2" in b.page.inner_text("#policies")
        assert "rejected" in b.page.inner_text("#plans")
        assert b.page.locator("#step-chart path.line").count() == 2
        assert "GET /v1/agents/{id}/windows" in b.page.inner_text("#hit-chart")
        assert b.errors == []


def test_hit_rate_and_stalls_are_drawn_when_the_service_serves_windows() -> None:
    chromium_or_skip()
    with serving(fake_app(sample_records(), with_windows=True)) as base, browser() as b:
        assert httpx.get(f"{base}/ui/config.json").json()["endpoints"]["windows"] == "/v1/agents/{agent_id}/windows"
        b.page.goto(f"{base}/ui")
        b.page.wait_for_selector("#hit-chart path.line")
        assert b.page.locator("#hit-chart circle.dot").count() == 48  # one per window
        causes = b.page.eval_on_selector_all("#stall-chart path.area", "ps => ps.map(p => p.dataset.series)")
        assert causes == ["expert miss stall ms", "kv miss stall ms", "both stall ms"]
        assert b.errors == []
