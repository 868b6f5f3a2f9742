// Small SVG charts for the decisions page: stacked areas and lines over a time axis, with a hover readout.
// Runs in the browser only; draws what it is given and fetches nothing. No library: a few hundred lines of
// SVG are easier to keep than a vendored chart package, and the page needs no build step.

const SVG_NS = "http://www.w3.org/2000/svg";
const MIN_WIDTH = 320; // drawn at the container's pixel width, so text stays the CSS size in any column
const FALLBACK_WIDTH = 820;
const HEIGHT = 230;
const MARGIN = { top: 12, right: 16, bottom: 28, left: 72 };

// Distinct, colour-blind-friendlier hues (Okabe–Ito first, then Tableau-like extras).
export const PALETTE = ["#0072b2", "#56b4e9", "#009e73", "#cc79a7", "#999933", "#882255", "#44aa99",
  "#332288", "#88ccee", "#117733"];
export const KV_COLOUR = "#e69f00";
export const ACCENT_COLOUR = "#d55e00";

function el(name, attrs = {}, parent = null) {
  const node = document.createElementNS(SVG_NS, name);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
  if (parent) parent.appendChild(node);
  return node;
}

/** Round tick values from lo up to at least hi: about `count` steps of 1, 2 or 5 times a power of ten. */
export function niceTicks(lo, hi, count = 5) {
  if (!(hi > lo)) hi = lo + 1;
  const raw = (hi - lo) / count;
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw) ?? 10 * power;
  const ticks = [];
  const last = Math.ceil(hi / step - 1e-9) * step; // the top tick covers hi, so nothing is drawn off the chart
  for (let v = Math.ceil(lo / step) * step; v <= last + step * 1e-9; v += step) ticks.push(+v.toPrecision(12));
  return ticks;
}

const TIME_STEPS_S = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400];

/** Clock-friendly time ticks covering [lo, hi] (whole seconds, minutes, hours; decimal steps below 1 s). */
export function timeTicks(lo, hi, count = 5) {
  const raw = (hi - lo) / count;
  if (raw < 1) return niceTicks(lo, hi, count);
  const step = TIME_STEPS_S.find((t) => t >= raw) ?? Math.ceil(raw / 86400) * 86400;
  const ticks = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi; v += step) ticks.push(v);
  return ticks.length > 1 ? ticks : [lo, hi];
}

/** Byte ticks on binary units, so axis labels read 16 MiB rather than 16.8 MB. */
export function byteTicks(hi, count = 5) {
  if (!(hi > 0)) return [0];
  const unit = 1024 ** Math.max(0, Math.floor(Math.log(hi) / Math.log(1024)));
  return niceTicks(0, hi / unit, count).map((v) => v * unit);
}

export function formatBytes(n) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = Math.abs(n);
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  const digits = v >= 100 || i === 0 ? 0 : v >= 10 ? 1 : 2;
  return `${n < 0 ? "-" : ""}${v.toFixed(digits)} ${units[i]}`;
}

/** Local clock time of `s` (seconds since the epoch), with as many decimals as `resolutionS` needs. */
export function formatTime(s, resolutionS = 1) {
  const d = new Date(s * 1000);
  const pad = (v, n = 2) => String(v).padStart(n, "0");
  const hms = `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  const decimals = resolutionS >= 1 ? 0 : Math.min(3, Math.ceil(-Math.log10(resolutionS) - 1e-9));
  return decimals ? `${hms}.${pad(d.getMilliseconds(), 3).slice(0, decimals)}` : hms;
}

/** The x domain of a time series: from the first to the last x, widened when they coincide. A step chart
 *  also holds its last value for one typical interval, so the newest split has a visible width. */
function timeDomain(xs, holdLast) {
  const lo = xs[0];
  let hi = xs[xs.length - 1];
  if (holdLast && xs.length > 1) {
    const gaps = xs.slice(1).map((x, i) => x - xs[i]).filter((g) => g > 0).sort((a, b) => a - b);
    hi += gaps.length ? gaps[Math.floor(gaps.length / 2)] : 0;
  }
  if (!(hi > lo)) hi = lo + 1;
  return [lo, hi];
}

function scaler(d0, d1, r0, r1) {
  const k = (r1 - r0) / (d1 - d0 || 1);
  return (v) => r0 + (v - d0) * k;
}

function frame(container, { xs, xDomain, yTicks, yFormat, label }) {
  container.replaceChildren();
  const width = Math.max(MIN_WIDTH, container.clientWidth || FALLBACK_WIDTH);
  const svg = el("svg", { viewBox: `0 0 ${width} ${HEIGHT}`, role: "img", "aria-label": label,
    preserveAspectRatio: "xMidYMid meet" }, container);
  const x = scaler(xDomain[0], xDomain[1], MARGIN.left, width - MARGIN.right);
  const yMax = yTicks[yTicks.length - 1] || 1;
  const y = scaler(0, yMax, HEIGHT - MARGIN.bottom, MARGIN.top);
  const axis = el("g", { class: "axis" }, svg);
  for (const t of yTicks) {
    el("line", { x1: MARGIN.left, x2: width - MARGIN.right, y1: y(t), y2: y(t), class: "grid" }, axis);
    el("text", { x: MARGIN.left - 6, y: y(t) + 4, "text-anchor": "end" }, axis).textContent = yFormat(t);
  }
  const allTicks = timeTicks(xDomain[0], xDomain[1], Math.max(2, Math.floor(width / 140)));
  const tickS = allTicks.length > 1 ? allTicks[1] - allTicks[0] : 1; // the labels' resolution
  for (const t of allTicks.filter((v) => v >= xDomain[0] && v <= xDomain[1])) {
    el("text", { x: x(t), y: HEIGHT - 8, "text-anchor": "middle" }, axis).textContent = formatTime(t, tickS);
  }
  const spanS = xDomain[1] - xDomain[0];
  el("line", { x1: MARGIN.left, x2: width - MARGIN.right, y1: y(0), y2: y(0), class: "baseline" }, axis);
  return { svg, x, y, xs, spanS, width };
}

function legend(container, items) {
  const box = document.createElement("div");
  box.className = "legend";
  for (const { name, colour, dashed } of items) {
    const item = document.createElement("span");
    const swatch = document.createElement("i");
    swatch.style.background = dashed ? "transparent" : colour;
    if (dashed) swatch.style.borderTop = `2px dashed ${colour}`;
    item.append(swatch, document.createTextNode(name));
    box.appendChild(item);
  }
  container.appendChild(box);
}

/** A readout under the chart that follows the pointer: the nearest x's values, described by `describe(i)`. */
function hover(container, f, describe) {
  const readout = document.createElement("div");
  readout.className = "readout muted";
  readout.textContent = "point at the chart for values";
  container.appendChild(readout);
  const cursor = el("line", { y1: MARGIN.top, y2: HEIGHT - MARGIN.bottom, class: "cursor", visibility: "hidden" },
    f.svg);
  const overlay = el("rect", { x: MARGIN.left, y: MARGIN.top, width: f.width - MARGIN.left - MARGIN.right,
    height: HEIGHT - MARGIN.top - MARGIN.bottom, fill: "transparent" }, f.svg);
  overlay.addEventListener("mousemove", (event) => {
    const box = f.svg.getBoundingClientRect();
    const px = ((event.clientX - box.left) / box.width) * f.width;
    let best = 0;
    f.xs.forEach((xv, i) => { if (Math.abs(f.x(xv) - px) < Math.abs(f.x(f.xs[best]) - px)) best = i; });
    cursor.setAttribute("x1", f.x(f.xs[best]));
    cursor.setAttribute("x2", f.x(f.xs[best]));
    cursor.setAttribute("visibility", "visible");
    readout.textContent = `${formatTime(f.xs[best], f.spanS < 20 ? 0.001 : 1)} · ${describe(best)}`;
  });
  overlay.addEventListener("mouseleave", () => cursor.setAttribute("visibility", "hidden"));
}

export function showEmpty(container, message) {
  container.replaceChildren();
  const p = document.createElement("p");
  p.className = "chart-empty muted";
  p.textContent = message;
  container.appendChild(p);
}

function pathOf(points) {
  return points.map(([px, py], i) => `${i ? "L" : "M"}${px.toFixed(1)},${py.toFixed(1)}`).join("");
}

/** Boundary points of one series over xs: a step curve (value holds until the next x) or straight lines. */
function curve(f, xs, values, step, endX) {
  const pts = [];
  values.forEach((v, i) => {
    pts.push([f.x(xs[i]), f.y(v)]);
    if (step) pts.push([f.x(i + 1 < xs.length ? xs[i + 1] : endX), f.y(v)]);
  });
  return pts;
}

/**
 * Stacked areas: `series` = [{name, colour, values}] (values aligned with `xs`, drawn bottom-up in order).
 * `step`: each value holds until the next x (a split holds until the next decision). `overlay`: an optional
 * dashed line [{name, colour, values}] drawn on top (e.g. the HBM budget). Areas are `path.area`.
 */
export function stackedArea(container, { xs, series, step = false, overlay = null, yFormat = String,
  format = yFormat, label = "chart", yTicks = null }) {
  if (!xs.length || !series.length) { showEmpty(container, "no data yet"); return; }
  const xDomain = timeDomain(xs, step);
  const totals = xs.map((_, i) => series.reduce((sum, s) => sum + (s.values[i] || 0), 0));
  const top = Math.max(...totals, ...(overlay ? overlay.flatMap((o) => o.values) : [0]));
  const f = frame(container, { xs, xDomain, yTicks: (yTicks || niceTicks)(0, top), yFormat, label });
  const below = xs.map(() => 0);
  const group = el("g", { class: "areas" }, f.svg);
  for (const s of series) {
    const lower = below.slice();
    s.values.forEach((v, i) => { below[i] += v || 0; });
    const upper = curve(f, xs, below, step, xDomain[1]);
    const base = curve(f, xs, lower, step, xDomain[1]).reverse();
    const area = el("path", { d: `${pathOf([...upper, ...base])}Z`, fill: s.colour, class: "area",
      "data-series": s.name }, group);
    el("title", {}, area).textContent = s.name;
  }
  for (const o of overlay || []) {
    el("path", { d: pathOf(curve(f, xs, o.values, step, xDomain[1])), stroke: o.colour, class: "overlay",
      "data-series": o.name }, f.svg);
  }
  legend(container, [...series.map((s) => ({ name: s.name, colour: s.colour })),
    ...(overlay || []).map((o) => ({ name: o.name, colour: o.colour, dashed: true }))]);
  hover(container, f, (i) => [...series, ...(overlay || [])]
    .map((s) => `${s.name} ${format(s.values[i])}`).join(" · ") + ` · total ${format(totals[i])}`);
}

/**
 * Lines over time: `series` = [{name, colour, values, dashed}] aligned with `xs`; a null value leaves a gap.
 * Points are drawn as dots so a single window still shows. Lines are `path.line`.
 */
export function lineChart(container, { xs, series, yFormat = String, format = yFormat, yMax = null,
  label = "chart" }) {
  const seen = series.flatMap((s) => s.values).filter((v) => v !== null && v !== undefined);
  if (!xs.length || !seen.length) { showEmpty(container, "no data yet"); return; }
  const top = yMax ?? Math.max(...seen);
  const f = frame(container, { xs, xDomain: timeDomain(xs, false), yTicks: niceTicks(0, top || 1), yFormat,
    label });
  for (const s of series) {
    const runs = [[]];
    s.values.forEach((v, i) => {
      if (v === null || v === undefined) { if (runs[runs.length - 1].length) runs.push([]); return; }
      runs[runs.length - 1].push([f.x(xs[i]), f.y(v)]);
    });
    for (const run of runs.filter((r) => r.length)) {
      el("path", { d: pathOf(run), stroke: s.colour, class: s.dashed ? "line dashed" : "line",
        "data-series": s.name }, f.svg);
      for (const [px, py] of run) el("circle", { cx: px, cy: py, r: 2.5, fill: s.colour, class: "dot" }, f.svg);
    }
  }
  legend(container, series.map((s) => ({ name: s.name, colour: s.colour, dashed: s.dashed })));
  hover(container, f, (i) => series.map((s) => `${s.name} ${format(s.values[i])}`).join(" · "));
}
