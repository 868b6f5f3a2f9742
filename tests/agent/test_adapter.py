"""The agent inside the reference engine: plan applied, every step observed, telemetry valid."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.agent import flame_trace, tiny_engine
from tierplan.agent.adapters.reference import ReferenceAdapter
from tierplan.agent.static_plan import static_plan
from tierplan.controller.protocol import AckStatus, Telemetry, parse, to_json
from tierplan.runtime.device import Device
from tierplan.runtime.engine.engine import EngineConfig, ReferenceEngine
from tierplan.runtime.engine.executor import Reason
from tierplan.runtime.engine.presets import preset
from tierplan.runtime.engine.runner import ForcedRouter, Runner
from tierplan.runtime.engine.scheduler import Scheduler
from tierplan.runtime.engine.workloads import Request
from tierplan.runtime.selfcheck.exact import auto_block_tokens

DATA = Path(__file__).parents[2] / "data"


def test_adapter_applies_a_static_plan_and_ships_valid_windows(tmp_path: Path) -> None:
    eng = tiny_engine(tmp_path)
    spec, bt = eng.spec, eng.cfg.block_tokens
    try:
        trace = flame_trace()
        agent = ReferenceAdapter(eng, window_steps=4)
        # the warm-up window at attach leaves nothing behind: no message, empty counters, window 0 next
        assert agent.telemetry == [] and agent.window.seq == 0 and not agent.tap.counts.any()
        assert sum(agent.tap.tokens) == 0 and not agent.tap.pairs.any()
        warm, _ = trace.routes(256, len(spec.moe_layers), spec.top_k, spec.num_experts)
        plan = static_plan(spec, warm, eng.pool.num_slots, eng.pool.layout.stride_bytes,
                           {"gpu": 8, "cpu": 8, "nvme": 16}, eng.cache.block_bytes, pin_per_layer=1)
        ack = agent.apply(plan)
        assert ack.status is AckStatus.APPLIED and agent.enforcer.applied_version == 1
        assert sum(eng.pool.is_pinned(m, e) for m in range(2) for e in range(8)) == 2
        reqs = [Request(i, 0.0, 10 + 3 * i, 6, (), "test") for i in range(5)]
        rep = Runner(eng, Scheduler(8, bt, max_batch=4), ForcedRouter(trace, eng), on_step=agent.on_step).run(reqs)
        last = agent.flush()
        agent.close()
    finally:
        eng.close()
    assert agent.outbox.sent == rep.steps // 4 and agent.outbox.failed == 0
    assert agent.steps == rep.steps and len(agent.telemetry) == rep.steps // 4 + 1
    routed = sum(sum(layer.activation_counts) for t in agent.telemetry for layer in t.layers)
    assert routed > 0 and routed % spec.top_k == 0  # every routed token counted k times
    assert sum(t.step_timings_ms.num_steps for t in agent.telemetry) == rep.steps
    tokens = [n for t in agent.telemetry for n in t.step_tokens]  # each step's tokens, graph or eager
    assert len(tokens) == rep.steps and sum(tokens) * spec.top_k * len(spec.moe_layers) == routed
    assert max(tokens) >= 10 and min(tokens) <= 4  # the prefills (prompts of 10+) and the decode steps
    decodes = [n for t in agent.telemetry for n in t.step_decode_tokens]  # the scheduler's decoding sequences
    assert len(decodes) == rep.steps and all(d <= n for d, n in zip(decodes, tokens, strict=True))
    assert any(d < n for d, n in zip(decodes, tokens, strict=True)) and any(d == n > 0 for d, n in zip(
        decodes, tokens, strict=True))  # steps with a prompt chunk, and steps of decodes alone
    # each step the engine ran chunked (a layer's experts over its slots) is counted once, in its window
    chunked = eng.executors.reasons[Reason.LAYER_OVER_SLOTS]
    assert sum(t.chunked_steps for t in agent.telemetry) == chunked  # none on the CPU (no graphs): below
    assert sum(t.expert_hits + t.expert_misses for t in agent.telemetry) == rep.expert_hits + rep.expert_misses
    assert all(t.applied_plan_version == 1 for t in agent.telemetry)
    sampled = [b for t in agent.telemetry for b in t.kv.attention_mass]
    assert sampled and all(0.0 <= b.mass <= 1.0 for b in sampled)  # attention mass per block was sampled
    assert parse(Telemetry, to_json(last)) == last
    assert [t.window_seq for t in agent.telemetry] == list(range(len(agent.telemetry)))


def test_outbox_keeps_order_and_counts_a_window_that_fails_to_build() -> None:
    from tierplan.agent.outbox import Outbox

    class Draft:
        def __init__(self, n: int) -> None:
            self.n = n

        def build(self, between_layers=None):
            if self.n == 1:
                raise ValueError("bad window")
            return self.n

    got: list[int] = []
    box = Outbox(got.append)
    for n in range(4):
        box.put(Draft(n))  # type: ignore[arg-type]
    box.join()
    assert got == [0, 2, 3] and box.sent == 3 and box.failed == 1 and "bad window" in str(box.last_error)
    assert len(box.build_spans) == 3 and all(a <= b for a, b in box.build_spans)  # each build's own span
    box.close()
    with pytest.raises(RuntimeError, match="closed"):
        box.put(Draft(5))  # type: ignore[arg-type]


def test_a_window_that_fails_to_build_shows_in_the_next_windows_fallbacks(tmp_path: Path) -> None:
    from tierplan.agent.taps import WindowDraft

    spec = preset("tiny")
    eng = ReferenceEngine(spec, Device("cpu"), EngineConfig(block_tokens=auto_block_tokens(spec), workdir=tmp_path))
    agent = ReferenceAdapter(eng, window_steps=1)
    try:
        real = WindowDraft.build
        calls = []

        def flaky(self, between_layers=None):
            calls.append(1)
            if len(calls) == 1:
                raise ValueError("boom")
            return real(self, between_layers)

        WindowDraft.build = flaky  # type: ignore[method-assign]
        try:
            agent.on_step(None, 0.001)  # window 0 fails on the outbox thread
            last = agent.flush()  # window 1 is built here and reports it
        finally:
            WindowDraft.build = real  # type: ignore[method-assign]
    finally:
        agent.close()
        eng.close()
    assert agent.outbox.failed == 1 and last.fallbacks["telemetry_build_failed"] == 1


def test_adapter_counts_each_step_the_engine_ran_chunked(tmp_path: Path) -> None:
    """The engine counts each step's executor and reason; a step whose count of `layer_over_slots` rose is one the
    window reports as chunked (the CPU engine runs no graphs, so the counts are driven here)."""
    from tierplan.runtime.engine.executor import Executor

    eng = tiny_engine(tmp_path)
    try:
        agent = ReferenceAdapter(eng, window_steps=4)
        for chunked in (True, False, True, True):
            reason = Reason.LAYER_OVER_SLOTS if chunked else Reason.EXPERTS_MISSING
            eng.executors.count(Executor.EAGER if chunked else Executor.PIECEWISE, reason)
            agent.on_step(None, 0.001)
        agent.flush()
        agent.close()
    finally:
        eng.close()
    assert [t.chunked_steps for t in agent.telemetry][:1] == [3]
