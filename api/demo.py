"""`tierplan demo` / `make demo`: the main job on its embedded default, on the CPU.

The composition root (the user's process): the substrate's self-checks, then the `tiny` MoE preset with
synthetic weights replaying bundled real requests (Mooncake lengths) with bundled real routing (FLAME-MoE)
in three phases: light traffic, then the batch grows, then the context grows. One HBM budget holds the expert
slots and the GPU KV blocks. The job runs twice: with a static split (most experts, the KV floor), and with
the controller as a service (`tierplan serve` on SQLite, a `tierplan sidecar`, the engine's agent on a unix
socket; api/demo_service.py), re-splitting the budget as the windows come in. It prints both runs' metrics,
the plan history with its reasons read back from the service, the group's policy, the agent's link counts,
the decisions page URL, checks every applied plan kept the budget, nothing was dropped or done on the engine's
threads, and that the generated tokens are identical (placement never changes output); ends with "demo: ok".
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

DATA = Path(__file__).resolve().parents[1] / "data"
METRICS = (("tokens/s", "tokens_per_s"), ("TTFT p50 ms", "ttft_ms_p50"), ("TTFT p99 ms", "ttft_ms_p99"),
           ("TPOT p50 ms", "tpot_ms_p50"), ("TPOT p99 ms", "tpot_ms_p99"), ("expert hit rate", "expert_hit_rate"),
           ("preemptions", "preemptions"), ("steps", "steps"), ("tokens out", "tokens_out"))


def _metrics_table(jobs: list[Any]) -> Table:
    from tierplan.api.demo_loop import BUDGET_UNITS

    table = Table(title=f"phased requests, one HBM budget of {BUDGET_UNITS * 4} KiB for expert slots + GPU KV")
    table.add_column("metric")
    for j in jobs:
        table.add_column(j.label, justify="right")
    for name, key in METRICS:
        table.add_row(name, *(f"{j.summary[key]:.3f}" if isinstance(j.summary[key], float) else str(j.summary[key])
                              for j in jobs))
    return table


def plan_history(decisions: list[dict[str, Any]], phase_at_window: dict[int, str]) -> tuple[Table, list[str]]:
    """One row per issued plan (held decisions counted between them), and each plan's reason as a line; from
    the service's DecisionRecords (JSON, oldest first)."""
    table = Table(title="controller plan history, read from the service (held: windows where the split was kept)")
    for col in ("plan", "win", "phase", "tok/step", "KV need", "slots/layer", "KV gpu", "pred ms", "meas ms",
                "held"):
        table.add_column(col, justify="left" if col in ("phase", "slots/layer") else "right", no_wrap=True)
    held, reasons = 0, []
    for d in decisions:
        if d["outcome"] != "issued":
            held += 1
            continue
        split, measured = d["split"], d["measured_step_ms"]
        table.add_row(f"v{d['version']}", str(d["window"]), phase_at_window.get(d["window"], "-"),
                      f"{d['batch_tokens']:.1f}", f"{d['kv_demand_blocks']:.0f}",
                      "/".join(map(str, split["expert_slots_per_layer"])), str(split["kv_blocks_per_tier"]["gpu"]),
                      f"{d['predicted_step_ms']:.2f}", "-" if measured is None else f"{measured:.2f}", str(held))
        reasons.append(f"v{d['version']}: {d['reason']}")
        held = 0
    return table, reasons


def run_demo(console: Console, workdir: str | Path | None = None, num_requests: int = 48,
             serve: bool = False) -> bool:
    """`num_requests` (at least 3) scales the three phases' request counts alike; `serve` keeps the service
    (and its decisions page) up after the run until the user interrupts it."""
    import torch

    from tierplan.api.demo_loop import run_loop_job
    from tierplan.api.demo_service import run_service_job
    from tierplan.runtime.engine.presets import preset
    from tierplan.runtime.selfcheck.exact import run_exact_check
    from tierplan.runtime.selfcheck.slots import run_slot_check
    from tierplan.runtime.selfcheck.tiers import run_tier_check

    say = console.print

    def keep(url: str) -> None:
        say(f"serving the decisions page at {url}/ui until Ctrl-C")
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's kernels are microseconds: more threads only contend
    try:
        say("[bold]tierplan demo[/bold]: tiny MoE on the CPU, Mooncake requests, FLAME-MoE routing (bundled, real)")
        with tempfile.TemporaryDirectory(prefix="tierplan-demo-", dir=workdir) as d:
            wd = Path(d)
            s = run_slot_check(200, 0, "cpu", wd / "slots")
            t = run_tier_check(1000, 0, "cpu", wd / "tiers", inject_every=200)
            x = run_exact_check(preset("tiny"), 0.25, workdir=wd / "exact")
            say(f"substrate: {s.line()}; {t.line()} (injected={t.injected}); {x.line()}")
            static = run_loop_job(wd / "static", False, num_requests)
            say("controller: starting `tierplan serve` (SQLite) and `tierplan sidecar`; the engine's agent talks "
                "to the sidecar over a unix socket")
            run = run_service_job(wd / "service", num_requests, keep=keep if serve else None)
    finally:
        torch.set_num_threads(threads)
    ctl = run.result
    jobs = [static, ctl]
    console.print(_metrics_table(jobs))
    history, reasons = plan_history(run.decisions, ctl.phase_at_window)
    console.print(history)
    for line in reasons:
        say(line)
    st, link, pol = ctl.stats, run.link, run.policy
    pf = st["prefetch"]
    say(f"policy of group {pol['group']!r}: v{pol['version']} by {pol['author']} ({pol['why']})")
    say(f"static split: {static.stats['static_slots']} expert slots + {static.stats['kv_blocks']} KV blocks, "
        f"engine LRU")
    states = [p["state"] for p in run.plans]
    say(f"controller (service): {st['windows']} windows, {len(run.plans)} plans issued "
        f"({states.count('applied')} applied, {states.count('rejected')} rejected, "
        f"{states.count('superseded')} superseded, {states.count('issued')} not acked yet), "
        f"{st['telemetry_refused']} telemetry windows refused")
    dropped = sum(link["dropped"].values())
    say(f"agent -> sidecar: {link['produced']} windows produced, {link['sent']} sent, {dropped} dropped, "
        f"{link['engine_thread_io']} socket calls on the engine's threads, {link['acks_sent']} acks sent")
    say(f"local predictor: {pf.get('issued', 0)} prefetches issued ({pf.get('useful', 0)} useful, "
        f"{pf.get('wasted', 0)} wasted), skipped {pf.get('skipped_resident', 0)} resident / "
        f"{pf.get('skipped_budget', 0)} over budget / {pf.get('skipped_no_slot', 0)} no slot; table "
        f"v{pf.get('table_version', 0)}")
    within = all(total <= ctl.budget_bytes for total in ctl.plan_totals) and st["peak_over_budget_bytes"] <= 0
    say(f"budget {ctl.budget_bytes} bytes: every applied plan within it {within} (largest plan "
        f"{max(ctl.plan_totals, default=0)} bytes; between steps the footprint exceeded it by at most "
        f"{max(0, st['peak_over_budget_bytes'])} bytes; {st['trimmed']} experts over a cap evicted between steps)")
    kv = [d["split"]["kv_blocks_per_tier"]["gpu"] for d in run.decisions if d["outcome"] == "issued"]
    say(f"split moved with the workload: {len(set(kv)) > 1} (GPU KV blocks per plan: {kv})")
    same = static.outputs == ctl.outputs
    say(f"outputs identical with and without the controller: {same}")
    say(f"decisions page: {run.url}/ui (served while the demo ran; `tierplan demo --serve` keeps it up)")
    # Whether the split moves depends on the costs measured on this machine (a loaded box can make every expert
    # load so dear that keeping experts wins): shown, not required. The tests check it with fixed costs.
    ok = (s.stale_reads == 0 and t.ok and x.ok and same and within and bool(run.plans)
          and states.count("rejected") == 0 and st["telemetry_refused"] == 0 and st["planner_errors"] == 0
          and link["engine_thread_io"] == 0 and dropped == 0 and link["drained"]
          and all(j.summary["tokens_out"] > 0 for j in jobs))
    say(f"demo: ok ({sum(int(j.summary['tokens_out']) for j in jobs)} tokens generated)" if ok else "demo: FAILED")
    return ok
