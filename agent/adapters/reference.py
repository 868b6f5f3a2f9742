"""The agent inside our reference engine (inference process, engine thread between steps).

Wires the router tap into the model, builds the local policy and the enforcer over the engine's slot pool,
expert provider and KV cache, and observes every step (`on_step`, the runner's hook): stall time by cause,
the local policy's prefetches, and a Telemetry window every `window_steps` steps: snapshotted on the engine
thread, built and handed to `sink` (the sidecar's queue, or a list in a test) by the outbox thread. It
never waits on the network: plans arrive through `apply`. With `local_predictor=True` it also runs the
plan's layer-ahead predictor on the route hook (agent/local_predictor.py) and adds its window counts (and
`queue_probe`'s queued KV blocks) to each Telemetry (schema v2). A plan's KV retention order (prefix hashes)
is not followed here, since these KV blocks carry no prefix hash: the ack says so and the windows count it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from tierplan.agent.enforcer import Enforcer
from tierplan.agent.local_policy import LocalPolicy, ScanRule
from tierplan.agent.local_predictor import LayerAheadPredictor
from tierplan.agent.outbox import Outbox
from tierplan.agent.taps import AttentionMassTap, RouterTap, TelemetryWindow, WindowDraft
from tierplan.controller.protocol import AckStatus, LayerSlots, Plan, PlanAck, Telemetry
from tierplan.runtime.engine.engine import ReferenceEngine
from tierplan.runtime.engine.executor import Reason
from tierplan.runtime.kv import Tier


class ReferenceAdapter:
    def __init__(self, engine: ReferenceEngine, agent_id: str = "agent-0", rank: int = 0, window_steps: int = 8,
                 hbm_budget_bytes: int | None = None, clock: Callable[[], float] = time.monotonic,
                 sink: Callable[[Telemetry], None] | None = None, scan_rule: ScanRule = ScanRule.LRU,
                 local_predictor: bool = False, queue_probe: Callable[[], int] | None = None) -> None:
        spec, pool, cache = engine.spec, engine.pool, engine.cache
        self.engine, self.window_steps, self.clock = engine, window_steps, clock
        self.queue_probe = queue_probe  # KV blocks the scheduler's waiting requests need (telemetry v2)
        self.tap = RouterTap(spec.moe_layers, spec.num_experts, engine.device.torch_device)
        self.policy = LocalPolicy(pool, engine.experts, scan_rule)
        if scan_rule is not ScanRule.LRU:  # the config chose the scan rule: it serves steps before any plan too
            engine.experts.set_chunk_order(self.policy.chunk_order)
            engine.experts.set_victim_order(self.policy.victim_order, self.policy)
        budget = hbm_budget_bytes or (pool.num_slots * pool.layout.stride_bytes
                                      + cache.manager.capacity[Tier.GPU] * cache.block_bytes)
        self.enforcer = Enforcer(pool, engine.experts, engine.loader, cache, self.policy, spec.moe_layers, budget,
                                 agent_id=agent_id, rank=rank, clock=clock)
        # The plan's layer-ahead predictor reads each MoE layer's routes on the host: only when asked for.
        self.predictor = (LayerAheadPredictor(spec.moe_layers, spec.num_experts, engine.experts, self.policy,
                                              pool.layout.stride_bytes) if local_predictor else None)
        self.mass_tap = AttentionMassTap(layers=(0,), every_steps=window_steps)
        route = self.tap if self.predictor is None else _RouteHook(self.tap, self.predictor)
        engine.set_hooks(route_tap=route, mass_observer=self.mass_tap)
        self.window = TelemetryWindow(agent_id, rank, spec.name, spec.num_layers, spec.num_experts, self.tap, clock,
                                      self.mass_tap)
        self.telemetry: list[Telemetry] = []
        self.sink = sink or self.telemetry.append
        self.outbox = Outbox(self.sink)
        self.steps = 0
        self._routed = 0  # the tap's first-layer rows at the last step (its step-token mark)
        self.kv_retention_unsupported = 0  # applied plans whose kv_retention this engine could not follow
        self._warm_up(spec.top_k, engine.device.torch_device)
        self.mass_tap.begin_step(0)
        self._last = self._counters()

    def _warm_up(self, top_k: int, device: object) -> None:
        """At attach, before any step: close one window over a dummy route per MoE layer (the tap's fold, top
        pairs and host copy) and build its Telemetry, then discard it all. First uses are slow (lazy CUDA kernel
        loads, first validations): the first window of a decode run cost as much as many decode steps (figures:
        bench/results/design_notes.md), which would otherwise land on a serving step. Leaves the tap, the
        counters and the window sequence as new."""
        k = max(1, top_k)
        ids = torch.arange(k, device=device).expand(len(self.tap.moe_layers), 1, k)  # [L, 1, k]
        self.tap.add_all(ids, torch.full(ids.shape, 1.0 / k, device=device))
        self._last = self._counters()
        self._close_window().build()
        self.window.restart()

    def _counters(self) -> dict[str, Any]:
        e, c = self.engine.experts, self.engine.cache
        links = self.engine.transfer.stats()["links"]
        chunked = self.engine.executors.reasons[Reason.LAYER_OVER_SLOTS]
        return {"expert_stall_ms": e.stalls_ms, "kv_stall_s": c.fetch_s, "chunked": chunked, "expert_hits": e.hits,
                "expert_misses": e.misses, "kv_hits": c.gpu_hits, "kv_misses": dict(c.misses_by_tier),
                "links": {k: dict(v) for k, v in links.items()}}

    def apply(self, plan: Plan) -> PlanAck:
        ack = self.enforcer.apply(plan)
        if self.predictor is not None and ack.status is AckStatus.APPLIED:
            self.predictor.install(plan)
        retention = plan.get("kv_retention") if isinstance(plan, Mapping) else getattr(plan, "kv_retention", ())
        if ack.status is AckStatus.APPLIED and retention:
            # Our engine's KV blocks belong to one sequence each and carry no prefix hash, so a keep-first order
            # of prefix hashes names nothing its spill order ranks: counted and said, never silently dropped.
            self.kv_retention_unsupported += 1
            ack = ack.model_copy(update={"reason": f"KV retention of {len(retention)} prefixes not applied: the "
                                         "reference engine's KV blocks carry no prefix hash"})
        return ack

    def on_step(self, batch: object, step_s: float) -> None:
        stall_ms, kv_s = self.engine.experts.stalls_ms, self.engine.cache.fetch_s
        chunked = self.engine.executors.reasons[Reason.LAYER_OVER_SLOTS]  # the engine counts each step's executor
        # The tap counts the routed rows on the host (eager and graph steps alike): the step's tokens are the
        # first MoE layer's rows since the last step (its counters restart with each window).
        routed = self.tap.tokens[0] if self.tap.tokens else 0
        decodes = getattr(batch, "decodes", None)  # the scheduler's Batch: one token per decoding sequence
        self.window.observe_step(step_s, (stall_ms - self._last["expert_stall_ms"]) / 1e3,
                                 kv_s - self._last["kv_stall_s"], tokens=routed - self._routed,
                                 decode_tokens=len(decodes) if decodes is not None else None,
                                 chunked=chunked > self._last["chunked"])
        self._routed = routed
        self._last.update(expert_stall_ms=stall_ms, kv_stall_s=kv_s, chunked=chunked)
        self.policy.run_prefetch(self.clock())
        if self.predictor is not None:
            self.predictor.end_step()
        self.steps += 1
        self.mass_tap.begin_step(self.steps)  # decides whether the next step is sampled
        if self.steps % self.window_steps == 0:
            self.outbox.put(self._close_window())  # the message is built off the engine thread

    def flush(self) -> Telemetry:
        """Close the current window now and hand it on; returns once it (and every earlier one) is sunk."""
        self.outbox.join()
        msg = self._close_window().build()
        self.sink(msg)
        return msg

    def close(self) -> None:
        """Send what is queued and stop the outbox thread."""
        self.outbox.close()

    def _fallbacks(self) -> dict[str, int]:
        """The local policy's fallback counters, plus telemetry windows that failed to build (never silent)."""
        out = dict(self.policy.fallbacks)
        if self.predictor is not None:  # the layer-ahead prefetches the plan wanted but could not start
            out |= {f"local_prefetch_{k}": self.predictor.counts[k] for k in ("skipped_no_slot", "failed")}
        if self.outbox.failed:
            out["telemetry_build_failed"] = self.outbox.failed
        if self.kv_retention_unsupported:
            out["plan_kv_retention_unsupported"] = self.kv_retention_unsupported
        return out

    def _close_window(self) -> WindowDraft:
        """Between steps, on the engine thread: snapshot the taps (their only host sync) and the counters."""
        now, last = self._counters(), self._last
        links = {}
        for name, s in now["links"].items():
            n = s["transfers"] - last["links"][name]["transfers"]
            q = s["queue_delay_s_sum"] - last["links"][name]["queue_delay_s_sum"]
            mean_ms = q / n * 1e3 if n else 0.0
            links[name] = {"bytes": s["bytes"] - last["links"][name]["bytes"], "queue_delay_ms_mean": mean_ms,
                           "queue_delay_ms_max": s["queue_delay_s_max"] * 1e3}  # max since start, not per window
        cache = self.engine.cache
        draft = self.window.close_draft(
            kv_blocks=cache.tier_usage(),
            kv_hits={"gpu": now["kv_hits"] - last["kv_hits"], "cpu": 0, "nvme": 0},
            kv_misses={"gpu": 0, **{t.value: now["kv_misses"][t] - last["kv_misses"][t] for t in now["kv_misses"]}},
            links=links, expert_hits=now["expert_hits"] - last["expert_hits"],
            expert_misses=now["expert_misses"] - last["expert_misses"],
            plan_version=self.enforcer.applied_version, fallbacks=self._fallbacks())
        self._last, self._routed = now, 0  # the snapshot restarted the tap's token counters
        extra: dict[str, Any] = {}
        if self.queue_probe is not None:
            extra["queued_kv_blocks"] = int(self.queue_probe())
        if self.enforcer.applied_version > 0:  # the split in force (before any plan: the engine's, not reported)
            extra["kv_gpu_limit_blocks"] = cache.manager.limit(Tier.GPU)
            extra["expert_slots"] = tuple(LayerSlots(layer=layer, slots=n)
                                          for layer, n in self.enforcer.expert_slots.items())
        # The predictor's pairs and unions are listed and made into protocol parts by the outbox thread.
        deferred = (self.predictor.window_snapshot().fields,) if self.predictor is not None else ()
        if extra or deferred:
            draft = dataclasses.replace(draft, fields={**draft.fields, **extra}, deferred=draft.deferred + deferred)
        return draft


class _RouteHook:
    """The route hook with the layer-ahead predictor (engine thread). Per layer in eager steps, mid-step, so the
    predictor may prefetch for the next layer; all layers at once after a CUDA graph replay (`add_all`), when it
    only observes: the router tap and the predictor each take the step in a few kernels, not a few per layer."""

    def __init__(self, tap: RouterTap, predictor: LayerAheadPredictor) -> None:
        self.tap, self.predictor = tap, predictor

    def __call__(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        self.tap(layer, ids, weights)
        self.predictor.on_route(layer, ids)

    def add_all(self, ids: torch.Tensor, weights: torch.Tensor) -> None:
        self.tap.add_all(ids, weights)
        self.predictor.observe_all(ids)
