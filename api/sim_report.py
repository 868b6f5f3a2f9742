"""Writes a `tierplan sim` run to disk: sim.json (summary, inputs, every step) and sim.png (plots).

Runs in the user's shell, after the simulation. matplotlib (Agg backend) is imported inside `write_sim_report`,
so importing this module costs nothing. It never changes the report it is given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tierplan.controller.sim import SimReport


def write_sim_report(out_dir: Path, report: SimReport, inputs: dict[str, Any]) -> tuple[Path, Path]:
    """-> (json path, png path)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = report.to_dict()
    data["inputs"] = inputs
    json_path, png_path = out_dir / "sim.json", out_dir / "sim.png"
    json_path.write_text(json.dumps(data, separators=(",", ":")) + "\n", encoding="utf-8")
    _plot(png_path, report, inputs)
    return json_path, png_path


def _rolling(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _plot(path: Path, report: SimReport, inputs: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = report.steps
    x = [s.step for s in steps]
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    compute = [s.compute_ms for s in steps]
    expert = [s.expert_stall_ms for s in steps]
    kv = [s.kv_stall_ms + s.both_stall_ms for s in steps]
    w = max(1, len(steps) // 200)
    ax = axes[0]
    ax.stackplot(x, _rolling(compute, w), _rolling(expert, w), _rolling(kv, w),
                 labels=["compute", "expert-miss stall", "KV stall (+both)"], alpha=0.85)
    ax.set_ylabel("step ms")
    ax.legend(loc="upper right", fontsize=8)
    summary = report.summary()
    ax.set_title(f"{inputs.get('model', '?')} on {inputs.get('hardware', '?')}: policy {report.policy}, "
                 f"{report.num_slots} expert slots, {summary['tokens_per_s']:.0f} tok/s, "
                 f"hit rate {summary['expert_hit_rate']:.3f}", fontsize=9)
    hit = [s.hits / (s.hits + s.misses) if s.hits + s.misses else 1.0 for s in steps]
    axes[1].plot(x, _rolling(hit, max(1, w * 5)), color="tab:green")
    axes[1].set_ylabel("expert hit rate")
    axes[1].set_ylim(0, 1.05)
    axes[2].plot(x, [s.batch_tokens for s in steps], label="tokens in step", color="tab:purple", lw=0.8)
    axes[2].plot(x, [s.num_prefills + s.num_decodes for s in steps], label="sequences", color="tab:orange", lw=0.8)
    axes[2].set_ylabel("batch")
    axes[2].set_yscale("symlog")
    axes[2].set_xlabel("step")
    axes[2].legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
