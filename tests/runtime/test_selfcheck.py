"""The substrate self-checks pass on healthy code and fail on broken code (CPU twin)."""

from __future__ import annotations

from pathlib import Path

import pytest

import tierplan.runtime.selfcheck.slots as slots_check
import tierplan.runtime.selfcheck.tiers as tiers_check
from tierplan.runtime.kv import KVBlockManager


def test_slot_check_is_clean_and_counts_what_it_did(tmp_path: Path) -> None:
    r = slots_check.run_slot_check(300, seed=4, workdir=tmp_path)
    assert r.line() == "slots: remaps=300 stale_reads=0"
    assert r.evictions > 0 and r.poison_reads == r.evictions and r.reads_checked > 300


def test_slot_check_catches_a_load_that_never_copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = slots_check.ExpertLoadHandler

    class SkipsCopy(real):  # publishes the slot without moving a byte: scrubbed poison must show
        def load(self, layer, expert, store=None, **kw):
            self.pool.prepare_load(layer, expert)
            self.pool.complete_load(layer, expert, ok=True)
            from tierplan.runtime.future import OpFuture

            f = OpFuture("fake")
            f.set_result(None)
            return f

    monkeypatch.setattr(slots_check, "ExpertLoadHandler", SkipsCopy)
    r = slots_check.run_slot_check(50, seed=1, workdir=tmp_path)
    assert r.stale_reads > 0


def test_tier_check_is_clean_and_detects_every_injection(tmp_path: Path) -> None:
    r = tiers_check.run_tier_check(1500, seed=5, workdir=tmp_path, inject_every=100)
    assert r.moves == 1500 and r.kv_moves > 0 and r.expert_loads > 0
    assert r.injected == 15 and r.corrupt_detected == r.injected
    assert r.mismatches == 0 and r.misplaced == 0 and r.unexpected_errors == 0 and r.ok
    assert r.verified >= r.moves - r.injected  # every move and load read back, but the ones that caught a flip
    assert r.line() == f"tiers: moves=1500 verified={r.verified} mismatches=0 misplaced=0 corrupt_detected={r.injected}"


def test_tier_check_reports_corruption_that_slips_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # KV checksums switched off: flipped NVMe bytes reach the final sweep as mismatches, and the run fails.
    monkeypatch.setattr(tiers_check, "KVBlockManager", lambda cap: KVBlockManager(cap, verify_tiers=frozenset()))
    r = tiers_check.run_tier_check(1200, seed=6, workdir=tmp_path, inject_every=50)
    assert r.mismatches > 0 and r.corrupt_detected < r.injected and not r.ok


def test_tier_check_shards_over_processes(tmp_path: Path) -> None:
    r = tiers_check.run_tier_check_jobs(600, seed=2, workdir=tmp_path, inject_every=100, jobs=2)
    assert r.moves == 600 and r.ok and r.injected == 6


def _noop_move(books: bool):
    """A KV move that reports success without copying a byte (and, books=True, with the books switched)."""
    from tierplan.runtime.kv.handler import KVMoveFuture

    def move(self, block_id, dst, priority=None, deadline_s=None):
        mv = self.manager.prepare_move(block_id, dst)
        if books:
            self.manager.complete_move(mv, ok=True)
        else:
            self.manager.complete_move(mv, ok=False)
        fut = KVMoveFuture(mv)
        fut.set_result(None)
        return fut

    return move


@pytest.mark.parametrize("books", [True, False], ids=["books-switched", "books-unchanged"])
def test_tier_check_fails_on_a_move_that_reports_success_without_moving(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, books: bool) -> None:
    monkeypatch.setattr(tiers_check.KVTransferHandler, "move", _noop_move(books))
    r = tiers_check.run_tier_check(300, seed=7, workdir=tmp_path, inject_every=0)
    assert not r.ok
    assert (r.mismatches if books else r.misplaced) > 0
