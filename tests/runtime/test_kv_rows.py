"""The KV cache's per-sequence GPU rows kept between steps (`ensure_seqs_on_gpu`, `gpu_rows`) say what a fresh
lookup says, whatever moved, went or grew in between, and a step with nothing moved looks up only new blocks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tierplan.runtime.device import Device
from tierplan.runtime.engine.engine import EngineConfig, ReferenceEngine
from tierplan.runtime.engine.presets import preset
from tierplan.runtime.kv import Tier

BT = 16


@pytest.fixture
def engine(tmp_path: Path):
    eng = ReferenceEngine(preset("tiny"), Device("cpu"), EngineConfig(
        block_tokens=BT, kv_gpu_blocks=48, kv_cpu_blocks=32, kv_nvme_blocks=32, workdir=tmp_path))
    yield eng
    eng.close()


def _fresh(cache, seqs: list[int]) -> list[list[int]]:
    return [cache.gpu_indices(s) for s in seqs]


@pytest.mark.parametrize("seed", range(4))
def test_kept_rows_match_a_fresh_lookup_through_moves_frees_and_growth(engine, seed: int) -> None:
    rng, cache = random.Random(seed), engine.cache
    tokens: dict[int, int] = {}
    next_id = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.15 and len(tokens) < 6:
            tokens[next_id] = rng.randint(1, 4 * BT)
            cache.grow(next_id, tokens[next_id])
            next_id += 1
        elif op < 0.25 and tokens:
            s = rng.choice(sorted(tokens))
            cache.free(s)
            del tokens[s]
        elif op < 0.45 and tokens:  # a plan's, a preemption's or a policy's spill, between steps
            blocks = cache.blocks_of(rng.choice(sorted(tokens)))
            cache.spill(rng.sample(blocks, rng.randint(1, len(blocks))), rng.choice([Tier.CPU, Tier.NVME]))
        elif tokens:  # a step over some sequences: each may grow by a token, then all on the GPU, then the rows
            seqs = rng.sample(sorted(tokens), rng.randint(1, len(tokens)))
            if sum(cache.num_blocks_for(tokens[s] + 1) for s in seqs) > 40:
                continue
            for s in seqs:
                tokens[s] += 1
                cache.grow(s, tokens[s], protect={b for q in seqs for b in cache.blocks_of(q)})
            hits = cache.gpu_hits + sum(cache.misses_by_tier.values())
            cache.ensure_seqs_on_gpu(seqs)
            assert cache.gpu_hits + sum(cache.misses_by_tier.values()) == hits + sum(
                len(cache.blocks_of(s)) for s in seqs)  # every block counted once, a hit or a fetch
            assert [r.tolist() for r in cache.gpu_rows(seqs)] == _fresh(cache, seqs)


def test_a_step_with_nothing_moved_looks_up_only_its_new_blocks(engine, monkeypatch: pytest.MonkeyPatch) -> None:
    cache, looked = engine.cache, []
    real = cache.manager.locations

    def locations(block_ids: list[int]):
        looked.append(len(block_ids))
        return real(block_ids)

    seqs = [0, 1, 2]
    for s in seqs:
        cache.grow(s, 5 * BT)
    cache.ensure_seqs_on_gpu(seqs)
    cache.gpu_rows(seqs)
    monkeypatch.setattr(cache.manager, "locations", locations)
    cache.ensure_seqs_on_gpu(seqs)
    kept = [r.tolist() for r in cache.gpu_rows(seqs)]
    assert sum(looked) == 0
    assert kept == [[loc.index for loc in real(cache.blocks_of(s))] for s in seqs]
    cache.grow(1, 5 * BT + 1)  # one new block
    cache.ensure_seqs_on_gpu(seqs)
    cache.gpu_rows(seqs)
    assert sum(looked) == 1
    cache.spill(cache.blocks_of(2)[:1], Tier.CPU)  # a move: every row is looked up again, and the block fetched
    looked.clear()
    cache.ensure_seqs_on_gpu(seqs)
    monkeypatch.setattr(cache.manager, "locations", real)
    assert [r.tolist() for r in cache.gpu_rows(seqs)] == _fresh(cache, seqs)
    assert sum(looked) >= sum(len(cache.blocks_of(s)) for s in seqs)
