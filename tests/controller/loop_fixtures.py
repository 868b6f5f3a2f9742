"""Builders for the controller-loop tests: a tiny model's controller and telemetry windows made in the test."""

from __future__ import annotations

from typing import Any

import numpy as np

from tierplan.controller.costmodel import ComputeParams, HardwareSpec
from tierplan.controller.loop import Controller, ControllerConfig, Solver
from tierplan.controller.model_shape import builtin_shape
from tierplan.controller.protocol import AckStatus, Footprint, Link, Plan, PlanAck, Telemetry, Tier, parse
from tierplan.controller.valuation import SplitSpace

SLOT_BYTES, BLOCK_BYTES = 12288, 4096
BUDGET_BYTES = 64 * 4096
KV_MIN, KV_MAX = 10, 64


def make_controller(solver: Solver = Solver.DP, hysteresis: float = 0.10, compute: ComputeParams | None = None,
                    transfer_overhead_s: float = 2e-4, calibrate: bool = True) -> Controller:
    shape = builtin_shape("tiny")
    hw = HardwareSpec(link_bytes_per_s=dict.fromkeys(Link, 2e9), transfer_overhead_s=transfer_overhead_s,
                      hbm_bytes=BUDGET_BYTES)
    space = SplitSpace(hbm_budget_bytes=BUDGET_BYTES, dense_bytes=0, workspace_bytes=0, slot_bytes=SLOT_BYTES,
                       kv_block_bytes=BLOCK_BYTES, kv_gpu_blocks_max=KV_MAX, kv_gpu_blocks_min=KV_MIN,
                       min_slots_per_layer=2, prefetch_recall=0.3)
    return Controller(ControllerConfig(shape=shape, hardware=hw, space=space, kv_cpu_blocks=128, kv_nvme_blocks=128,
                                       solver=solver, hysteresis=hysteresis, compute=compute,
                                       calibrate=calibrate))


class Windows:
    """Consecutive telemetry windows of one agent: `next(batch, kv_live, queued)` makes the following one."""

    def __init__(self, seed: int = 0, steps: int = 4) -> None:
        self.rng = np.random.default_rng(seed)
        self.seq, self.t, self.steps, self.applied = 0, 0.0, steps, 0
        self.hot = self.rng.dirichlet(np.ones(8) * 0.5, size=2)  # [L, E] routing distribution per layer

    def next(self, batch: int, kv_live: int, queued: int = 0, step_ms: float = 5.0, **over: Any) -> Telemetry:
        layers, unions, trans = [], [], []
        routes = [[self.rng.choice(8, size=2, replace=False, p=self.hot[m]) for _ in range(batch * self.steps)]
                  for m in range(2)]  # [L][T] the k=2 experts of each token
        for m in range(2):
            counts = np.zeros(8, dtype=int)
            for r in routes[m]:
                counts[r] += 1
            layers.append({"layer": m, "activation_counts": counts.tolist(), "router_entropy_mean": 0.5,
                           "num_tokens": batch * self.steps})
            steps = [sorted({int(e) for r in routes[m][s * batch:(s + 1) * batch] for e in r})
                     for s in range(self.steps)]
            unions.append({"layer": m, "batch_tokens": [batch] * self.steps, "unions": steps})
        pairs: dict[tuple[int, int], int] = {}
        for a, b in zip(routes[0], routes[1], strict=True):
            for s in a:
                for d in b:
                    pairs[(int(s), int(d))] = pairs.get((int(s), int(d)), 0) + 1
        trans.append({"layer": 0, "next_layer": 1, "num_tokens": batch * self.steps,
                      "pairs": [[s, d, c] for (s, d), c in sorted(pairs.items())]})
        data = {"agent_id": "agent-0", "rank": 0, "window_seq": self.seq, "window_start_s": self.t,
                "window_end_s": self.t + 0.02, "model": "tiny", "num_layers": 2, "num_experts": 8,
                "layers": layers, "kv": {"blocks_per_tier": {"gpu": min(kv_live, KV_MAX)}, "hits_per_tier": {},
                                         "misses_per_tier": {}},
                "stalls": [{"cause": "expert_miss", "count": 2, "total_ms": 1.0}],
                "step_timings_ms": {"num_steps": self.steps, "mean": step_ms, "p50": step_ms, "p99": step_ms},
                "expert_hits": 10, "expert_misses": 2, "applied_plan_version": self.applied,
                "transitions": trans, "step_unions": unions, "queued_kv_blocks": queued, **over}
        self.seq += 1
        self.t += 0.02
        return parse(Telemetry, data)


def ack(plan: Plan, status: AckStatus = AckStatus.APPLIED) -> PlanAck:
    fp = Footprint(expert_bytes_per_layer=plan.expert_bytes_per_layer,
                   kv_blocks_per_tier={Tier.GPU: plan.kv_blocks_per_tier[Tier.GPU]},
                   total_hbm_bytes=sum(plan.expert_bytes_per_layer) + plan.kv_blocks_per_tier[Tier.GPU] * BLOCK_BYTES)
    extra = {} if status is AckStatus.APPLIED else {"reason_code": "other", "reason": "test refusal"}
    return PlanAck(agent_id="agent-0", rank=0, plan_id=plan.plan_id, version=plan.version, status=status,
                   applied_s=0.0, footprint=fp, **extra)


def plan_total_bytes(plan: Plan) -> int:
    return sum(plan.expert_bytes_per_layer) + plan.kv_blocks_per_tier[Tier.GPU] * BLOCK_BYTES


def drive(ctl: Controller, win: Windows, phases: list[tuple[int, int, int, int]]) -> list[Plan]:
    """Feed (num_windows, batch, kv_live, queued) phases, acking every plan at once; the plans issued."""
    plans = []
    for n, batch, live, queued in phases:
        for _ in range(n):
            ctl.sync_from(win.next(batch, live, queued))
            plan = ctl.step_next()
            if plan is not None:
                plans.append(plan)
                ctl.record_ack(ack(plan))
                win.applied = plan.version
    return plans
