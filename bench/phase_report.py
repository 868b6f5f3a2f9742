"""The phase diagram's Markdown and plots, from the rows of one model on one device.

Runs in the bench process after a sweep (and on every rerun: the report is rebuilt from the JSON). Per point:
tierplan's tok/s over the best non-oracle baseline's and over the oracle's, the Acceptance targets reported met /
not met, and where tierplan falls short of the best baseline the cause the stall breakdown names (prediction,
split, link contention or engine overhead). Plots: tok/s against batch (one panel per context x budget, one line
per policy) and the winning policy over batch x context (one panel per budget). Ratios are within one run of
the sweep; it never hard-codes a figure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ORACLE, TIERPLAN = "oracle", "tierplan"
PRED_TOLERANCE = 0.15


def _ok(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("status") == "ok" and r.get("decode_tok_s")]


def _by_point(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["point"], {})[r["policy"]] = r
    return out


def _budget(r: dict[str, Any]) -> str:
    return f"{r['hbm_budget_gib']:g} GiB" if r.get("budget_frac") is None else f"{r['budget_frac']:g}x need"


def _cause(tp: dict[str, Any], best: dict[str, Any]) -> str:
    """What the stall breakdown says about tierplan's shortfall against `best`."""
    pred = tp.get("predicted_over_measured")
    exp_tp, exp_b = tp["stall_ms_expert"] + tp["stall_ms_both"], best["stall_ms_expert"] + best["stall_ms_both"]
    kv_tp, kv_b = tp["stall_ms_kv"] + tp["stall_ms_both"], best["stall_ms_kv"] + best["stall_ms_both"]
    step = tp["measured_step_ms"] or 0.0
    h2d = (tp.get("link_bytes") or {}).get("h2d", 0)
    if exp_tp > exp_b + 0.1 * step:
        why = f"split: experts short (expert stall {exp_tp:.2f} vs {exp_b:.2f} ms/step)"
    elif kv_tp > kv_b + 0.1 * step:
        why = f"split: KV short (KV stall {kv_tp:.2f} vs {kv_b:.2f} ms/step)"
    elif tp.get("preemptions", 0) > best.get("preemptions", 0):
        why = f"split: KV short ({tp['preemptions']} vs {best['preemptions']} preemptions)"
    else:
        why = (f"engine overhead (stalls alike, step {step:.2f} vs {best['measured_step_ms']:.2f} ms; "
               f"{h2d / max(1, tp.get('measured_steps') or 1) / 2**20:.1f} MiB h2d per step)")
    if pred is not None and abs(pred - 1) > PRED_TOLERANCE:
        why += f"; prediction off by {pred - 1:+.0%}"
    return why


def summarize(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per point: tierplan / best non-oracle baseline and / oracle (tok/s); and the Acceptance targets."""
    per: list[dict[str, Any]] = []
    for key, pol in _by_point(_ok(rows)).items():
        others = {k: v for k, v in pol.items() if k not in (ORACLE, TIERPLAN)}
        best = max(others.values(), key=lambda r: r["decode_tok_s"]) if others else None
        tp, orc = pol.get(TIERPLAN), pol.get(ORACLE)
        any_r = next(iter(pol.values()))
        per.append({
            "point": key, "batch": any_r["batch"], "context": any_r["context"], "budget": _budget(any_r),
            "best": best["policy"] if best else None, "best_tok_s": best["decode_tok_s"] if best else None,
            "tierplan_tok_s": tp["decode_tok_s"] if tp else None, "oracle_tok_s": orc["decode_tok_s"] if orc else None,
            "vs_best": tp["decode_tok_s"] / best["decode_tok_s"] if tp and best else None,
            "vs_oracle": tp["decode_tok_s"] / orc["decode_tok_s"] if tp and orc else None,
            "oracle_over_tierplan_step": (orc["measured_step_ms"] / tp["measured_step_ms"]
                                          if tp and orc and tp["measured_step_ms"] else None),
            "cause": _cause(tp, best) if tp and best and tp["decode_tok_s"] < 0.95 * best["decode_tok_s"] else "",
        })
    vs_best = [p["vs_best"] for p in per if p["vs_best"] is not None]
    steps = [p["oracle_over_tierplan_step"] for p in per if p["oracle_over_tierplan_step"] is not None]
    preds = [r["predicted_over_measured"] for r in _ok(rows) if r.get("predicted_over_measured") is not None]
    within = sum(abs(x - 1) <= PRED_TOLERANCE for x in preds)
    mean_step = sum(steps) / len(steps) if steps else None
    targets = {
        "tierplan >= 1.5x the best non-oracle baseline at >= 1 point":
            (max(vs_best) >= 1.5 if vs_best else None, f"max {max(vs_best):.2f}x" if vs_best else "no points"),
        "tierplan >= 0.95x the best static baseline at every point":
            (min(vs_best) >= 0.95 if vs_best else None,
             f"min {min(vs_best):.2f}x, {sum(v < 0.95 for v in vs_best)} of {len(vs_best)} points below"
             if vs_best else "no points"),
        "mean oracle step / tierplan step >= 1/1.10":
            (mean_step >= 1 / 1.10 if mean_step is not None else None,
             f"{mean_step:.3f} (>= {1 / 1.10:.3f})" if mean_step is not None else "no points"),
        "cost model within 15% of the measured step at >= 90% of runs":
            (within >= 0.9 * len(preds) if preds else None,
             f"{within} of {len(preds)} runs ({within / len(preds):.0%})" if preds else "no runs"),
    }
    return per, targets


def _f(v: Any, fmt: str = ".2f") -> str:
    return "—" if v is None else format(v, fmt)


def markdown(rows: list[dict[str, Any]], title: str, quick: bool, device: str) -> str:
    per, targets = summarize(rows)
    ok = _ok(rows)
    r0 = rows[0] if rows else {}
    lines = [f"# {title}", ""]
    if quick:
        lines += ["**CPU smoke run (`--quick`)**: the tiny preset, a few steps per run, on a shared CPU. It shows "
                  "that every policy runs end to end and every output is written; its figures are no result.", ""]
    lines += [f"Device: {device}. Model {r0.get('model')} with {r0.get('layers')} of {r0.get('full_layers')} layers "
              "(budgets scaled by the kept fraction; the workspace is taken out before a policy sees them). "
              f"Rows: {len(rows)} ({len(ok)} ran). Code: {', '.join(sorted({r['code'] for r in rows}))}.", "",
              "## Targets", "", "| target | met | figure |", "|---|---|---|"]
    for name, (met, fig) in targets.items():
        lines.append(f"| {name} | {'—' if met is None else 'met' if met else 'not met'} | {fig} |")
    lines += ["", "Static baselines: every policy here but tierplan and the oracle.", "",
              "## tierplan per point", "",
              "| batch | context | budget | best baseline | tok/s | tierplan tok/s | tierplan / best | oracle tok/s | "
              "tierplan / oracle | cause (below 0.95x) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in per:
        lines.append(f"| {p['batch']} | {p['context']} | {p['budget']} | {p['best'] or '—'} | "
                     f"{_f(p['best_tok_s'], '.1f')} | {_f(p['tierplan_tok_s'], '.1f')} | {_f(p['vs_best'])} | "
                     f"{_f(p['oracle_tok_s'], '.1f')} | "
                     f"{_f(p['vs_oracle'])} | {p['cause']} |")
    lines += ["", "## Every run", "",
              "| batch | ctx | budget | policy | tok/s | TPOT p50/p99 ms | TTFT p50 ms | hit | "
              "stall ms/step exp/kv/both | step ms pred/meas | plan changes | KV hits gpu/cpu/nvme | notes |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("decode_tok_s") is None:
            lines.append(f"| {r['batch']} | {r['context']} | {_budget(r)} | {r['policy']} | {r.get('status')} |"
                         f" | | | | | | | {r.get('notes', '')} |")
            continue
        kv = r.get("kv_hits") or {}
        lines.append(
            f"| {r['batch']} | {r['context']} | {_budget(r)} | {r['policy']} | {r['decode_tok_s']:.1f} | "
            f"{r['tpot_p50_ms']:.2f}/{r['tpot_p99_ms']:.2f} | {r['ttft_p50_ms']:.1f} | {r['expert_hit_rate']:.3f} | "
            f"{r['stall_ms_expert']:.2f}/{r['stall_ms_kv']:.2f}/{r['stall_ms_both']:.2f} | "
            f"{r['predicted_step_ms']:.2f}/{r['measured_step_ms']:.2f} | {r['plan_changes']} | "
            f"{kv.get('gpu', 0)}/{kv.get('cpu', 0)}/{kv.get('nvme', 0)} | "
            f"{'' if r.get('status') == 'ok' else r.get('status', '') + ': '}{r.get('notes', '')} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], stem: Path, title: str) -> list[Path]:
    """`<stem>_tok_s.png` and `<stem>_winner.png`; the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = _ok(rows)
    if not ok:
        return []
    budgets = sorted({_budget(r) for r in ok}, key=lambda b: float(b.split()[0].rstrip("x")))
    contexts = sorted({r["context"] for r in ok})
    policies = list(dict.fromkeys(r["policy"] for r in ok))
    fig, axes = plt.subplots(len(contexts), len(budgets), figsize=(4 * len(budgets), 3 * len(contexts)),
                             squeeze=False, sharex=True)
    for i, ctx in enumerate(contexts):
        for j, b in enumerate(budgets):
            ax = axes[i][j]
            for pol in policies:
                pts = sorted((r["batch"], r["decode_tok_s"]) for r in ok
                             if r["policy"] == pol and r["context"] == ctx and _budget(r) == b)
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=pol)
            ax.set_xscale("log", base=2)
            ax.set_title(f"context {ctx}, budget {b}", fontsize=9)
            ax.set_xlabel("batch")
            ax.set_ylabel("tok/s")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{title}: decode tok/s against batch")
    fig.tight_layout()
    out = [stem.with_name(stem.name + "_tok_s.png")]
    fig.savefig(out[0], dpi=110)
    plt.close(fig)

    per = _by_point(ok)
    batches = sorted({r["batch"] for r in ok})
    colors = {p: k for k, p in enumerate(policies)}
    fig, axes = plt.subplots(1, len(budgets), figsize=(4 * len(budgets), 3.2), squeeze=False)
    cmap = plt.get_cmap("tab10", max(len(policies), 1))
    for j, b in enumerate(budgets):
        ax = axes[0][j]
        grid = [[float("nan")] * len(batches) for _ in contexts]
        for pol in per.values():
            r0 = next(iter(pol.values()))
            if _budget(r0) != b:
                continue
            win = max(pol.values(), key=lambda r: r["decode_tok_s"])["policy"]
            grid[contexts.index(r0["context"])][batches.index(r0["batch"])] = colors[win]
            ax.text(batches.index(r0["batch"]), contexts.index(r0["context"]), win, ha="center", va="center",
                    fontsize=7)
        ax.imshow(grid, cmap=cmap, vmin=-0.5, vmax=len(policies) - 0.5, origin="lower", aspect="auto")
        ax.set_xticks(range(len(batches)), [str(x) for x in batches])
        ax.set_yticks(range(len(contexts)), [str(c) for c in contexts])
        ax.set_xlabel("batch")
        ax.set_ylabel("context")
        ax.set_title(f"budget {b}", fontsize=9)
    fig.suptitle(f"{title}: the winning policy (highest tok/s)")
    fig.tight_layout()
    out.append(stem.with_name(stem.name + "_winner.png"))
    fig.savefig(out[1], dpi=110)
    plt.close(fig)
    return out


def write_report(rows: list[dict[str, Any]], stem: Path, sizes: Any, device: str) -> list[Path]:
    """`<stem>.md` and the plots from `rows` (one model, one device); the paths written."""
    if not rows:
        return []
    title = f"Phase diagram: {rows[0]['model']}"
    md = stem.with_suffix(".md")
    text = markdown(rows, title, sizes.quick, device)
    try:
        pngs = plot(rows, stem, title)
    except ImportError as exc:  # a device image without matplotlib: the table and the JSON still count
        pngs, text = [], text + f"\nPlots not drawn here: {exc}. `tierplan bench phase` draws them from the JSON.\n"
    md.write_text(text)
    return [md, *pngs]
