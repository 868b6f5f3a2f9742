"""`tierplan sim` against the reference engine on the CPU: the demo workload (tiny preset, bundled Mooncake
requests and FLAME-MoE routing, half the experts' slots, KV 6/16/64 blocks), run for real and simulated.

A user's calibration: the engine runs with its agent, whose telemetry (one window per step) calibrates a
cost model that starts from a deliberately wrong prior; the simulator then replays the same traces (its own
scheduler, routing rows and LRU) over that model. Each repetition is measured, calibrated and simulated on
its own so a busy neighbour slows both sides alike; the test asserts only the ratio simulated/measured of
the median decode step, never a wall-clock value.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tierplan.agent.adapters.reference import ReferenceAdapter
from tierplan.api.demo import DATA
from tierplan.controller import sim_traces
from tierplan.controller.costmodel import ComputeParams, CostModel, HardwareSpec
from tierplan.controller.model_shape import builtin_shape
from tierplan.controller.protocol import Link, Telemetry
from tierplan.controller.sim import SimConfig, Simulator
from tierplan.controller.sim_policy import make_policy
from tierplan.runtime.device import Device
from tierplan.runtime.engine.engine import EngineConfig, ReferenceEngine
from tierplan.runtime.engine.presets import preset
from tierplan.runtime.engine.routing_trace import RoutingTrace
from tierplan.runtime.engine.runner import ForcedRouter, Runner
from tierplan.runtime.engine.scheduler import PreemptMode, Scheduler
from tierplan.runtime.engine.workloads import load_mooncake, scale_requests
from tierplan.runtime.selfcheck.exact import auto_block_tokens

MOONCAKE = DATA / "requests/mooncake_conversation_sample.jsonl"
FLAME = DATA / "routing/flame_moe_290m_sample.npz"
NUM_REQUESTS = 100
KV = {"gpu": 6, "cpu": 16, "nvme": 64}
STEP_CLOCK_S = 0.005  # the demo's step clock: arrivals meet the same batches however fast the host is


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread: on a shared 2-core box a second one only adds contention noise to step times."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _engine_run(workdir: Path, num_requests: int) -> tuple[list[float], list[Telemetry], int]:
    """The demo's LRU job: (decode step ms, telemetry windows, expert slots)."""
    spec = preset("tiny")
    bt = auto_block_tokens(spec)
    reqs = scale_requests(load_mooncake(MOONCAKE, limit=num_requests, time_scale=0.01), 48, 16, num_requests,
                          block_tokens=16)
    eng = ReferenceEngine(spec, Device("cpu"), EngineConfig(
        block_tokens=bt, resident_frac=0.5, kv_gpu_blocks=KV["gpu"], kv_cpu_blocks=KV["cpu"],
        kv_nvme_blocks=KV["nvme"], workdir=workdir))
    try:
        agent = ReferenceAdapter(eng, window_steps=1)
        decode_ms: list[float] = []

        def on_step(batch: object, step_s: float) -> None:
            if not batch.prefills:  # type: ignore[attr-defined]
                decode_ms.append(step_s * 1e3)
            agent.on_step(batch, step_s)

        sched = Scheduler(KV["gpu"], bt, max_batch=16, preempt=PreemptMode.SWAP)
        Runner(eng, sched, ForcedRouter(RoutingTrace.load(FLAME), eng), on_step=on_step,
               virtual_step_s=STEP_CLOCK_S).run(reqs)
        agent.flush()
        agent.close()
        return decode_ms, agent.telemetry, eng.pool.num_slots
    finally:
        eng.close()


def _simulated_decode_p50(telemetry: list[Telemetry], num_slots: int, num_requests: int) -> float:
    shape = builtin_shape("tiny", block_tokens=auto_block_tokens(preset("tiny")))
    # A wrong prior on purpose (10x off on compute, a fast link with no per-load cost): the data must fix it.
    hw = HardwareSpec({lk: 10e9 for lk in Link}, 0.0, 1 << 30)
    cost = CostModel(shape, hw, ComputeParams(dense_ms=0.05, moe_ms=0.05))
    for window in telemetry:
        cost.calibrate(window)
    trace = sim_traces.load_routing(FLAME, shape.num_moe_layers, shape.top_k, shape.num_experts)
    reqs = sim_traces.scale_requests(sim_traces.load_mooncake(MOONCAKE, limit=num_requests, time_scale=0.01), 48, 16)
    sim = Simulator(shape, cost, trace, make_policy("lru", num_slots, shape.num_moe_layers),
                    SimConfig(kv_gpu_blocks=KV["gpu"], kv_cpu_blocks=KV["cpu"], max_batch=16,
                              virtual_step_s=STEP_CLOCK_S), num_slots)
    return sim.run(reqs).summary()["decode_step_ms_p50"]


@pytest.mark.slow
def test_sim_reproduces_the_engines_decode_step_within_15_percent(tmp_path: Path, one_thread: None) -> None:
    _engine_run(tmp_path / "warm", 24)  # first uses (allocator, kernels, validation) stay out of the measurement
    ratios = []
    for rep in range(7):
        decode_ms, telemetry, num_slots = _engine_run(tmp_path / f"run{rep}", NUM_REQUESTS)
        assert len(decode_ms) >= 50
        ratios.append(_simulated_decode_p50(telemetry, num_slots, NUM_REQUESTS) / statistics.median(decode_ms))
    ratio = statistics.median(ratios)
    print(f"sim/engine median decode step: {ratio:.3f} (per repetition {[round(r, 3) for r in ratios]})")
    assert 0.85 <= ratio <= 1.15, ratios


def test_sim_forms_the_engines_batches_and_misses(tmp_path: Path) -> None:
    """The simulated run is the same run: the same number of steps and of decode steps, the same expert misses
    (the same routing rows through the same LRU), whatever the timing."""
    spec = preset("tiny")
    bt = auto_block_tokens(spec)
    reqs = scale_requests(load_mooncake(MOONCAKE, limit=48, time_scale=0.01), 48, 16, 48, block_tokens=16)
    eng = ReferenceEngine(spec, Device("cpu"), EngineConfig(
        block_tokens=bt, resident_frac=0.5, kv_gpu_blocks=KV["gpu"], kv_cpu_blocks=KV["cpu"],
        kv_nvme_blocks=KV["nvme"], workdir=tmp_path))
    try:
        kinds: list[bool] = []
        sched = Scheduler(KV["gpu"], bt, max_batch=16, preempt=PreemptMode.SWAP)
        report = Runner(eng, sched, ForcedRouter(RoutingTrace.load(FLAME), eng), virtual_step_s=STEP_CLOCK_S,
                        on_step=lambda b, s: kinds.append(not b.prefills)).run(reqs)
        slots = eng.pool.num_slots
    finally:
        eng.close()
    shape = builtin_shape("tiny", block_tokens=bt)
    cost = CostModel(shape, HardwareSpec({lk: 1e9 for lk in Link}, 1e-4, 1 << 30), ComputeParams(dense_ms=1.0))
    trace = sim_traces.load_routing(FLAME, shape.num_moe_layers, shape.top_k, shape.num_experts)
    sreqs = sim_traces.scale_requests(sim_traces.load_mooncake(MOONCAKE, limit=48, time_scale=0.01), 48, 16)
    sim = Simulator(shape, cost, trace, make_policy("lru", slots, shape.num_moe_layers),
                    SimConfig(kv_gpu_blocks=KV["gpu"], kv_cpu_blocks=KV["cpu"], max_batch=16,
                              virtual_step_s=STEP_CLOCK_S), slots).run(sreqs)
    s = sim.summary()
    assert s["steps"] == report.steps and s["decode_steps"] == sum(kinds)
    assert sum(r.misses for r in sim.steps) == report.expert_misses
    assert sum(r.hits for r in sim.steps) == report.expert_hits
    assert s["tokens_out"] == report.tokens_out and s["preemptions"] == sum(r.preemptions for r in report.requests)
