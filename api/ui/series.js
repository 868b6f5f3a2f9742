// Chart series from the JSON API's records (pure functions: no DOM, no fetch), for the decisions page and for
// the tests that check the arithmetic in the browser. Runs in the browser.

import { ACCENT_COLOUR, KV_COLOUR, PALETTE } from "./charts.js";

export const MAX_LAYER_SERIES = 8; // more MoE layers than this are summed into this many contiguous groups
export const STALL_COLOURS = { expert_miss: "#0072b2", kv_miss: KV_COLOUR, both: ACCENT_COLOUR };

const sum = (values) => values.reduce((a, b) => a + b, 0);

/** Layer groups for the split chart: one per MoE layer, or MAX_LAYER_SERIES contiguous runs of them. */
export function layerGroups(numLayers) {
  const count = Math.min(numLayers, MAX_LAYER_SERIES);
  const groups = [];
  for (let g = 0; g < count; g += 1) {
    const lo = Math.floor((g * numLayers) / count);
    const hi = Math.floor(((g + 1) * numLayers) / count) - 1;
    groups.push({ lo, hi, name: lo === hi ? `experts, MoE layer ${lo}` : `experts, MoE layers ${lo}–${hi}` });
  }
  return groups;
}

/** Series of the split chart from decisions (oldest first): expert bytes per layer group, then KV GPU bytes.
 *  A layer's bytes are its share of the split's expert bytes by slots (every slot is the same size). */
export function splitSeries(decisions) {
  const numLayers = Math.max(0, ...decisions.map((d) => d.split.expert_slots_per_layer.length));
  const groups = layerGroups(numLayers);
  const series = groups.map((g, k) => ({ name: g.name, colour: PALETTE[k % PALETTE.length], values: [] }));
  for (const d of decisions) {
    const slots = d.split.expert_slots_per_layer;
    const total = sum(slots);
    groups.forEach((g, k) => {
      series[k].values.push(total ? (d.split.expert_bytes * sum(slots.slice(g.lo, g.hi + 1))) / total : 0);
    });
  }
  series.push({ name: "KV cache on GPU", colour: KV_COLOUR, values: decisions.map((d) => d.split.kv_gpu_bytes) });
  return series;
}

/** Each decision's HBM budget, from the plan it issued or kept; decisions whose plan is older than the plans
 *  fetched take the oldest budget known. Null when no decision's plan is among `plans`. */
export function budgetSeries(decisions, plans) {
  const budgetOf = new Map(plans.map((r) => [r.plan.version, r.plan.hbm_budget_bytes]));
  let last = null;
  const budget = decisions.map((d) => { last = budgetOf.get(d.version) ?? last; return last; });
  let known = null;
  for (let i = budget.length - 1; i >= 0; i -= 1) {
    if (budget[i] === null) budget[i] = known; else known = budget[i];
  }
  return budget.every((b) => b !== null) ? budget : null;
}

/** Expert hit rate per telemetry window (null for a window that touched no expert). */
export function hitRates(windows) {
  return windows.map((w) => {
    const seen = w.expert_hits + w.expert_misses;
    return seen ? w.expert_hits / seen : null;
  });
}

/** Stall milliseconds per window, one series per cause (StallCause values), for a stacked area. */
export function stallSeries(windows) {
  return Object.entries(STALL_COLOURS).map(([cause, colour]) => ({
    name: `${cause.replace("_", " ")} stall ms`, colour,
    values: windows.map((w) => sum(w.stalls.filter((s) => s.cause === cause).map((s) => s.total_ms))),
  }));
}
