"""The agent of one vLLM engine rank (engine-core / worker process): windows out, plans in, KV limits to the
connector.

`VllmAgent` is built when the model loads (plugin.py) and driven by the capture's per-step hook. At the first
served step it registers and opens a `ServiceLink` to the sidecar (vLLM has sized its KV cache by then); every
`window_steps` steps a window goes to the link, and the newest plan the sidecar pushed is applied between
steps. What vLLM lets us control is the KV tiering of our connector: the plan's CPU and NVMe blocks become the
`KvLimits` the connector reads (`kv_limits()`, this object is the process's `KvLimitsSource`), with the
plan's `kv_retention` (the controller's KV reuse predictor's keep-first order of prefix hashes) as their
`retention`; the connector's prefix hits come back through `report_reuse` as the windows' reuse events. The rest is
advisory, with the reason in the PlanAck and a count in the windows' fallbacks: vLLM (main) has no expert
cache, so the expert part (bytes per layer, pins, eviction order, prefetch, local predictor) is not applied,
and vLLM sizes its GPU KV cache at start-up, so a different GPU block count is not applied either. A plan built
on another version is rejected STALE; one asking more than the connector's tiers hold, MALFORMED.
It never waits on the sidecar or the network (the link queues; its threads do the I/O) and never raises into
the engine: an error of ours is counted (`agent_errors`) and the engine goes on.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

from tierplan.agent.adapters.vllm.capture import RouterCapture
from tierplan.agent.adapters.vllm.kv_limits import KvLimits, clear_source, set_source
from tierplan.agent.adapters.vllm.registration import (
    build_registration,
    expert_footprint,
    kv_bytes_per_token,
    model_id,
    tier_capacity,
)
from tierplan.agent.adapters.vllm.settings import VllmPluginSettings
from tierplan.agent.adapters.vllm.stats_inbox import StatsInbox
from tierplan.agent.adapters.vllm.windows import VllmWindows
from tierplan.agent.service_link import ServiceLink
from tierplan.agent.sidecar import default_socket_path
from tierplan.controller.protocol import AckStatus, Footprint, Plan, PlanAck, RejectReason, Telemetry, Tier

MAX_REASON_CHARS = 2000
CONNECTOR_PREFIX = "kv_connector_"  # the connector's failure counts, as fallbacks


class PlanRefused(Exception):
    def __init__(self, code: RejectReason, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class VllmAgent:
    """See the module docstring. `make_link(socket_path, registration)` opens the link (a test may fake it)."""

    def __init__(self, capture: RouterCapture, vllm_config: Any, settings: VllmPluginSettings, rank: int = 0,
                 make_link: Callable[[str, Any], ServiceLink] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.capture, self.vllm_config, self.settings, self.rank = capture, vllm_config, settings, rank
        self.clock = clock
        self.socket_path = settings.socket_path(default_socket_path(settings.agent_id))
        self._make_link = make_link or (lambda path, reg: ServiceLink(
            path, reg, max_queued_windows=settings.max_queued_windows))
        self._lock = threading.Lock()
        self.link: ServiceLink | None = None
        self.inbox: StatsInbox | None = None
        self.applied_version = 0
        self._limits: KvLimits | None = None
        self.counts: Counter[str] = Counter()  # plans_applied, plans_rejected, *_advisory, agent_errors
        self.last_ack: PlanAck | None = None
        self.last_error = ""
        # Set when our connector reads the limits or reports in this process: only then does the plan's KV part
        # bind anything (no connector, another connector, or a scheduler in another process: advisory).
        self.connector_seen = False
        self.closed = False
        self._retry_open_s = 0.0  # no link open before this clock reading (back-off after a failure)
        self.windows = VllmWindows(capture, settings.agent_id, rank, model_id(str(vllm_config.model_config.model)),
                                   settings.window_steps, sink=self._sink, plan_version=lambda: self.applied_version,
                                   fallbacks=self._fallbacks, clock=clock)
        capture.on_step = self.on_step
        set_source(self)
        # vLLM never tells a plugin it shuts down: at interpreter exit the partial window and the queued ones are
        # sent (bounded wait) rather than lost uncounted. A weak reference: the hook must not keep a closed agent.
        ref = weakref.ref(self)
        atexit.register(lambda: (agent := ref()) is not None and agent.shutdown())

    # ---- engine thread, after each forward --------------------------------------------------------------
    def on_step(self, step_s: float, warmup: bool) -> None:
        try:
            if not warmup and self.link is None and self.clock() >= self._retry_open_s:
                self._try_open()
            if self.windows.on_step(step_s, warmup):
                self._take_plan()
        except Exception as exc:  # ours, never the engine's: counted and kept
            self.counts["agent_errors"] += 1
            self.last_error = f"{type(exc).__name__}: {exc}"

    def _try_open(self) -> None:
        """Open the link; a failure is counted, logged once, and retried with back-off (not every step)."""
        try:
            self._open()
        except Exception as exc:
            failures = self.counts["link_open_failures"] = self.counts["link_open_failures"] + 1
            if failures == 1:
                logging.getLogger("vllm.tierplan").warning(
                    "tierplan: cannot open the link to the sidecar (%s); retrying with back-off", exc)
            self.last_error = f"{type(exc).__name__}: {exc}"
            self._retry_open_s = self.clock() + min(60.0, 0.5 * 2 ** min(failures, 7))

    def _open(self) -> None:
        reg = build_registration(self.capture.shape, self.vllm_config, self.settings, self.rank)
        self.link = self._make_link(self.socket_path, reg)
        if self.rank == 0:  # vLLM's stats are the engine's, one stream: the first rank takes them
            self.inbox = StatsInbox(self.settings.stats_socket_path(self.socket_path), self.windows.kv.add_engine)

    def _sink(self, tel: Telemetry) -> None:  # outbox thread
        if self.link is not None:
            self.link.sync_from(tel)

    def _take_plan(self) -> None:
        plan = self.link.step_next() if self.link is not None else None
        if plan is None:
            return
        ack = self.apply(plan)
        self.last_ack = ack
        self.link.record_ack(ack)  # type: ignore[union-attr]

    # ---- plans ------------------------------------------------------------------------------------------
    def apply(self, plan: Plan) -> PlanAck:
        """Apply what vLLM lets us control, say in the ack what is advisory and why; or refuse the plan."""
        try:
            limits, advisory = self._check(plan)
        except PlanRefused as exc:
            self.counts["plans_rejected"] += 1
            return self._ack(plan, AckStatus.REJECTED, str(exc), exc.code)
        with self._lock:
            self._limits = limits
            self.applied_version = plan.version
        self.counts["plans_applied"] += 1
        return self._ack(plan, AckStatus.APPLIED, "; ".join(advisory))

    def _check(self, plan: Plan) -> tuple[KvLimits, list[str]]:
        shape = self.capture.shape
        s = self.settings
        if plan.base_version != self.applied_version:
            raise PlanRefused(RejectReason.STALE, f"base_version {plan.base_version} is not the applied version "
                                                  f"{self.applied_version}")
        if len(plan.expert_bytes_per_layer) != shape.num_layers:
            raise PlanRefused(RejectReason.MALFORMED, f"expert_bytes_per_layer: {len(plan.expert_bytes_per_layer)} "
                                                      f"layers, the model has {shape.num_layers}")
        kv = plan.kv_blocks_per_tier
        cpu_cap, nvme_cap = tier_capacity(self.vllm_config, s)
        caps = {Tier.CPU: cpu_cap, Tier.NVME: nvme_cap}
        for tier, cap in caps.items():
            if kv.get(tier, cap) > cap:
                raise PlanRefused(RejectReason.MALFORMED, f"kv_blocks_per_tier.{tier.value}: {kv[tier]} blocks "
                                                          f"exceed the connector's {tier.value} tier of {cap} blocks")
        # The KV reuse predictor's keep-first order: the connector's own keys, as its reuse events reported them.
        limits = KvLimits(plan_version=plan.version, cpu_blocks=kv.get(Tier.CPU, caps[Tier.CPU]),
                          nvme_blocks=kv.get(Tier.NVME, caps[Tier.NVME]), retention=tuple(plan.kv_retention))
        held = expert_footprint(shape)
        self.counts["plan_expert_part_advisory"] += 1
        advisory = [f"expert part advisory: vLLM has no expert cache and keeps all {shape.num_experts} experts of "
                    f"each MoE layer resident ({sum(held)} bytes); the plan's {sum(plan.expert_bytes_per_layer)} "
                    f"expert bytes, {len(plan.pinned_experts)} pins, {len(plan.eviction_priority)} eviction orders, "
                    f"{len(plan.prefetch)} prefetches and its local predictor are not applied"]
        gpu_blocks = int(self.vllm_config.cache_config.num_gpu_blocks or 0)
        if Tier.GPU in kv and kv[Tier.GPU] != gpu_blocks:
            self.counts["plan_gpu_kv_advisory"] += 1
            advisory.append(f"GPU KV advisory: vLLM sized its GPU KV cache at start-up ({gpu_blocks} blocks) and "
                            f"cannot resize it to {kv[Tier.GPU]}")
        if not self.connector_seen:
            self.counts["plan_kv_advisory"] += 1
            advisory.append("KV part advisory: tierplan's connector has not read the limits in this process (it is "
                            "not configured, another connector is, or its scheduler runs in another process), so "
                            f"the plan's CPU {limits.cpu_blocks} / NVMe {limits.nvme_blocks} blocks bind nothing yet")
        elif plan.kv_retention:
            self.counts["plan_kv_retention_applied"] += 1
            advisory.append(f"KV retention applied: the connector keeps {len(plan.kv_retention)} prefixes first")
        return limits, advisory

    def _ack(self, plan: Plan, status: AckStatus, reason: str, code: RejectReason | None = None) -> PlanAck:
        return PlanAck(agent_id=self.settings.agent_id, rank=self.rank, plan_id=plan.plan_id, version=plan.version,
                       status=status, reason_code=code, reason=reason[:MAX_REASON_CHARS], applied_s=self.clock(),
                       footprint=self.footprint())

    def footprint(self) -> Footprint:
        shape, cc = self.capture.shape, self.vllm_config.cache_config
        experts = expert_footprint(shape)
        levels = self.windows.kv.levels()
        gpu_bytes = int(cc.num_gpu_blocks or 0) * int(cc.block_size) * kv_bytes_per_token(self.vllm_config)
        return Footprint(expert_bytes_per_layer=experts, kv_blocks_per_tier={Tier(k): v for k, v in levels.items()},
                         total_hbm_bytes=sum(experts) + shape.dense_bytes + gpu_bytes)

    def _fallbacks(self) -> dict[str, int]:
        names = ("plan_expert_part_advisory", "plan_gpu_kv_advisory", "plan_kv_advisory", "agent_errors")
        out = {n: self.counts[n] for n in names}
        out.update({n: c for n, c in self.counts.items() if n.startswith(CONNECTOR_PREFIX)})
        out["link_open_failures"] = self.counts["link_open_failures"]
        out["capture_discarded_warmup_steps"] = self.capture.discarded_warmup_steps
        out["capture_hook_errors"] = self.capture.hook_errors
        if self.inbox is not None:
            out["engine_stats_bad"] = self.inbox.bad
        return out

    # ---- KvLimitsSource (the connector, any thread): memory only ----------------------------------------
    def kv_limits(self) -> KvLimits | None:
        with self._lock:
            self.connector_seen = True
            return self._limits

    def report_kv(self, hits_per_tier: dict[str, int], misses_per_tier: dict[str, int],
                  blocks_per_tier: dict[str, int]) -> None:
        self.connector_seen = True
        self.windows.kv.add(hits_per_tier, misses_per_tier, blocks_per_tier)

    def report_reuse(self, events: list[tuple[str, float, str]]) -> None:
        """The connector's prefix hits of one step (prefix hash, age in seconds, tier): into the window."""
        self.windows.kv.add_reuse(events)

    def report_failures(self, counts: dict[str, int]) -> None:
        """The connector's failures of one step (failed or corrupt loads, failed stores, ...): the windows'
        fallbacks, as `kv_connector_<name>` totals."""
        with self._lock:
            for name, n in counts.items():
                if n:
                    self.counts[CONNECTOR_PREFIX + str(name)] += int(n)

    # ---- lifecycle --------------------------------------------------------------------------------------
    def flush(self, timeout_s: float = 10.0) -> bool:
        """Close the partial window and wait (never on the engine thread) until the link sent everything."""
        self.windows.flush()
        return self.link.drain(timeout_s) if self.link is not None else True

    def stats(self) -> dict[str, Any]:
        return {"steps": self.capture.steps, "windows": self.windows.closed, "applied_version": self.applied_version,
                "counts": dict(self.counts), "unbound": dict(self.capture.unbound),
                "discarded_warmup_steps": self.capture.discarded_warmup_steps, "last_error": self.last_error,
                "hook_errors": self.capture.hook_errors,
                "link": self.link.stats() if self.link is not None else None,
                "engine_stats": self.inbox.received if self.inbox is not None else 0}

    def close(self) -> None:
        self.closed = True
        self.windows.outbox.close()
        if self.link is not None:
            self.link.close()
        if self.inbox is not None:
            self.inbox.close()
        clear_source(self)  # only if the slot still holds this agent: another engine of the process keeps its own

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """At exit: send what is left (a bounded wait) and close; errors are swallowed (the process is ending)."""
        if self.closed:
            return
        try:
            self.flush(timeout_s)
        except Exception as exc:  # nothing left to report to
            self.last_error = f"{type(exc).__name__}: {exc}"
        finally:
            self.close()
