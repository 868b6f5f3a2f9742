// The decisions page's tables and status card, built from the JSON API's records (PlanRecord, DecisionRecord,
// PolicyRecord, AgentStatus in controller/protocol_service.py). Runs in the browser; writes text only through
// textContent (never HTML from the API), so a reason string cannot inject markup.

import { formatBytes, formatTime } from "./charts.js";

const LONG_TEXT_CHARS = 140;

function cell(row, value, className = "") {
  const td = document.createElement("td");
  if (value instanceof Node) td.appendChild(value); else td.textContent = value ?? "–";
  if (className) td.className = className;
  row.appendChild(td);
  return td;
}

function badge(text, kind = text) {
  const span = document.createElement("span");
  span.className = `badge badge-${kind}`;
  span.textContent = text;
  return span;
}

/** Long text (a plan's reason) as a one-line summary that opens to the whole of it. */
function longText(text) {
  if (!text || text.length <= LONG_TEXT_CHARS) {
    const span = document.createElement("span");
    span.textContent = text || "–";
    return span;
  }
  const details = document.createElement("details");
  const summary = document.createElement("summary");
  summary.textContent = `${text.slice(0, LONG_TEXT_CHARS)}…`;
  const full = document.createElement("p");
  full.textContent = text;
  details.append(summary, full);
  return details;
}

function fillBody(table, rows, emptyMessage, addRow) {
  const body = table.tBodies[0];
  body.replaceChildren();
  if (!rows.length) {
    const tr = body.insertRow();
    const td = cell(tr, emptyMessage, "muted");
    td.colSpan = table.tHead.rows[0].cells.length;
    return;
  }
  for (const row of rows) addRow(body.insertRow(), row);
}

export function ago(s, nowS = Date.now() / 1000) {
  if (s === null || s === undefined) return "never";
  const d = Math.max(0, nowS - s);
  if (d < 90) return `${Math.round(d)} s ago`;
  if (d < 5400) return `${Math.round(d / 60)} min ago`;
  if (d < 129600) return `${Math.round(d / 3600)} h ago`;
  return `${Math.round(d / 86400)} d ago`;
}

export function renderStatus(box, agent) {
  box.replaceChildren();
  const facts = [
    ["agent", agent.agent_id], ["rank", agent.rank], ["engine", agent.engine], ["model", agent.model],
    ["group", agent.group], ["state", badge(agent.state)], ["registered", ago(agent.registered_s)],
    ["last seen", ago(agent.last_seen_s)], ["windows", agent.windows],
    ["plan issued", agent.issued_version ? `v${agent.issued_version}` : "none"],
    ["plan applied", agent.applied_version ? `v${agent.applied_version}` : "none"],
  ];
  const list = document.createElement("dl");
  for (const [term, value] of facts) {
    const pair = document.createElement("div");
    const dt = document.createElement("dt");
    dt.textContent = term;
    const dd = document.createElement("dd");
    if (value instanceof Node) dd.appendChild(value); else dd.textContent = String(value);
    pair.append(dt, dd);
    list.appendChild(pair);
  }
  box.appendChild(list);
}

function ackText(record) {
  const ack = record.ack;
  if (!ack) return "";
  if (ack.status === "rejected") return `rejected by the agent (${ack.reason_code}): ${ack.reason}`;
  return `applied ${formatTime(ack.applied_s)}, footprint ${formatBytes(ack.footprint.total_hbm_bytes)}`;
}

/** Plan history, newest first: version, when, state (with the agent's ack), the split and the reason. */
export function renderPlans(table, records) {
  fillBody(table, records, "no plans issued yet", (tr, r) => {
    const p = r.plan;
    tr.dataset.version = p.version;
    cell(tr, `v${p.version}`, "num");
    cell(tr, formatTime(r.issued_s));
    const state = document.createElement("span");
    state.appendChild(badge(r.state));
    const ack = ackText(r);
    if (ack) state.title = ack;
    cell(tr, state);
    cell(tr, p.base_version ? `v${p.base_version}` : "–", "num");
    cell(tr, formatBytes(p.expert_bytes_per_layer.reduce((a, b) => a + b, 0)), "num");
    cell(tr, p.kv_blocks_per_tier.gpu ?? 0, "num");
    cell(tr, formatBytes(p.hbm_budget_bytes), "num");
    const why = r.state === "rejected" && ack ? `${ack}. Plan: ${p.reason}` : p.reason;
    cell(tr, longText(why), "reason");
  });
}

function ms(v) {
  return v === null || v === undefined ? "–" : v.toFixed(v >= 100 ? 0 : v >= 10 ? 1 : 2);
}

/** The newest decisions, issued or held, each with the cost model's prediction and the measured outcome. */
export function renderDecisions(table, decisions) {
  fillBody(table, decisions, "no decisions yet", (tr, d) => {
    cell(tr, formatTime(d.created_s));
    cell(tr, badge(d.outcome));
    cell(tr, `v${d.version}`, "num");
    cell(tr, d.window, "num");
    cell(tr, `v${d.policy_version}`, "num");
    cell(tr, ms(d.predicted_step_ms), "num");
    cell(tr, ms(d.measured_step_ms), "num");
    cell(tr, longText(d.reason), "reason");
  });
}

function knobText(value) {
  if (value === null || value === undefined) return "none";
  if (Array.isArray(value)) {
    if (!value.length) return "[]";
    return value.map((v) => (typeof v === "object" ? `L${v.layer}:E${v.expert}` : String(v))).join(" ");
  }
  return typeof value === "object" ? JSON.stringify(value) : String(value);
}

/** "knob: old → new" for each knob `newer` changed from `older` (all of them when there is no older). */
export function knobChanges(newer, older) {
  const out = [];
  for (const [key, value] of Object.entries(newer)) {
    if (!older) { out.push(`${key}=${knobText(value)}`); continue; }
    if (JSON.stringify(older[key]) !== JSON.stringify(value)) {
      out.push(`${key}: ${knobText(older[key])} → ${knobText(value)}`);
    }
  }
  return out;
}

/** Policy versions of the agent's group, newest first: who, why, and what each version changed. */
export function renderPolicies(table, records) {
  fillBody(table, records, "never changed: the group runs the built-in defaults (PUT /v1/policies/{group})",
    (tr, r) => {
      cell(tr, `v${r.version}`, "num");
      cell(tr, r.version ? formatTime(r.created_s) : "built in");
      cell(tr, r.author);
      cell(tr, longText(r.why), "reason");
      const older = records[records.indexOf(r) + 1];
      const changes = knobChanges(r.knobs, older ? older.knobs : null);
      const text = older ? (changes.length ? changes.join("; ") : "no knob changed")
        : `first recorded version: ${changes.join("; ")}`;
      cell(tr, longText(text), "reason");
    });
}
