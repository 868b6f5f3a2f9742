"""The issue's fault test, on real processes: the CPU reference engine with its agent and a ServiceLink, a
`tierplan sidecar` process and a `tierplan serve` process on SQLite. The service is SIGKILLed mid-replay.

The story: the engine applies a plan the service issued; the service dies; the engine keeps decoding (steps
complete, windows are produced, and no socket call ever ran on an engine-facing thread); the sidecar goes
last_good, then safe_static after its 1 s TTL (each counted in its metrics) and, its queue bounded at 8
windows, drops the oldest (counted); the service comes back on the same database; the sidecar re-registers,
flushes its queue (the windows reach the DB) and polls plans again (the new service process counts the polls).
At the end every window the agent produced is accounted for: produced == delivered (in the DB) + dropped
(link + sidecar, by reason), each number read from its own process.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import httpx

from tests.agent.sidecar.helpers import balanced_link, wait_until
from tests.agent.sidecar.procs import kill, scrape, start_service, start_sidecar, stop, total
from tierplan.agent.closed_loop import InProcessLoop
from tierplan.agent.service_link import ServiceLink
from tierplan.agent.sidecar_backoff import Backoff
from tierplan.api.demo_loop import tiny_registration
from tierplan.api.stack import free_port

AGENT = "fault-agent"
HELD = 8  # the sidecar's queue bound: windows it keeps while the service is away


class Replay:
    """The demo's tiny engine and phased requests, replayed round after round on a thread until stopped."""

    def __init__(self, workdir: Path, num_requests: int = 12) -> None:
        from tierplan.api import demo_loop as d
        from tierplan.runtime.device import Device
        from tierplan.runtime.engine.engine import EngineConfig, ReferenceEngine
        from tierplan.runtime.engine.presets import preset
        from tierplan.runtime.engine.routing_trace import RoutingTrace

        self.d = d
        self.reqs, _ = d.phased_requests(num_requests)
        self.kv_floor = max(-(-(r.prompt_len + r.output_len) // d.BLOCK_TOKENS) for r in self.reqs) + 1
        self.budget_bytes = d.BUDGET_UNITS * 4096
        self.engine = ReferenceEngine(preset("tiny"), Device("cpu"), EngineConfig(
            block_tokens=d.BLOCK_TOKENS, resident_frac=1.0, kv_gpu_blocks=d.KV_GPU_CAPACITY,
            kv_cpu_blocks=d.KV_CPU_BLOCKS, kv_nvme_blocks=d.KV_NVME_BLOCKS, workdir=workdir))
        self.trace = RoutingTrace.load(d.DATA / "routing/flame_moe_290m_sample.npz")
        self.sched: Any = None
        self.loop: Any = None
        self.steps = 0
        self.rounds = 0
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def attach(self, link: ServiceLink) -> None:
        self.loop = InProcessLoop(self.engine, link, window_steps=self.d.WINDOW_STEPS, on_applied=self._follow,
                                  hbm_budget_bytes=self.budget_bytes, agent_id=AGENT)

    def _follow(self, plan: Any) -> None:  # admission follows the plan's GPU KV share, as in the demo
        self.sched.gpu_blocks = min(self.d.KV_GPU_CAPACITY, plan.kv_blocks_per_tier["gpu"])

    def _hook(self, batch: Any, step_s: float) -> None:
        self.loop.on_step(batch, step_s)
        self.steps += 1

    def _run(self) -> None:
        from tierplan.runtime.engine.runner import ForcedRouter, Runner
        from tierplan.runtime.engine.scheduler import PreemptMode, Scheduler

        d = self.d
        try:
            while not self.stop.is_set():
                self.sched = Scheduler(d.KV_GPU_CAPACITY, d.BLOCK_TOKENS, max_batch=d.MAX_BATCH,
                                       preempt=PreemptMode.SWAP)
                Runner(self.engine, self.sched, ForcedRouter(self.trace, self.engine), on_step=self._hook,
                       virtual_step_s=d.VIRTUAL_STEP_S).run(self.reqs)
                self.rounds += 1
        except BaseException as exc:  # surfaced by the test, never swallowed
            self.error = exc

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(timeout=600)
        if self.loop is not None:
            self.loop.finish()
        self.engine.close()


def test_the_service_dies_mid_replay_and_the_engine_never_waits_and_nothing_vanishes(tmp_path: Path) -> None:
    token = "tp_fault_" + os.urandom(8).hex()
    port = free_port()
    db, url, sock = f"sqlite:///{tmp_path / 'fault.db'}", f"http://127.0.0.1:{port}", str(tmp_path / "agent.sock")
    auth = {"Authorization": f"Bearer {token}"}
    service = start_service(db, port, token, tmp_path)
    car, metrics_port = start_sidecar(url, sock, token, "--plan-ttl-s", "1", "--flush-s", "0.1", "--poll-s", "0.1",
                                      "--backoff-cap-s", "0.5", "--max-queued-windows", str(HELD))
    link: ServiceLink | None = None
    replay: Replay | None = None
    try:
        replay = Replay(tmp_path / "engine")
        reg = tiny_registration(AGENT, kv_gpu_blocks_min=replay.kv_floor)
        link = ServiceLink(sock, reg, reconnect=Backoff(0.01, 0.2))
        replay.attach(link)
        replay.thread.start()
        loop = replay.loop

        # 1. The loop runs through the service: a plan it issued is applied by the engine.
        wait_until(lambda: loop.stats()["applied"] >= 1 or replay.error, "the engine applied a service plan", 300)
        assert replay.error is None, replay.error
        applied_before = loop.stats()["applied"]
        delivered_at_kill = _windows_in_db(url, auth)

        # 2. The service dies. The engine keeps stepping; the sidecar goes fail-static and drops the oldest.
        kill(service)
        steps_at_kill, produced_at_kill = replay.steps, link.stats()["produced"]
        def degraded() -> bool:
            m = scrape(metrics_port)
            return replay.error is not None or (
                total(m, "tierplan_sidecar_fail_static_total", mode="safe_static") >= 1
                and total(m, "tierplan_sidecar_windows_dropped_total", reason="queue_full") >= 1)

        wait_until(degraded, "safe static, and the sidecar's bounded queue overflowed", 300)
        assert replay.error is None, replay.error
        down = scrape(metrics_port)
        assert total(down, "tierplan_sidecar_fail_static") == 1
        assert total(down, "tierplan_sidecar_fail_static_total", mode="last_good") == 1
        assert total(down, "tierplan_sidecar_service_errors_total") >= 1
        assert total(down, "tierplan_sidecar_retries_total") >= 1
        assert replay.steps > steps_at_kill and link.stats()["produced"] > produced_at_kill  # decoding went on
        assert link.stats()["engine_thread_io"] == 0
        assert total(down, "tierplan_sidecar_queue_depth") == HELD  # the newest windows, held for the return

        # 3. The service returns on the same database: re-registration, the queue flushed, polling again.
        service = start_service(db, port, token, tmp_path)
        wait_until(lambda: total(scrape(metrics_port), "tierplan_sidecar_fail_static") == 0
                   and total(scrape(metrics_port), "tierplan_sidecar_registrations_total") >= 2,
                   "the sidecar is back online and registered again", 120)
        wait_until(lambda: _plan_polls(url) >= 1, "the new service process answered plan polls", 60)

        # 4. Stop the engine; everything still queued drains.
        replay.finish()
        assert replay.error is None, replay.error
        assert link.drain(timeout_s=60)
        wait_until(lambda: total(scrape(metrics_port), "tierplan_sidecar_queue_depth") == 0
                   and total(scrape(metrics_port), "tierplan_sidecar_windows_received_total")
                   == link.stats()["sent"], "the sidecar received every window sent and emptied its queue", 60)
        wait_until(lambda: _windows_in_db(url, auth) == total(scrape(metrics_port),
                                                              "tierplan_sidecar_windows_sent_total"),
                   "the windows the sidecar sent are in the database", 60)

        # 5. The books: each number from its own process.
        st, side = link.stats(), scrape(metrics_port)
        produced, delivered = st["produced"], _windows_in_db(url, auth)
        dropped_link = sum(st["dropped"].values())
        dropped_sidecar = total(side, "tierplan_sidecar_windows_dropped_total")
        print(f"fault test: produced={produced} delivered={delivered} dropped_link={st['dropped']} "
              f"dropped_sidecar={dropped_sidecar} steps={replay.steps} rounds={replay.rounds} "
              f"steps_during_outage>={replay.steps - steps_at_kill}")
        assert produced == len(loop.telemetry) and balanced_link(st)
        assert produced == delivered + dropped_link + dropped_sidecar
        assert dropped_sidecar == total(side, "tierplan_sidecar_windows_dropped_total", reason="queue_full") >= 1
        assert total(side, "tierplan_sidecar_windows_received_total") == delivered + dropped_sidecar
        assert total(side, "tierplan_sidecar_fail_static_total", mode="safe_static") == 1
        assert st["engine_thread_io"] == 0  # no socket call on an engine-facing thread, in the whole run
        assert loop.stats()["telemetry_refused"] == 0 and loop.stats()["planner_errors"] == 0
        assert loop.stats()["applied"] >= applied_before
        assert delivered >= delivered_at_kill + HELD  # what was held while away reached the database
    finally:
        if replay is not None and replay.thread.is_alive():
            replay.finish()
        if link is not None:
            link.close()
        print("sidecar:", stop(car)[-1500:])
        kill(service)


def _windows_in_db(url: str, auth: dict[str, str]) -> int:
    r = httpx.get(f"{url}/v1/agents/{AGENT}", headers=auth, timeout=5.0)
    r.raise_for_status()
    return int(r.json()["windows"])


def _plan_polls(url: str) -> float:
    """GET .../plan requests the (new) service process answered, from its own /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=5.0).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tierplan_http_requests_total{") and "/plan" in line and 'method="GET"' in line
               and "/plans" not in line)
