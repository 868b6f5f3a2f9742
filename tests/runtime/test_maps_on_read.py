"""Loads that map no range (`expert_map_in="on_read"`, CPU twin): a load is published with its range unmapped and
the link's worker makes no map call; slot-table readers read it through the window; a reader through the ranges
maps what it reads first (`map_for_read`: eager layers, whole-step graphs, `expert_tensor`), and an unmapped
expert's eviction leaves no stale range behind. Poisoned pools show NaN through a range nobody mapped, so a
reader that skipped its map fails on the bits, not by luck."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.runtime.conftest import EB, MIXED, E, L, S
from tierplan.runtime.checksum import checksum
from tierplan.runtime.device import Device, HostEvent
from tierplan.runtime.engine.engine import EngineConfig, ReferenceEngine
from tierplan.runtime.engine.executor import Executor
from tierplan.runtime.engine.presets import preset
from tierplan.runtime.errors import ConfigError
from tierplan.runtime.memory.host import HostBackend
from tierplan.runtime.memory.slots import ExpertSlotPool, ExpertState
from tierplan.runtime.selfcheck.exact import auto_block_tokens, run_exact_check
from tierplan.runtime.transfer import TransferEngine
from tierplan.runtime.weights.loader import ExpertLoadHandler
from tierplan.runtime.weights.sources import SyntheticExpertSource
from tierplan.runtime.weights.stores import PinnedExpertStore


@pytest.fixture()
def pool():
    p = ExpertSlotPool(HostBackend(), Device("cpu"), L, E, EB, S, slot_window=True, maps_on_read=True)
    yield p
    p.close()


def test_a_load_is_published_unmapped_and_mapped_only_for_a_range_reader(pool: ExpertSlotPool) -> None:
    pool.prepare_loads(1, [3], via_window=True)
    pool.note_issued(1, 3, HostEvent(done=True), None)
    pool.complete_load(1, 3, True, HostEvent(done=True))
    assert pool.state(1, 3) is ExpertState.RESIDENT and not pool.mapped(1, [3])[0]
    assert pool.map_for_read(0, [0, 1]) == 0, "absent experts are not mapped"
    assert pool.map_for_read(1, [3]) == 1 and pool.mapped(1, [3])[0]
    assert pool.map_for_read(1, [3]) == 0 and pool.read_maps == 1, "a mapped range is not mapped again"
    pool.check_invariants()


def test_a_bad_expert_id_maps_nothing_and_changes_nothing(pool: ExpertSlotPool) -> None:
    pool.prepare_loads(0, [0], via_window=True)
    pool.complete_load(0, 0, True, HostEvent(done=True))
    with pytest.raises(ConfigError, match=r"expert \(0, 99\) out of range"):
        pool.map_for_read(0, [0, 99])
    assert pool.mapped(0, [0]) == [False] and pool.read_maps == 0
    pool.check_invariants()  # the expert is still listed for its map
    assert pool.map_for_read(0, [0]) == 1


def test_an_unmapped_expert_is_evicted_without_a_stale_range(pool: ExpertSlotPool) -> None:
    pool.prepare_loads(0, [2], via_window=True)
    pool.complete_load(0, 2, True, HostEvent(done=True))
    pool.check_invariants()  # listed for map_for_read while resident and unmapped
    pool.release(0, 2)
    assert pool.state(0, 2) is ExpertState.ABSENT and pool.num_stale == 0
    pool.check_invariants()  # and no longer once released


def test_the_loader_maps_nothing_and_expert_tensor_maps_on_demand() -> None:
    dev = Device("cpu")
    pinned = PinnedExpertStore(dev, SyntheticExpertSource(MIXED, 2, 6, seed=2))
    pool = ExpertSlotPool(HostBackend(), dev, 2, 6, MIXED.num_bytes, 3, slot_window=True, maps_on_read=True)
    engine = TransferEngine(dev)
    try:
        loader = ExpertLoadHandler(pool, engine, pinned=pinned, map_in="on_read")
        for f in loader.load_many(1, [0, 4]):
            f.wait(10)
        assert pool.mapped(1, [0, 4]) == [False, False], "an on_read load maps no range"
        assert engine.stats()["links"]["h2d"]["idle_jobs"] == 0, "no map job ran on the link's worker"
        assert checksum(pool.expert_tensor(1, 4)) == pinned.checksum(1, 4)
        assert pool.mapped(1, [0, 4]) == [False, True] and pool.read_maps == 1
        loader.close()
    finally:
        engine.close()
        pool.close()


def test_on_read_needs_the_table_readers_and_a_matching_pool() -> None:
    with pytest.raises(ConfigError, match=r"expert_map_in='on_read' leaves loaded experts' ranges unmapped"):
        EngineConfig(expert_map_in="on_read", expert_reads="range")
    with pytest.raises(ConfigError, match=r"experts_on_device=True generates every expert in its slot"):
        EngineConfig(expert_map_in="on_read", experts_on_device=True)
    for mode, map_in in (("range", "on_read"), ("on_read", "before_copy")):
        with pytest.raises(ConfigError, match=rf"mode '{mode}' cannot run with expert_map_in='{map_in}'"):
            run_exact_check(preset("tiny"), 0.5, mode=mode, expert_map_in=map_in)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"maps_on_read=True\) needs slot_window=True"):
        ExpertSlotPool(HostBackend(), Device("cpu"), L, E, EB, S, maps_on_read=True)
    plain = ExpertSlotPool(HostBackend(), Device("cpu"), L, E, EB, S, slot_window=True)
    engine = TransferEngine(Device("cpu"))
    try:
        with pytest.raises(ConfigError, match=r"map_in='on_read' goes with maps_on_read=True"):
            ExpertLoadHandler(plain, engine, pinned=object(), map_in="on_read")  # type: ignore[arg-type]
    finally:
        engine.close()
        plain.close()


@pytest.mark.parametrize("graphs", [False, True])
def test_range_readers_map_what_they_read_and_keep_the_bits(tmp_path: Path, graphs: bool) -> None:
    """Every expert loaded as a slot-table reader loads it (unmapped with on_read), then a one-token prompt:
    its prefill runs eagerly through the ranges of the experts it routes to, and the decode steps replay the
    whole-step graph over every range (graphs on; CPU: the same static step, uncaptured) or run eagerly (off),
    all over poisoned ranges; every bit equals the engine that maps beside the copies."""
    spec = preset("tiny")
    out = {}
    for map_in in ("beside_copy", "on_read"):
        cfg = EngineConfig(block_tokens=auto_block_tokens(spec), workdir=tmp_path / map_in, decode_kernel=True,
                           decode_graphs=graphs, expert_poison=True, expert_map_in=map_in)  # type: ignore[arg-type]
        eng = ReferenceEngine(spec, Device("cpu"), cfg)
        try:
            for layer in range(eng.pool.layout.num_layers):
                eng.experts.ensure(layer, list(range(spec.num_experts)), table=True)
            out[map_in] = eng.generate([[7]], 4)
            steps = eng.executors.steps
            assert steps[Executor.GRAPH if graphs else Executor.EAGER] >= 3, steps
            if map_in == "on_read":
                assert eng.pool.read_maps > 0
        finally:
            eng.close()
    assert torch.equal(out["beside_copy"].logits, out["on_read"].logits)
    assert not torch.isnan(out["on_read"].logits).any()
    assert out["beside_copy"].tokens == out["on_read"].tokens


def test_eager_offloaded_steps_map_what_they_read(tmp_path: Path) -> None:
    """F=0.5, decode steps eager over the padded rows (mode "eager" with on_read loads), poisoned ranges: each
    layer's misses are mapped by `ensure` before the layer reads them, or the logits show NaN."""
    r = run_exact_check(preset("tiny"), 0.5, workdir=tmp_path, num_prompts=2, new_tokens=4, decode_kernel=True,
                        decode_graphs=True, mode="eager", expert_map_in="on_read", expert_poison=True)
    assert r.map_in == "on_read" and r.line() == "exact: max_abs_diff=0.0 tokens_equal=True ok"
    assert r.mode_steps == 3 and r.expert_misses_tight > r.expert_misses_full
