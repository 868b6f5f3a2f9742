"""The KV connector when things fail (tests/agent/vllm_connector_sim.py drives it like vLLM): a corrupt or unreadable
block never lets a block computed over it be stored and served later, keys a worker lost leave the books and every
worker, a full disk is counted and serving stays exact, and the failures reach the plan's source. No vLLM."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from tests.agent.vllm_connector_sim import BLOCK_TOKENS, FakeEngine, RecordingSource, block_hashes
from tierplan.agent.adapters.vllm.connector_catalog import OpKind, TierOp
from tierplan.agent.adapters.vllm.connector_config import ConnectorSettings, check_failure_policy
from tierplan.agent.adapters.vllm.connector_meta import BlockLoad, WorkerStep
from tierplan.agent.adapters.vllm.connector_worker import KvTierWorker
from tierplan.agent.adapters.vllm.kv_limits import prefix_hash
from tierplan.runtime.errors import TransferError
from tierplan.runtime.kv.spec import Tier

HEAD = [(i * 7 + 3) % 509 for i in range(2 * BLOCK_TOKENS)]
P1 = HEAD + [(i * 5 + 1) % 500 for i in range(9)]  # two full blocks and a tail
P2 = HEAD + [(i * 11 + 2) % 505 for i in range(3 * BLOCK_TOKENS + 9)]  # the same two, three more, a tail


def _keys(tokens: list[int]) -> list[str]:
    return [prefix_hash(h) for h in block_hashes(tokens)]


def _corrupt(eng: FakeEngine, key: str) -> None:
    w = eng.worker
    w._stores.memory(w.manager.location(w._blocks[key]))[100] ^= 0xFF  # one stored byte goes bad


def _stale(eng: FakeEngine) -> None:
    for caches in eng.caches_per_rank:  # vLLM's free blocks hold another request's bytes
        for t in caches.values():
            t.zero_()


def test_blocks_computed_over_a_failed_load_are_never_stored_or_served(tmp_path: Path) -> None:
    source = RecordingSource({})
    eng = FakeEngine(ConnectorSettings(cpu_blocks=16), None, source=source)
    try:
        keys = _keys(P2)
        eng.run("p1", P1)  # stores blocks 0 and 1
        _corrupt(eng, keys[1])
        _stale(eng)
        eng.run("p2", P2)  # block 1 fails its checksum; vLLM computes 1..4 again
        assert eng.recomputed_from == [1]
        assert eng.worker.stats.corrupt_loads == 1 and eng.worker.stats.poisoned_stores == 3
        assert all(eng.stored_blocks_exact().values())
        assert all(eng.worker.holds(k) for k in keys)  # stored again, from the recomputed (right) bytes
        _stale(eng)
        eng.run("p2-again", P2)  # hits 0..4 and checks every loaded block against computing it
        assert eng.external_blocks[-1] == 5 and eng.worker.stats.failed_loads == 1
        failures = {}
        for counts in source.failures:
            for name, n in counts.items():
                failures[name] = failures.get(name, 0) + n
        assert failures == {"failed_loads": 1, "corrupt_loads": 1, "poisoned_stores": 3}
    finally:
        eng.close()


def test_any_read_failure_frees_and_forgets_the_block(tmp_path: Path) -> None:
    eng = FakeEngine(ConnectorSettings(cpu_blocks=0, nvme_blocks=8, nvme_dir=str(tmp_path)), tmp_path / "kv.tpnvme")
    try:
        keys = _keys(P1)
        eng.run("p1", P1)  # both blocks into the NVMe file
        old_bid = eng.worker._blocks[keys[0]]
        nvme = eng.worker._stores.nvme_file
        real = nvme.read_into

        def fail_once(offset_bytes, dst):
            nvme.read_into = real
            raise OSError(errno.EIO, "Input/output error")

        nvme.read_into = fail_once
        eng.run("p1-again", P1)
        assert eng.recomputed_from == [0] and eng.worker.stats.corrupt_loads == 0
        assert eng.worker.stats.failed_loads == 1
        assert old_bid not in eng.worker.manager.blocks()  # freed, not kept under its key
        assert eng.worker.blocks_per_tier() == {t.value: n for t, n in eng.books.catalog.footprint().items()}
        assert all(eng.stored_blocks_exact().values())
    finally:
        eng.close()


def test_a_store_failing_on_one_of_two_workers_leaves_both_and_the_books_in_step(monkeypatch) -> None:
    eng = FakeEngine(ConnectorSettings(cpu_blocks=4), None, num_workers=2)
    try:
        rank0 = eng.workers[0]
        real = rank0.handler.write

        def fail_once(bid, data):
            monkeypatch.setattr(rank0.handler, "write", real)
            raise TransferError("EIO on rank 0")

        monkeypatch.setattr(rank0.handler, "write", fail_once)
        eng.run("a", P1)  # rank 0 fails block 0's store, rank 1 stores it: the books forget it
        eng.idle_step()  # and every worker drops it with the next step
        books = {t.value: n for t, n in eng.books.catalog.footprint().items()}
        assert eng.workers[0].blocks_per_tier() == eng.workers[1].blocks_per_tier() == books == {"cpu": 1, "nvme": 0}
        for i in range(3):
            eng.run(f"again{i}", P1)
        eng.run("x", [(i * 13 + 1) % 500 for i in range(BLOCK_TOKENS + 3)])
        eng.run("y", [(i * 17 + 2) % 500 for i in range(BLOCK_TOKENS + 3)])
        books = {t.value: n for t, n in eng.books.catalog.footprint().items()}
        assert eng.workers[0].blocks_per_tier() == eng.workers[1].blocks_per_tier() == books
        assert [w.stats.failed_stores for w in eng.workers] == [1, 0]
        assert all(eng.stored_blocks_exact().values())
    finally:
        eng.close()


def test_a_full_disk_is_counted_and_serving_stays_exact(tmp_path: Path) -> None:
    settings = ConnectorSettings(cpu_blocks=2, nvme_blocks=8, nvme_dir=str(tmp_path))
    source = RecordingSource({})
    eng = FakeEngine(settings, tmp_path / "kv.tpnvme", source=source)

    def enospc(offset_bytes, src):
        raise OSError(errno.ENOSPC, "No space left on device")

    eng.worker._stores.nvme_file.write_from = enospc
    try:
        prompts = [[(i * k + 1) % 500 for i in range(2 * BLOCK_TOKENS + 5)] for k in (3, 5, 7)]
        for n, p in enumerate(prompts * 2):
            eng.run(f"r{n}", p)  # every spill to the NVMe file fails
        for _ in range(2):  # a spill failing after its step: the books hear with the next step, the source after
            eng.idle_step()
        w = eng.worker
        assert w.stats.failed_moves > 0 and w.stats.moves == 0
        assert w.stats.failed_loads == 0  # a failed spill leaves the books: never a hit on a block not held
        assert w.blocks_per_tier() == {t.value: n for t, n in eng.books.catalog.footprint().items()}
        assert sum(c.get("failed_moves", 0) for c in source.failures) == w.stats.failed_moves
        assert all(eng.stored_blocks_exact().values())
    finally:
        eng.close()


def test_vllms_default_failure_policy_is_refused_by_name() -> None:
    check_failure_policy("recompute")
    for bad in ("fail", None):
        with pytest.raises(ValueError, match=r"kv_transfer_config\.kv_load_failure_policy is .*needs 'recompute'"):
            check_failure_policy(bad)


class _TwoMethodSource:
    """A source with only the two required methods; its first report raises."""

    def __init__(self) -> None:
        self.calls = 0

    def kv_limits(self):
        return None

    def report_kv(self, hits, misses, blocks) -> None:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("sidecar socket closed")


def test_report_failures_is_optional_and_carries_each_steps_own_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = _TwoMethodSource()
    eng = FakeEngine(ConnectorSettings(cpu_blocks=16), None, source=plain)
    try:
        eng.run("p1", P1)
        _corrupt(eng, _keys(P1)[0])
        eng.run("p1-again", P1)  # a failure, and a source without report_failures: serving goes on
        assert eng.books.stats.source_errors == 1 and eng.worker.stats.corrupt_loads == 1
    finally:
        eng.close()
    source = RecordingSource({})
    eng = FakeEngine(ConnectorSettings(cpu_blocks=16), None, source=source)
    monkeypatch.setattr(source, "report_kv", _TwoMethodSource().report_kv)  # raises once
    try:
        eng.run("p1", P1)
        eng.idle_step()
        _corrupt(eng, _keys(P1)[0])
        eng.run("p1-again", P1)
        eng.idle_step()
        assert source.failures == [{"source_errors": 1}, {"failed_loads": 1, "corrupt_loads": 1}]
    finally:
        eng.close()


def test_clear_source_clears_only_its_own_registration() -> None:
    from tierplan.agent.adapters.vllm import kv_limits

    a, b = RecordingSource({}), RecordingSource({})
    kv_limits.set_source(a)
    try:
        kv_limits.set_source(b)  # a second engine in this process registers its own
        assert not kv_limits.clear_source(a) and kv_limits.current_source() is b  # the first going away keeps b
        assert kv_limits.clear_source(b) and kv_limits.current_source() is None
    finally:
        kv_limits.set_source(None)


P3 = HEAD + [(i * 13 + 4) % 503 for i in range(3 * BLOCK_TOKENS + 5)]  # HEAD, three other blocks, a tail


def _fail_p2_while(eng: FakeEngine, sharer_tokens_in_step_n: int) -> None:
    """Request a loads HEAD's blocks from our tiers and block 1 fails its checksum (step N). Sharer b holds a's
    blocks 0 and 1 through vLLM's own prefix cache: scheduled in step N with `sharer_tokens_in_step_n` tokens
    (completing no block), or from step N+1 on, which async scheduling builds before step N's report arrives."""
    eng.run("p1", P1)
    _corrupt(eng, _keys(P1)[1])
    _stale(eng)
    a = eng.admit("a", P2)
    b = eng.admit("b", P3, shared=a, local_blocks=2)
    first = {"a": len(P2) - a.computed}
    if sharer_tokens_in_step_n:
        first["b"] = sharer_tokens_in_step_n
    report_n = eng.step(first)
    assert report_n.failed_load_block_ids == {a.ids[1]}
    report_n1 = eng.step({"b": len(P3) - b.computed})  # b's blocks 2..4, computed over the bad block 1
    eng.deliver(report_n)
    eng.deliver(report_n1)
    assert a.computed == b.computed == BLOCK_TOKENS  # vLLM computes both again from block 1
    eng.step({"a": len(P2) - a.computed, "b": len(P3) - b.computed})
    eng.books.finished(a.req)
    eng.books.finished(b.req)


@pytest.mark.parametrize("sharer_tokens_in_step_n", [0, 10])
def test_a_failed_load_pauses_every_store_until_the_scheduler_heard_of_it(sharer_tokens_in_step_n: int) -> None:
    eng = FakeEngine(ConnectorSettings(cpu_blocks=32), None)
    try:
        _fail_p2_while(eng, sharer_tokens_in_step_n)
        # Skipped in step N+1; offered again only if the books rewound b too (it shared the block in step N).
        assert [eng.worker.holds(k) for k in _keys(P3)[2:5]] == [bool(sharer_tokens_in_step_n)] * 3
        assert eng.worker.stats.poisoned_stores == 6  # a's blocks 2..4 (step N), b's 2..4 (step N+1)
        assert all(eng.stored_blocks_exact().values())
        assert all(eng.worker.holds(k) for k in _keys(P2))  # a stored again from block 1 once the books heard
        _stale(eng)
        eng.run("p3", P3)  # hits HEAD's blocks; every loaded block is checked against computing it
        eng.run("p2-again", P2)
        assert eng.external_blocks[-1] == 5 and all(eng.stored_blocks_exact().values())
    finally:
        eng.close()


def test_the_reviewers_probe_a_sharer_without_a_store_in_the_failing_step() -> None:
    """Step N: a's load of block 3 fails while b shares it but stores nothing; step N+1, built before the report,
    stores a block of b computed over it."""
    w = KvTierWorker({Tier.CPU: 8, Tier.NVME: 0}, None)
    try:
        w.register({f"l{i}": torch.randn(16, 2, 32, 64).to(torch.bfloat16) for i in range(2)})
        step_n = WorkerStep(8, 0, loads=(BlockLoad("kA0", 3, "A", 0),), req_blocks={"B": (3, 4)}, seq=7)
        w.load(step_n.loads)
        w.apply(step_n)
        report = w.take_report()
        assert report.epoch == 7 and report.failed_from == {"A": 0, "B": 0}
        store_b2 = TierOp(OpKind.STORE, "kB2", Tier.CPU)
        w.apply(WorkerStep(8, 0, ops=(store_b2,), store_blocks={"kB2": 5}, seq=8, ack_epoch=0))
        assert not w.holds("kB2") and w.stats.poisoned_stores == 1 and w.take_report().failed_keys == {"kB2"}
        w.apply(WorkerStep(8, 0, ops=(store_b2,), store_blocks={"kB2": 5}, seq=9, ack_epoch=7))  # heard of it
        assert w.holds("kB2") and w.stats.poisoned_stores == 1
    finally:
        w.close()


def test_no_request_record_outlives_its_request() -> None:
    eng = FakeEngine(ConnectorSettings(cpu_blocks=32), None)
    try:
        _fail_p2_while(eng, 10)
        aborted = eng.admit("aborted", P1)  # looked up and allocated, aborted before its first step
        eng.books.finished(aborted.req)
        eng.run("p3", P3)
        assert eng.books._reqs == {} and eng.books._lookups == {}
        eng.idle_step()
        assert eng.worker.take_report().is_empty()  # nothing of a finished request is carried in the worker
    finally:
        eng.close()
