"""Slot-table reads (CPU twin): a piecewise step's GEMMs find experts through the pool's slot table in the slot
window, so a miss is readable once its copy is issued, before its range is mapped; the table names each
expert's slot; a failed load keeps its table readers as the slot's guards; and decoding through the table
keeps every bit of the all-resident run, loads from pinned memory included (the path the bench measures)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime.conftest import EB, E, L, S
from tierplan.runtime.device import Device, HostEvent
from tierplan.runtime.engine.kernels import moe_gemm
from tierplan.runtime.engine.presets import preset
from tierplan.runtime.errors import NotResidentError
from tierplan.runtime.memory.host import HostBackend
from tierplan.runtime.memory.slots import ExpertSlotPool, ExpertState
from tierplan.runtime.selfcheck.exact import run_exact_check
from tierplan.runtime.weights.loader import StoreKind


@pytest.fixture()
def pool():
    p = ExpertSlotPool(HostBackend(), Device("cpu"), L, E, EB, S, slot_window=True)
    yield p
    p.close()


def test_an_issued_load_is_readable_through_the_table_before_it_is_mapped(pool: ExpertSlotPool) -> None:
    pool.prepare_loads(1, [3], via_window=True)
    assert pool.state(1, 3) is ExpertState.LOADING and not pool.mapped(1, [3])[0]
    with pytest.raises(NotResidentError):
        pool.wait_ready(1, [3], issued_ok=True)  # its copy is not issued yet
    copy = HostEvent()
    pool.note_issued(1, 3, copy, None)
    with pytest.raises(NotResidentError):
        pool.wait_ready(1, [3])  # a range reader still waits for the publication
    copy.set()
    pool.wait_ready(1, [3], issued_ok=True)
    pool.sync_table(1, [3])
    assert pool.reads.table is not None and int(pool.reads.table[1, 3]) == pool.slot_of(1, 3)
    writes = pool.reads.table_writes
    pool.sync_table(1, [3])
    assert pool.reads.table_writes == writes, "an entry that already names the slot is not written again"
    pool.record_read(1, [3], HostEvent(done=True))
    pool.map_reserved(1, 3)
    pool.complete_load(1, 3, True, copy)
    pool.wait_ready(1, [3])
    pool.check_invariants()


def test_a_failed_load_keeps_its_table_readers_as_the_slots_guards(pool: ExpertSlotPool) -> None:
    pool.prepare_loads(0, [2], via_window=True)
    slot = pool.slot_of(0, 2)
    pool.note_issued(0, 2, HostEvent(done=True), None)
    reader = HostEvent()  # a piece still reading the slot through the table
    pool.record_read(0, [2], reader)
    pool.complete_load(0, 2, ok=False)  # its map failed, say
    assert pool.state(0, 2) is ExpertState.ABSENT
    pool.prepare_loads(0, [5], via_window=True)
    assert pool.slot_of(0, 5) == slot  # the slot freed last is taken first
    assert reader in pool.load_guards(0, [5])[0], "the next copy into the slot must wait for the table reader"
    reader.set()
    pool.complete_load(0, 5, ok=False)
    pool.check_invariants()


@pytest.mark.parametrize("mode", ["piecewise", "range", "on_read"])
def test_decoding_through_the_table_from_pinned_memory_keeps_the_bits(tmp_path: Path, mode: str,
                                                                      monkeypatch) -> None:
    monkeypatch.setattr(moe_gemm, "FORCE", True)  # the Triton GEMM (interpreted), as on a GPU
    r = run_exact_check(preset("tiny"), 0.5, workdir=tmp_path, num_prompts=2, new_tokens=4, decode_kernel=True,
                        decode_graphs=True, mode=mode, expert_store=StoreKind.PINNED)
    assert r.line() == "exact: max_abs_diff=0.0 tokens_equal=True ok"
    assert r.mode_steps == 3 and r.expert_misses_tight > r.expert_misses_full
