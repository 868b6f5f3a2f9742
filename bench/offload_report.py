"""The offload bench's Markdown table and plot (bench/offload.py's results; runs wherever the bench ran).

Pure formatting of figures measured in one run: never computes a figure of its own beyond ratios of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _fmt(x: Any, nd: int = 2) -> str:
    if x is None:
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _reps(r: dict[str, Any]) -> str:
    return ", ".join(f"{x:.3f}" for x in r.get("step_ms_reps", [r["step_ms"]]))


def write_report(out: dict[str, Any], stem: Path) -> None:
    meta, rows = out["meta"], out["rows"]
    lines = [f"# Offloaded decode ({meta['device']}, torch {meta['torch']}, {meta['when']})", "",
             f"Pinned host->device measured in this run: {meta['h2d_gb_s']:.1f} GB/s. Forced real routing from "
             "the bundled trace unless `forced` says no. bar = 1.15 x (all-resident graph step + link floor).", "",
             "| model | F | B | victims | lookahead | reads | forced | tok/s | step ms | hit rate | prefetch hits "
             "| stall ms "
             "| miss MiB | link floor ms | resident graph ms | step / bar | step / max(compute, link) "
             "| graph / piecewise / eager |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ex = r["executors"]
        lines.append(
            f"| {r['model']} | {r['frac']} | {r['batch']} | {r['victims']} | {r['lookahead']} | {r.get('reads', '-')} "
            f"| {r['forced']} "
            f"| {r['tok_s']:.1f} | {r['step_ms']:.2f} | {r['hit_rate']:.3f} | {r['prefetch_hits']} "
            f"| {r['stall_ms_per_step']:.2f} | {r['miss_bytes_per_step'] / 2**20:.1f} | {r['link_floor_ms']:.2f} "
            f"| {_fmt(r.get('resident_graph_step_ms'))} | {_fmt(r.get('vs_bar'), 3)} "
            f"| {_fmt(r.get('vs_max_compute_link'), 3)} | {ex['graph']} / {ex['piecewise']} / {ex['eager']} |")
    pairs = [(f, u) for f in rows for u in rows if f["frac"] >= 1.0 and f["forced"] and not u["forced"]
             and u["model"] == f["model"] and u["batch"] == f["batch"] and u["frac"] == f["frac"]]
    if pairs:
        lines += ["", "Forced vs live routing, all experts resident (the same graphs; live: an engine without the "
                  "table). Each side's step ms is the median of its repetitions, run interleaved (order swapped "
                  "every repetition):", "",
                  "| model | B | forced ms | live ms | forced / live | forced reps (ms) | live reps (ms) |",
                  "|---|---|---|---|---|---|---|"]
        for f, u in pairs:
            lines.append(f"| {f['model']} | {f['batch']} | {f['step_ms']:.3f} | {u['step_ms']:.3f} "
                         f"| {f['step_ms'] / u['step_ms']:.3f} | {_reps(f)} | {_reps(u)} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the plot is optional where matplotlib is missing
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for model in sorted({r["model"] for r in rows}):
        for b in sorted({r["batch"] for r in rows}):
            pts = sorted((r["frac"], r["vs_bar"]) for r in rows if r["model"] == model and r["batch"] == b
                         and r["forced"] and r["lookahead"] == 0 and r["victims"] == "lru" and r.get("vs_bar")
                         and r.get("reads") != "range")
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{model} B={b}")
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xlabel("resident fraction F")
    ax.set_ylabel("step time / bar")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)
    plt.close(fig)
