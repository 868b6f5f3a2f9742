"""The decisions page in headless Chromium against the stand-in read API (tests/api/ui/fake_api.py): the empty
state, a many-layer model's grouped split, the optional telemetry charts, a read token, markup in a reason, the
series arithmetic, and the router's file serving. The real service's test is test_page_service.py."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

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


def test_split_series_arithmetic_in_the_browser() -> None:
    chromium_or_skip()
    with serving(fake_app(sample_records())) as base, browser() as b:
        b.page.goto(f"{base}/ui")
        got = b.page.evaluate("""async () => {
            const s = await import("/ui/static/series.js");
            const d = {version: 2, split: {expert_slots_per_layer: [3, 1, 0], expert_bytes: 4000, kv_gpu_bytes: 96}};
            const groups = s.layerGroups(48);
            return {
                split: s.splitSeries([d]).map(x => x.values[0]),
                groups: groups.map(g => [g.lo, g.hi]),
                budget: s.budgetSeries([{version: 1}, d], [{plan: {version: 2, hbm_budget_bytes: 5000}}]),
                none: s.budgetSeries([d], []),
                hits: s.hitRates([{expert_hits: 3, expert_misses: 1}, {expert_hits: 0, expert_misses: 0}]),
            };
        }""")
        assert got["split"] == [3000, 1000, 0, 96]  # each layer's share of the expert bytes by slots, then KV
        assert got["groups"] == [[6 * g, 6 * g + 5] for g in range(8)]  # 48 layers in 8 contiguous groups
        assert got["budget"] == [5000, 5000] and got["none"] is None
        assert got["hits"] == [0.75, None]
        assert b.errors == []


def test_reasons_with_markup_are_shown_as_text() -> None:
    chromium_or_skip()
    records = sample_records()
    newest = records["plans"]["agent-a"][0]
    evil = "<img src=x onerror=\"document.title='owned'\"> <b>bold</b>"
    records["plans"]["agent-a"][0] = newest.model_copy(update={"plan": newest.plan.model_copy(update={"reason": evil})})
    with serving(fake_app(records)) as base, browser() as b:
        b.page.goto(f"{base}/ui")
        b.page.wait_for_selector("#plans tbody tr[data-version]")
        assert b.page.locator("#plans img, #plans b").count() == 0
        assert evil in b.page.inner_text("#plans")
        assert b.page.title() != "owned"
        assert b.errors == []


def test_a_read_token_is_asked_for_and_then_used() -> None:
    chromium_or_skip()
    with serving(fake_app(sample_records(), read_token="s3cret")) as base, browser() as b:
        assert httpx.get(f"{base}/v1/agents").status_code == 401
        b.page.goto(f"{base}/ui")
        b.page.wait_for_selector("#token-box:not([hidden])")
        assert b.page.is_hidden("#main")
        b.page.fill("#token", "s3cret")
        b.page.click("#token-form button")
        b.page.wait_for_selector("#plans tbody tr[data-version]")
        assert b.page.is_hidden("#token-box")
        assert b.errors == []  # the page asked for nothing before it had the token


def test_time_axis_ticks_fall_on_clock_steps() -> None:
    chromium_or_skip()
    with serving(fake_app(sample_records())) as base, browser() as b:
        b.page.goto(f"{base}/ui")
        got = b.page.evaluate("""async () => {
            const c = await import("/ui/static/charts.js");
            return {hour: c.timeTicks(1000, 1000 + 3 * 3600, 6), short: c.timeTicks(10, 12, 4),
                    label: c.formatTime(0.25, 0.5), whole: c.formatTime(0.25, 1), ms: c.formatTime(0.25, 0.001)};
        }""")
        assert all(t % 1800 == 0 for t in got["hour"]) and len(got["hour"]) >= 5  # every 30 min
        assert got["short"] == [10, 10.5, 11, 11.5, 12]
        assert got["label"].endswith(".2") and got["ms"].endswith(".250") and "." not in got["whole"]
        assert b.errors == []


def test_switching_agents_and_picking_up_new_plans_without_a_reload() -> None:
    chromium_or_skip()
    records = sample_records("agent-a", num_decisions=12)
    other = sample_records("agent-b", num_decisions=4)
    records["agents"] += other["agents"]
    records["decisions"].update(other["decisions"])
    records["plans"].update(other["plans"])
    with serving(fake_app(records)) as base, browser() as b:
        b.page.goto(f"{base}/ui?refresh_s=1")
        b.page.wait_for_selector("#plans tbody tr[data-version]")
        assert b.page.input_value("#agent") == "agent-a"  # the first agent when none is named
        b.page.select_option("#agent", "agent-b")
        b.page.wait_for_function("document.querySelectorAll('#decisions tbody tr').length === 4")
        assert "agent=agent-b" in b.page.url
        assert b.page.locator("#plans tbody tr").count() == len(other["plans"]["agent-b"])
        # a new plan for agent-b appears on the next refresh, with no reload
        newest = records["plans"]["agent-b"][0]
        plan = newest.plan.model_copy(update={"version": newest.plan.version + 1, "reason": "a fresh plan"})
        records["plans"]["agent-b"].insert(0, newest.model_copy(update={"plan": plan}))
        b.page.wait_for_selector(f"#plans tbody tr[data-version='{plan.version}']")
        assert "a fresh plan" in b.page.inner_text("#plans")
        assert b.errors == []


def test_history_asks_for_that_many_decisions_within_the_apis_limit() -> None:
    chromium_or_skip()
    with serving(fake_app(sample_records(num_decisions=12))) as base, browser() as b:
        asked: list[str] = []
        b.page.on("request", lambda r: asked.append(r.url) if "/v1/decisions" in r.url else None)
        b.page.goto(f"{base}/ui?history=5000")
        b.page.wait_for_selector("#plans tbody tr[data-version]")
        assert asked and all(re.search(r"limit=1000(&|$)", url) for url in asked)
        with b.page.expect_request(lambda r: re.search(r"/v1/decisions\?.*limit=100(&|$)", r.url)):
            b.page.select_option("#history", "100")
        assert "history=100" in b.page.url
        assert b.errors == []


def test_every_page_file_is_package_data() -> None:
    """An installed wheel serves the page only if pyproject's package-data names each of its files."""
    root = Path(__file__).resolve().parents[3]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["tierplan.api"]
    files = sorted(p.relative_to(root / "api").as_posix() for p in (root / "api" / "ui").iterdir() if p.is_file())
    assert "ui/index.html" in files
    assert [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)] == []
