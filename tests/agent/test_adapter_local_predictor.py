"""The reference adapter with the plan's local predictor on: v2 telemetry (cross-layer pairs, step unions,
prefetch counts, queued KV, the GPU KV share in force) and a plan's table installed once it is applied, never
when it is refused."""

from __future__ import annotations

from pathlib import Path

from tests.agent import Agent, flame_trace, make_plan, tiny_engine
from tierplan.agent.adapters.reference import ReferenceAdapter
from tierplan.controller.protocol import AckStatus, LocalPredictor, Successor, TransitionRow
from tierplan.controller.protocol import Tier as PlanTier
from tierplan.runtime.engine.runner import ForcedRouter, Runner
from tierplan.runtime.engine.scheduler import Scheduler
from tierplan.runtime.engine.workloads import Request
from tierplan.runtime.kv import Tier

DATA = Path(__file__).parents[2] / "data"


def test_windows_carry_what_the_table_is_trained_from(tmp_path: Path) -> None:
    eng = tiny_engine(tmp_path)
    bt = eng.cfg.block_tokens
    try:
        trace = flame_trace()
        agent = ReferenceAdapter(eng, window_steps=4, local_predictor=True, queue_probe=lambda: 3)
        table = LocalPredictor(version=5, top_m=2, min_score=0.3, rows=(
            TransitionRow(layer=0, src=e, next=(Successor((e + 1) % 8, 0.9),)) for e in range(8)))
        stub = Agent(eng, agent.policy, agent.enforcer, None)  # type: ignore[arg-type]
        refused = make_plan(stub, version=3, base_version=2, local_predictor=table,  # stale: built on v2
                            prefetch_budget_bytes_per_step=10**6)
        assert agent.apply(refused).status is AckStatus.REJECTED and agent.predictor.version == 0  # type: ignore
        plan = make_plan(stub, caps=(4, 4), local_predictor=table,
                         prefetch_budget_bytes_per_step=2 * eng.pool.layout.stride_bytes)
        assert agent.apply(plan).status is AckStatus.APPLIED and agent.predictor.version == 5  # type: ignore
        share = eng.cache.manager.limit(Tier.GPU)  # the GPU KV share the applied plan set
        reqs = [Request(i, 0.0, 10 + 3 * i, 6, (), "test") for i in range(5)]
        rep = Runner(eng, Scheduler(8, bt, max_batch=4), ForcedRouter(trace, eng), on_step=agent.on_step).run(reqs)
        agent.flush()
        agent.close()
    finally:
        eng.close()
    tels = agent.telemetry
    assert all(t.schema_version >= 2 and t.queued_kv_blocks == 3 for t in tels)  # 3 where a v3 field is sent
    assert all(t.kv_gpu_limit_blocks == share == plan.kv_blocks_per_tier[PlanTier.GPU] for t in tels)
    assert sum(t.transitions[0].num_tokens for t in tels if t.transitions) == sum(r.prompt_len for r in reqs) + \
        sum(r.output_len - 1 for r in reqs)  # every token routed at both layers paired once
    assert sum(len(t.step_unions[0].unions) for t in tels if t.step_unions) == rep.steps
    issued = sum(t.local_prefetch.issued for t in tels if t.local_prefetch is not None)
    assert issued == agent.predictor.counts["issued"] > 0  # type: ignore[union-attr]
    assert all(t.local_prefetch is None or t.local_prefetch.table_version == 5 for t in tels)
