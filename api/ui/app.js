// The decisions page: reads the controller service's JSON API (/v1) every few seconds and draws, for the
// selected agent, the HBM split over time, expert hit rate and stalls, predicted vs measured step time, the plan
// history, the decisions and the policy versions of its group. Runs in the browser; it only reads (GET), and
// it asks only for endpoints /ui/config.json says exist, so a working service never answers it with an error.

import { ACCENT_COLOUR, byteTicks, formatBytes, lineChart, showEmpty, stackedArea } from "./charts.js";
import { budgetSeries, hitRates, splitSeries, stallSeries } from "./series.js";
import { renderDecisions, renderPlans, renderPolicies, renderStatus } from "./tables.js";

const DECISIONS_SHOWN = 50; // rows of the decisions table; the charts use every decision fetched
const MIN_REFRESH_S = 1;
const MAX_DECISIONS = 1000; // the most GET /v1/decisions returns at once

/** How many decisions to fetch: a whole number in [1, MAX_DECISIONS], 300 when not given or not a number. */
function clampHistory(value) {
  const n = Math.floor(Number(value));
  return Number.isFinite(n) && n >= 1 ? Math.min(n, MAX_DECISIONS) : 300;
}
const PLANS_LIMIT = 50;
const POLICIES_LIMIT = 50;
const WINDOWS_LIMIT = 200;
const RESIZE_DEBOUNCE_MS = 200;
const TOKEN_KEY = "tierplan.read_token";

const $ = (id) => document.getElementById(id);

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function getJson(path) {
  const headers = { Accept: "application/json" };
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  let response;
  try {
    response = await fetch(path, { headers, cache: "no-store" });
  } catch (err) { // the network, not the page: the service is down or unreachable
    throw new ApiError(0, `GET ${path}: the service did not answer (${err.message})`);
  }
  if (!response.ok) {
    let detail = response.statusText;
    try { detail = (await response.json()).detail ?? detail; } catch { /* not JSON: keep the status text */ }
    throw new ApiError(response.status, `GET ${path}: ${response.status} ${JSON.stringify(detail)}`);
  }
  return response.json();
}

function drawSplit(decisions, plans) {
  const box = $("split-chart");
  if (!decisions.length) {
    showEmpty(box, "No decisions yet: the controller decides once this agent has sent telemetry windows "
      + "(every plan_every_windows windows of its group's policy).");
    return;
  }
  const budget = budgetSeries(decisions, plans);
  const overlay = budget ? [{ name: "plan HBM budget", colour: "#444", values: budget }] : null;
  stackedArea(box, { xs: decisions.map((d) => d.created_s), series: splitSeries(decisions), step: true, overlay,
    yFormat: formatBytes, yTicks: (_lo, hi) => byteTicks(hi), label: "HBM split over time" });
}

function drawStep(decisions) {
  const box = $("step-chart");
  if (!decisions.length) { showEmpty(box, "No decisions yet."); return; }
  const fmt = (v) => (v === null || v === undefined ? "–" : `${v.toFixed(2)} ms`);
  lineChart(box, { xs: decisions.map((d) => d.created_s), label: "step time", format: fmt,
    yFormat: (v) => `${+v.toPrecision(3)} ms`, series: [
      { name: "predicted", colour: "#0072b2", values: decisions.map((d) => d.predicted_step_ms), dashed: true },
      { name: "measured p50", colour: ACCENT_COLOUR, values: decisions.map((d) => d.measured_step_ms ?? null) },
    ] });
}

function drawWindows(windows, available) {
  const hitBox = $("hit-chart");
  const stallBox = $("stall-chart");
  if (!available) {
    const why = "This service does not serve telemetry windows to readers (GET /v1/agents/{id}/windows); "
      + "the last window's value is on /metrics as ";
    showEmpty(hitBox, `${why}tierplan_expert_hit_rate.`);
    showEmpty(stallBox, `${why}tierplan_stall_seconds_total{cause}.`);
    return;
  }
  if (!windows.length) {
    showEmpty(hitBox, "No telemetry windows yet.");
    showEmpty(stallBox, "No telemetry windows yet.");
    return;
  }
  const xs = windows.map((w) => w.window_end_s);
  lineChart(hitBox, { xs, yMax: 1, label: "expert hit rate", yFormat: (v) => `${Math.round(v * 100)}%`,
    format: (v) => (v === null || v === undefined ? "–" : `${(v * 100).toFixed(1)}%`),
    series: [{ name: "expert hit rate", colour: "#009e73", values: hitRates(windows) }] });
  stackedArea(stallBox, { xs, label: "stalls by cause", yFormat: (v) => `${+v.toPrecision(3)} ms`,
    format: (v) => `${(v || 0).toFixed(2)} ms`, series: stallSeries(windows) });
}

class Page {
  constructor() {
    this.config = { refresh_s: 5, endpoints: {}, read_needs_token: false };
    const query = new URLSearchParams(location.search);
    this.agentId = query.get("agent");
    this.refreshOverride = Number(query.get("refresh_s")) || null; // ?refresh_s=N: an operator's own pace
    this.history = clampHistory(query.get("history"));
    this.timer = null;
    this.busy = false;
    this.last = null; // the newest answers of the API, drawn again on resize
  }

  async start() {
    $("agent").addEventListener("change", (event) => { this.select({ agent: event.target.value }); });
    if (![...$("history").options].some((o) => o.value === String(this.history))) {
      $("history").add(new Option(`last ${this.history} decisions`, String(this.history)));
    }
    $("history").value = String(this.history);
    $("history").addEventListener("change", (event) => { this.select({ history: event.target.value }); });
    $("token-form").addEventListener("submit", (event) => {
      event.preventDefault();
      sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
      $("token").value = "";
      this.refresh();
    });
    document.addEventListener("visibilitychange", () => { if (!document.hidden) this.refresh(); });
    let resizeTimer = null;
    window.addEventListener("resize", () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(() => this.draw(), RESIZE_DEBOUNCE_MS);
    });
    try {
      this.config = { ...this.config, ...(await getJson("/ui/config.json")) };
    } catch (err) {
      this.showError(`Could not read the page's settings (${err.message}); using defaults.`);
    }
    if (this.refreshOverride) this.config.refresh_s = Math.max(MIN_REFRESH_S, this.refreshOverride);
    if (this.config.read_needs_token && !sessionStorage.getItem(TOKEN_KEY)) {
      $("token-box").hidden = false;
      $("refresh").textContent = "waiting for a read token";
      return;
    }
    await this.refresh();
  }

  /** A choice in the header (`{agent}` or `{history}`), kept in the address so a link shows the same. */
  select(choice) {
    if (choice.agent !== undefined) this.agentId = choice.agent;
    if (choice.history !== undefined) this.history = clampHistory(choice.history);
    const url = new URL(location.href);
    for (const [key, value] of Object.entries(choice)) url.searchParams.set(key, value);
    window.history.replaceState(null, "", url);
    this.refresh();
  }

  schedule() {
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.refresh(), this.config.refresh_s * 1000);
  }

  showError(message) {
    $("error").textContent = message;
    $("error").hidden = !message;
  }

  async refresh() {
    if (this.busy || document.hidden) { this.schedule(); return; }
    this.busy = true;
    try {
      await this.load();
      this.showError("");
      $("refresh").textContent = `updated ${new Date().toLocaleTimeString()} · every ${this.config.refresh_s} s`;
    } catch (err) {
      if (!(err instanceof ApiError)) { // a bug in the page itself: say so, and let the console have it
        console.error(err);
        this.showError(`The page failed to draw the service's answer: ${err}. Please report it.`);
        $("refresh").textContent = "page error";
        return;
      }
      if (err.status === 401 || err.status === 403) {
        $("token-box").hidden = false;
        sessionStorage.removeItem(TOKEN_KEY);
      }
      this.showError(`The service did not answer as expected: ${err.message}. Retrying every `
        + `${this.config.refresh_s} s.`);
      $("refresh").textContent = "retrying";
    } finally {
      this.busy = false;
      this.schedule();
    }
  }

  async load() {
    const agents = await getJson("/v1/agents");
    $("token-box").hidden = true;
    this.fillAgents(agents);
    if (!agents.length) {
      this.last = null;
      $("main").hidden = true;
      $("empty").hidden = false;
      $("empty").textContent = "No agents have registered with this service yet. Start a sidecar beside an "
        + "inference server (tierplan sidecar --service URL), or run `make demo` to replay the bundled traces "
        + "through the CPU engine; agents appear here within a few seconds.";
      return;
    }
    $("empty").hidden = true;
    const agent = agents.find((a) => a.agent_id === this.agentId) ?? agents[0];
    this.agentId = agent.agent_id;
    $("agent").value = agent.agent_id;
    const id = encodeURIComponent(agent.agent_id);
    const group = encodeURIComponent(agent.group);
    const windowsPath = this.config.endpoints.windows;
    const [decisions, plans, policies, windows] = await Promise.all([
      getJson(`/v1/decisions?agent_id=${id}&limit=${this.history}`),
      getJson(`/v1/agents/${id}/plans?limit=${PLANS_LIMIT}`),
      getJson(`/v1/policies/${group}/history?limit=${POLICIES_LIMIT}`),
      windowsPath ? getJson(`${windowsPath.replace("{agent_id}", id)}?limit=${WINDOWS_LIMIT}`) : [],
    ]);
    $("main").hidden = false;
    this.last = { agent, decisions, plans, policies, windows, hasWindows: Boolean(windowsPath) };
    this.draw();
  }

  /** Everything for the selected agent from the last answers (again on resize: charts fit their width). */
  draw() {
    if (!this.last || $("main").hidden) return;
    const { agent, decisions, plans, policies, windows, hasWindows } = this.last;
    renderStatus($("agent-status"), agent);
    const oldestFirst = decisions.slice().sort((a, b) => a.created_s - b.created_s || a.id - b.id);
    drawSplit(oldestFirst, plans);
    drawStep(oldestFirst);
    drawWindows(windows.slice().sort((a, b) => a.window_end_s - b.window_end_s), hasWindows);
    renderPlans($("plans"), plans);
    renderDecisions($("decisions"), decisions.slice(0, DECISIONS_SHOWN));
    $("policy-group").textContent = `group ${agent.group}`;
    renderPolicies($("policies"), policies);
  }

  fillAgents(agents) {
    const select = $("agent");
    const options = agents.map((a) => {
      const option = document.createElement("option");
      option.value = a.agent_id;
      option.textContent = `${a.agent_id} · rank ${a.rank} · ${a.state}`;
      return option;
    });
    select.replaceChildren(...options);
    select.disabled = !agents.length;
  }
}

new Page().start();
