"""The KV connector's scheduler side with its worker, driven like vLLM drives them (tests/agent/vllm_connector_sim.py):
prefix hits over our tiers, loads that bring back exactly the stored bytes, the plan's limits held after every step
as they change, retention kept, and a failing limits source never breaking a step. No vLLM: runs in `make test`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.agent.vllm_connector_sim import BLOCK_TOKENS, FakeEngine, RecordingSource, block_hashes
from tierplan.agent.adapters.vllm.connector_config import ConnectorSettings
from tierplan.agent.adapters.vllm.kv_limits import KvLimits, prefix_hash
from tierplan.runtime.kv.spec import Tier


def prompt(prefix_seed: int, prefix_blocks: int, tail_seed: int, tail_tokens: int = 7) -> list[int]:
    base = [(prefix_seed * 7919 + i * 31) % 500 for i in range(prefix_blocks * BLOCK_TOKENS)]
    return base + [(tail_seed * 104729 + i * 17) % 500 for i in range(tail_tokens)]


@pytest.fixture
def settings(tmp_path: Path) -> ConnectorSettings:
    return ConnectorSettings(cpu_blocks=3, nvme_blocks=4, nvme_dir=str(tmp_path))


def test_a_repeated_prefix_hits_first_from_cpu_then_after_a_spill_from_nvme(settings, tmp_path: Path) -> None:
    eng = FakeEngine(settings, tmp_path / "kv.tpnvme")
    try:
        eng.run("a", prompt(1, 3, 1))  # 3 full blocks stored on CPU
        eng.run("b", prompt(1, 3, 2))  # same prefix, other tail: 3 blocks from CPU
        assert eng.external_blocks == [0, 3]
        assert eng.books.stats.hit_blocks_per_tier == {"cpu": 3, "nvme": 0}
        eng.run("c", prompt(2, 3, 3))  # another prefix fills the CPU: a's blocks go to NVMe
        assert eng.footprints[-1] == {"cpu": 3, "nvme": 3}
        eng.run("d", prompt(1, 3, 4))
        assert eng.external_blocks[-1] == 3
        assert eng.books.stats.hit_blocks_per_tier["nvme"] == 3
        assert eng.worker.stats.loads_per_tier == {"cpu": 3, "nvme": 3}
        assert eng.worker.stats.stores_per_tier["cpu"] >= 6 and eng.worker.stats.moves >= 3
    finally:
        eng.close()


def test_the_prompts_last_token_is_never_served_from_the_tiers(settings, tmp_path: Path) -> None:
    eng = FakeEngine(settings, tmp_path / "kv.tpnvme")
    try:
        toks = prompt(5, 2, 0, tail_tokens=0)  # exactly two full blocks
        eng.run("a", toks)
        eng.run("b", toks)
        assert eng.external_blocks == [0, 1]  # vLLM must compute at least the last token: one block recomputed
    finally:
        eng.close()


def test_changing_plan_limits_are_never_exceeded_and_reports_follow_the_agent_convention(tmp_path: Path) -> None:
    settings = ConnectorSettings(cpu_blocks=4, nvme_blocks=6, nvme_dir=str(tmp_path))
    source = RecordingSource({0: KvLimits(1, 2, 3), 5: KvLimits(2, 1, 1), 9: KvLimits(3, 0, 2), 13: KvLimits(4, 3, 0)})
    eng = FakeEngine(settings, tmp_path / "kv.tpnvme", source=source)
    try:
        for i in range(16):
            eng.run(f"r{i}", prompt(i % 2, 2 + (i // 2) % 2, i))
        for fp, limits in zip(eng.footprints, source.limits_at_report, strict=True):
            assert fp["cpu"] <= limits.cpu_blocks and fp["nvme"] <= limits.nvme_blocks, (fp, limits)
        for (_, _, blocks), limits in zip(source.reports, source.limits_at_report, strict=True):
            assert blocks["cpu"] <= limits.cpu_blocks and blocks["nvme"] <= limits.nvme_blocks
        assert eng.worker.stats.limit_violations == 0 and eng.worker.stats.footprint_checks > 0
        hits = sum(r[0]["gpu"] for r in source.reports)
        served = {t: sum(r[1][t] for r in source.reports) for t in ("cpu", "nvme")}
        assert hits == 0  # the fake engine has no prefix cache of its own
        assert served == eng.books.stats.hit_blocks_per_tier and sum(served.values()) > 0
        assert sum(r[1]["gpu"] for r in source.reports) == eng.books.stats.recomputed_blocks
        assert eng.books.stats.plan_version == 4
    finally:
        eng.close()


def test_retained_prefixes_survive_a_stream_of_other_prefixes(tmp_path: Path) -> None:
    settings = ConnectorSettings(cpu_blocks=2, nvme_blocks=2, nvme_dir=str(tmp_path))
    keep = prompt(99, 2, 0)
    retention = tuple(prefix_hash(h) for h in block_hashes(keep))
    source = RecordingSource({0: KvLimits(1, 2, 2, retention)})
    eng = FakeEngine(settings, tmp_path / "kv.tpnvme", source=source)
    try:
        eng.run("keep", keep)
        for i in range(6):
            eng.run(f"other{i}", prompt(i, 2, i))
        assert all(k in eng.books.catalog for k in retention)
        assert all(eng.worker.holds(k) for k in retention)
        eng.run("again", prompt(99, 2, 1))
        assert eng.external_blocks[-1] == 2
        # Without the retention order the same stream evicts them (least recent use alone).
        eng2 = FakeEngine(settings, tmp_path / "kv2.tpnvme", source=RecordingSource({0: KvLimits(1, 2, 2)}))
        try:
            eng2.run("keep", keep)
            for i in range(6):
                eng2.run(f"other{i}", prompt(i, 2, i))
            assert not any(k in eng2.books.catalog for k in retention)
        finally:
            eng2.close()
    finally:
        eng.close()


def test_a_failing_source_keeps_the_last_limits_and_is_counted(tmp_path: Path) -> None:
    settings = ConnectorSettings(cpu_blocks=4, nvme_blocks=0)

    class Flaky(RecordingSource):
        def kv_limits(self) -> KvLimits | None:
            if self.calls >= 1:
                self.calls += 1
                raise ConnectionError("sidecar gone")
            return super().kv_limits()

    source = Flaky({0: KvLimits(3, 1, 0)})
    eng = FakeEngine(settings, None, source=source)
    try:
        for i in range(4):
            eng.run(f"r{i}", prompt(i, 2, i))
        assert eng.books.stats.source_errors == 3 and "sidecar gone" in eng.books.stats.last_source_error
        assert max(fp["cpu"] for fp in eng.footprints) == 1  # the plan's 1 block held, not the default 4
    finally:
        eng.close()


def test_without_a_plan_the_configured_blocks_are_the_limits(tmp_path: Path) -> None:
    settings = ConnectorSettings(cpu_blocks=2, nvme_blocks=0)
    eng = FakeEngine(settings, None, source=RecordingSource({0: KvLimits(0, 0, 0)}))
    try:
        eng.run("a", prompt(1, 3, 0))
        assert eng.footprints[-1]["cpu"] == 2 and eng.books.catalog.limits[Tier.CPU] == 2
    finally:
        eng.close()


def test_prefix_hits_are_reported_as_reuse_events_with_their_age_and_tier(tmp_path: Path) -> None:
    settings = ConnectorSettings(cpu_blocks=2, nvme_blocks=4, nvme_dir=str(tmp_path))
    source = RecordingSource({})
    eng = FakeEngine(settings, tmp_path / "kv.tpnvme", source=source)
    try:
        first = prompt(3, 3, 0)
        eng.run("a", first)  # t = 0: 3 blocks stored, the first one spilled to NVMe
        eng.now_s = 5.0
        eng.run("b", prompt(3, 3, 1))
        keys = [prefix_hash(h) for h in block_hashes(first)]
        assert source.reuse == [(keys[0], 5.0, "nvme"), (keys[1], 5.0, "cpu"), (keys[2], 5.0, "cpu")]
        eng.now_s = 7.5
        eng.run("c", prompt(3, 1, 2))
        assert source.reuse[-1] == (keys[0], 2.5, "nvme")  # age since the last hit, not since the store
    finally:
        eng.close()


def test_a_reset_serves_no_more_hits_and_frees_every_block_with_the_next_step(settings, tmp_path: Path) -> None:
    eng = FakeEngine(settings, tmp_path / "kv.tpnvme")
    try:
        eng.run("a", prompt(1, 3, 1))
        assert eng.footprints[-1] == {"cpu": 3, "nvme": 0}
        eng.books.reset()
        eng.run("b", prompt(1, 3, 2))  # the same prefix: no hit; its blocks are stored afresh after the drops
        assert eng.external_blocks == [0, 0]
        assert eng.worker.stats.drops == 3 and eng.footprints[-1] == {"cpu": 3, "nvme": 0}
        assert eng.books.stats.resets == 1
    finally:
        eng.close()
