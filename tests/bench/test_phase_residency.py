"""The engine's expert residency replayed (bench/phase_residency.py): what the rows' predicted misses come from."""

from __future__ import annotations

import numpy as np
import pytest

from tierplan.bench.phase_residency import ResidencyReplay, replay_loads

NUM_EXPERTS = 12


def _engine_misses(needed_per_step: list[list[int]], slots: int) -> list[int]:
    """Each step's misses on the engine's own residency (CPU twin, one layer of NUM_EXPERTS over `slots` slots),
    driven as the MoE layer drives it: the needed experts in the provider's groups, each made resident in turn."""
    from tests.runtime.conftest import MIXED
    from tierplan.runtime.device import Device
    from tierplan.runtime.engine.experts import OnDemandExperts
    from tierplan.runtime.memory.host import HostBackend
    from tierplan.runtime.memory.slots import ExpertSlotPool
    from tierplan.runtime.transfer import TransferEngine
    from tierplan.runtime.weights.loader import ExpertLoadHandler
    from tierplan.runtime.weights.sources import SyntheticExpertSource
    from tierplan.runtime.weights.stores import PinnedExpertStore

    dev = Device("cpu")
    pinned = PinnedExpertStore(dev, SyntheticExpertSource(MIXED, 1, NUM_EXPERTS, seed=3))
    pool = ExpertSlotPool(HostBackend(), dev, 1, NUM_EXPERTS, MIXED.num_bytes, slots)
    eng = TransferEngine(dev)
    ex = OnDemandExperts(pool, ExpertLoadHandler(pool, eng, pinned=pinned, map_in="before_copy"))
    out = []
    try:
        for needed in needed_per_step:
            ex.begin_step()
            before = ex.misses
            for group in ex.chunks(0, needed):
                ex.ensure(0, group)
                ex.done_reading(0, group)
            out.append(ex.misses - before)
    finally:
        eng.close()
        pool.close()
        pinned.close()
    return out


@pytest.mark.parametrize("slots", [3, 5, 8])
def test_the_replay_misses_what_the_engines_residency_misses_step_by_step(slots: int) -> None:
    """Random steps of 1-4 tokens (top-2 of 12 experts; some need more experts than the slots, which the engine
    runs in groups): the replay's misses equal the engine's at every step. A stack-distance LRU curve, which lets a
    step evict an expert it still needs, would not: the replay is the engine's rule, and breaks with it."""
    rng = np.random.default_rng(slots)
    steps = [sorted({int(e) for _ in range(rng.integers(1, 5)) for e in rng.choice(NUM_EXPERTS, 2, replace=False)})
             for _ in range(80)]
    replay = ResidencyReplay.of_layers(1, NUM_EXPERTS)
    got = [replay.step_needed([slots], [np.array(s)]).misses[0] for s in steps]
    assert got == _engine_misses(steps, slots)
    assert any(len(s) > slots for s in steps) or slots == 8


def test_a_step_that_fits_its_slots_finds_in_steady_state_what_it_needed_before() -> None:
    """The same few experts step after step fit the slots: after the warm-up pass nothing misses; a layer whose
    slots hold every expert misses nothing, and a plan that cuts it later evicts the least recently used."""
    ids = np.tile(np.array([[[0, 1]], [[2, 3]]]), (2, 1, 1))  # [4, 1, 2]: rows alternate {0, 1} and {2, 3}
    loads = replay_loads(ids, 8, [(2, 0)] * 6, [(4,)] * 6)  # two decodes read rows t and t + 1: all four experts
    assert [ld.misses for ld in loads] == [(0,)] * 6 and not any(ld.over_slots for ld in loads)
    alternating = replay_loads(ids, 8, [(1, 0)] * 6, [(2,)] * 6)  # one decode: {0, 1} then {2, 3}, over 2 slots
    assert [ld.misses for ld in alternating] == [(2,)] * 6 and not any(ld.over_slots for ld in alternating)
    replay = ResidencyReplay(ids, 8)
    assert replay.step((8,), 2).misses == (0,)  # every expert has a slot
    cut = replay.step((1,), 1)  # one slot: a row's two experts run as two groups
    assert cut.over_slots and cut.misses == (2,)


def test_bad_input_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"expected a routing table \[T, L_moe, k\]"):
        ResidencyReplay(np.zeros((4, 2), np.int64), 8)
    with pytest.raises(ValueError, match=r"must lie in \[0, 8\), got \[0, 9\]"):
        ResidencyReplay(np.array([[[0, 9]]]), 8)
    with pytest.raises(ValueError, match="1 slot counts for 2 MoE layers"):
        ResidencyReplay(np.zeros((4, 2, 2), np.int64), 8).step((4,), 1)
    with pytest.raises(ValueError, match="2 steps, 1 splits"):
        replay_loads(np.zeros((4, 1, 2), np.int64), 8, [(1, 0), (1, 0)], [(4,)])
