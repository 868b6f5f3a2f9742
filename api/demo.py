"""`tierplan demo` / `make demo`: the main job on its embedded default, on the CPU.

The composition root (the user's process): the `tiny` MoE preset with synthetic weights, a bundled real
request trace (Mooncake) replayed with continuous batching, a bundled real routing trace (FLAME-MoE)
forcing expert choices, half the experts' worth of slots and a small GPU KV budget spilling to CPU and
NVMe. It runs the job twice, first with the engine's LRU alone and then with the agent applying a
built-in static plan (the controller arrives in step 3), prints what each did, checks the generated
tokens are identical (placement never changes output), and ends with "demo: ok".
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

DATA = Path(__file__).resolve().parents[1] / "data"


@dataclass
class JobResult:
    label: str
    summary: dict[str, float]
    kv_peak: dict[str, int]
    outputs: dict[int, list[int]]
    ack: str
    windows: int
    fallbacks: dict[str, int]


def _job(workdir: Path, with_plan: bool, num_requests: int) -> JobResult:
    from agent.adapters.reference import ReferenceAdapter
    from agent.static_plan import static_plan
    from runtime.device import Device
    from runtime.engine.engine import EngineConfig, ReferenceEngine
    from runtime.engine.presets import preset
    from runtime.engine.routing_trace import RoutingTrace
    from runtime.engine.runner import ForcedRouter, Runner
    from runtime.engine.scheduler import PreemptMode, Scheduler
    from runtime.engine.workloads import load_mooncake, scale_requests
    from runtime.selfcheck.exact import auto_block_tokens

    spec = preset("tiny")
    bt = auto_block_tokens(spec)
    reqs = scale_requests(load_mooncake(DATA / "requests/mooncake_conversation_sample.jsonl", limit=num_requests,
                                        time_scale=0.01), 48, 16, num_requests, block_tokens=16)
    kv = {"gpu": 6, "cpu": 16, "nvme": 64}
    eng = ReferenceEngine(spec, Device("cpu"), EngineConfig(
        block_tokens=bt, resident_frac=0.5, kv_gpu_blocks=kv["gpu"], kv_cpu_blocks=kv["cpu"],
        kv_nvme_blocks=kv["nvme"], workdir=workdir))
    try:
        trace = RoutingTrace.load(DATA / "routing/flame_moe_290m_sample.npz")
        router = ForcedRouter(trace, eng)
        agent = ReferenceAdapter(eng, window_steps=8)
        ack = "none (engine LRU only)"
        if with_plan:
            warm, _ = trace.routes(512, len(spec.moe_layers), spec.top_k, spec.num_experts)
            plan = static_plan(spec, warm, eng.pool.num_slots, eng.pool.layout.stride_bytes, kv,
                               eng.cache.block_bytes, pin_per_layer=2)
            a = agent.apply(plan)
            ack = f"{a.status.value} v{a.version}" + (f" ({a.reason})" if a.reason else "") + f": {plan.reason}"
        sched = Scheduler(kv["gpu"], bt, max_batch=16, preempt=PreemptMode.SWAP)
        # A step clock paces arrivals, so both runs form the same batches whatever the host's speed.
        report = Runner(eng, sched, router, on_step=agent.on_step, virtual_step_s=0.005).run(reqs)
        agent.flush()
        agent.close()
        return JobResult("static plan" if with_plan else "LRU only", report.summary(), report.kv_peak_blocks,
                         {s.seq_id: s.output for s in sched.finished}, ack, len(agent.telemetry),
                         dict(agent.policy.fallbacks))
    finally:
        eng.close()


def run_demo(console: Console, workdir: str | Path | None = None, num_requests: int = 48) -> bool:
    from runtime.engine.presets import preset
    from runtime.selfcheck.exact import run_exact_check
    from runtime.selfcheck.slots import run_slot_check
    from runtime.selfcheck.tiers import run_tier_check

    say = console.print
    say("[bold]tierplan demo[/bold]: tiny MoE on the CPU, Mooncake requests, FLAME-MoE routing (bundled, real)")
    with tempfile.TemporaryDirectory(prefix="tierplan-demo-", dir=workdir) as d:
        wd = Path(d)
        s = run_slot_check(200, 0, "cpu", wd / "slots")
        t = run_tier_check(1000, 0, "cpu", wd / "tiers", inject_every=200)
        x = run_exact_check(preset("tiny"), 0.25, workdir=wd / "exact")
        say(f"substrate: {s.line()}; {t.line()} (injected={t.injected}); {x.line()}")
        jobs = [_job(wd / "lru", False, num_requests), _job(wd / "plan", True, num_requests)]
    table = Table(title=f"{num_requests} requests, half the experts resident, 6 GPU KV blocks (+CPU, NVMe)")
    table.add_column("metric")
    for j in jobs:
        table.add_column(j.label, justify="right")
    rows: list[tuple[str, Any]] = [
        ("tokens/s", "tokens_per_s"), ("queueing p50 ms", "queue_ms_p50"), ("TTFT p50 ms", "ttft_ms_p50"),
        ("TTFT p99 ms", "ttft_ms_p99"),
        ("TPOT p50 ms", "tpot_ms_p50"), ("TPOT p99 ms", "tpot_ms_p99"), ("expert hit rate", "expert_hit_rate"),
        ("preemptions", "preemptions"), ("steps", "steps"), ("tokens out", "tokens_out")]
    for name, key in rows:
        table.add_row(name, *(f"{j.summary[key]:.3f}" if isinstance(j.summary[key], float) else str(j.summary[key])
                              for j in jobs))
    table.add_row("KV peak blocks gpu/cpu/nvme", *("/".join(str(j.kv_peak[k]) for k in ("gpu", "cpu", "nvme"))
                                                  for j in jobs))
    table.add_row("telemetry windows", *(str(j.windows) for j in jobs))
    console.print(table)
    for j in jobs:
        fb = {k: v for k, v in j.fallbacks.items() if v}
        say(f"{j.label}: plan {j.ack}; fallbacks {fb or 'none'}")
    same = jobs[0].outputs == jobs[1].outputs
    say(f"outputs identical with and without the plan: {same}")
    ok = s.stale_reads == 0 and t.ok and x.ok and same and all(j.summary["tokens_out"] > 0 for j in jobs)
    say(f"demo: ok ({sum(int(j.summary['tokens_out']) for j in jobs)} tokens generated)" if ok else "demo: FAILED")
    return ok
