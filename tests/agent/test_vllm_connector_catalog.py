"""KvCatalog, the KV connector's books: placement within the limits, spill CPU -> NVMe, and the eviction order
(retention first, then least recent use). No vLLM needed: runs in the main `make test`."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierplan.agent.adapters.vllm.connector_catalog import KvCatalog, OpKind, TierOp
from tierplan.runtime.kv.spec import Tier

CPU, NVME = Tier.CPU, Tier.NVME


def admit_all(cat: KvCatalog, keys: list[str]) -> list[TierOp]:
    ops: list[TierOp] = []
    for k in keys:
        ops += cat.admit(k)
    return ops


def replay_footprint(ops: list[TierOp], limits: dict[Tier, int], start: dict[str, Tier] | None = None) -> None:
    """Carry the ops out on a plain dict and check the footprint after every one (what the worker does)."""
    where = dict(start or {})
    for op in ops:
        if op.kind is OpKind.STORE:
            assert op.key not in where
            where[op.key] = op.tier
        elif op.kind is OpKind.MOVE:
            assert where[op.key] is CPU and op.tier is NVME
            where[op.key] = op.tier
        else:
            assert where.pop(op.key) is op.tier
        for tier, limit in limits.items():
            assert sum(1 for t in where.values() if t is tier) <= limit, (op, where)


def test_blocks_fill_cpu_then_spill_the_least_recent_to_nvme_then_drop() -> None:
    cat = KvCatalog({CPU: 2, NVME: 2})
    ops = admit_all(cat, ["a", "b", "c"])
    assert ops == [TierOp(OpKind.STORE, "a", CPU), TierOp(OpKind.STORE, "b", CPU),
                   TierOp(OpKind.MOVE, "a", NVME), TierOp(OpKind.STORE, "c", CPU)]
    more = admit_all(cat, ["d", "e"])
    # b goes down, then the NVMe tier is full: a (least recent there) is dropped before c moves down.
    assert more == [TierOp(OpKind.MOVE, "b", NVME), TierOp(OpKind.STORE, "d", CPU),
                    TierOp(OpKind.DROP, "a", NVME), TierOp(OpKind.MOVE, "c", NVME), TierOp(OpKind.STORE, "e", CPU)]
    replay_footprint(ops + more, {CPU: 2, NVME: 2})
    assert cat.footprint() == {CPU: 2, NVME: 2}
    assert cat.lookup(["a", "b"]) == []  # a was dropped: the run stops at once
    assert cat.lookup(["b", "c", "d", "zz"]) == [NVME, NVME, CPU]


def test_a_hit_makes_a_block_recent_so_it_stays_on_cpu() -> None:
    cat = KvCatalog({CPU: 2, NVME: 4})
    admit_all(cat, ["a", "b"])
    cat.touch(["a"])
    assert cat.admit("c")[0] == TierOp(OpKind.MOVE, "b", NVME)
    assert cat.tier_of("a") is CPU


def test_retained_blocks_are_kept_before_recent_ones_in_keep_first_order() -> None:
    cat = KvCatalog({CPU: 2, NVME: 1})
    cat.set_limits(2, 1, retention=("r1", "r2"))
    admit_all(cat, ["r2", "r1"])
    # A newcomer not retained ranks below both retained blocks: it goes to NVMe, the retained stay on CPU.
    assert cat.admit("x") == [TierOp(OpKind.STORE, "x", NVME)]
    # The next newcomer is not kept at all: x (older) is dropped first, since x and y both rank below r1, r2.
    assert cat.admit("y") == [TierOp(OpKind.DROP, "x", NVME), TierOp(OpKind.STORE, "y", NVME)]
    assert cat.keys_on(CPU) == ["r2", "r1"]
    # A retained newcomer makes way for itself: the lowest-ranked retained block (r2) goes down, y is dropped.
    cat.set_limits(2, 1, retention=("r0", "r1", "r2"))
    ops = cat.admit("r0")
    assert ops == [TierOp(OpKind.DROP, "y", NVME), TierOp(OpKind.MOVE, "r2", NVME), TierOp(OpKind.STORE, "r0", CPU)]
    assert cat.victim_order(CPU) == ["r1", "r0"]


def test_a_block_ranked_below_everything_on_full_tiers_is_not_kept() -> None:
    cat = KvCatalog({CPU: 1, NVME: 1})
    cat.set_limits(1, 1, retention=("r1", "r2"))
    admit_all(cat, ["r1", "r2"])
    assert cat.admit("x") == []
    assert cat.stats.not_kept == 1
    assert cat.footprint() == {CPU: 1, NVME: 1}


def test_a_smaller_plan_spills_and_drops_until_the_footprint_fits() -> None:
    cat = KvCatalog({CPU: 4, NVME: 4})
    admit_all(cat, ["a", "b", "c", "d"])
    start = {k: CPU for k in "abcd"}
    ops = cat.set_limits(1, 2)
    replay_footprint(ops, {CPU: 4, NVME: 2}, start)  # moves never pass the new NVMe limit
    assert cat.footprint() == {CPU: 1, NVME: 2}
    assert cat.keys_on(CPU) == ["d"]
    assert sorted(cat.keys_on(NVME)) == ["b", "c"]
    assert cat.set_limits(0, 0) and cat.footprint() == {CPU: 0, NVME: 0}


def test_with_no_cpu_blocks_stores_go_straight_to_nvme_and_with_none_nothing_is_kept() -> None:
    cat = KvCatalog({CPU: 4, NVME: 4})
    cat.set_limits(0, 2)
    assert admit_all(cat, ["a"]) == [TierOp(OpKind.STORE, "a", NVME)]
    cat.set_limits(0, 0)
    assert cat.admit("b") == [] and cat.stats.not_kept == 1


def test_plan_limits_past_the_capacity_are_held_at_it_and_counted() -> None:
    cat = KvCatalog({CPU: 2, NVME: 0})
    cat.set_limits(10, 3)
    assert cat.limits == {CPU: 2, NVME: 0}
    assert cat.stats.limits_clamped == 2


def test_admitting_a_held_block_only_touches_it_and_forget_removes_it() -> None:
    cat = KvCatalog({CPU: 2, NVME: 0})
    cat.admit("a")
    assert cat.admit("a") == []
    cat.forget("a")
    assert "a" not in cat and cat.footprint()[CPU] == 0 and cat.stats.forgotten == 1


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_bad_limits_are_refused_by_name(bad: object) -> None:
    cat = KvCatalog({CPU: 2, NVME: 2})
    with pytest.raises(ValueError, match="cpu_blocks must be an int >= 0"):
        cat.set_limits(bad, 1)  # type: ignore[arg-type]
    assert cat.limits == {CPU: 2, NVME: 2}


class NaiveCatalog(KvCatalog):
    """The same policy with the victim found by sorting every block of the tier (the definition, O(n log n))."""

    def _victim(self, tier: Tier) -> str:
        return self.victim_order(tier)[0]


KEYS = st.integers(0, 9)  # few keys: they come back, get touched, retained, evicted and stored again
step_strategy = st.one_of(
    st.tuples(st.just("admit"), KEYS), st.tuples(st.just("admit"), KEYS), st.tuples(st.just("admit"), KEYS),
    st.tuples(st.just("touch"), KEYS),
    st.tuples(st.just("forget"), KEYS),
    st.tuples(st.just("limits"), st.integers(0, 3), st.integers(0, 3), st.lists(KEYS, max_size=6, unique=True)),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(step_strategy, max_size=80))
def test_the_fast_victim_search_decides_exactly_as_the_definition(steps: list[tuple]) -> None:
    fast, naive = KvCatalog({CPU: 5, NVME: 5}), NaiveCatalog({CPU: 5, NVME: 5})
    where: dict[str, Tier] = {}
    for step in steps:
        got = []
        for cat in (fast, naive):
            if step[0] == "admit":
                got.append(cat.admit(f"k{step[1]}"))
            elif step[0] == "touch":
                cat.touch([f"k{step[1]}"])
                got.append([])
            elif step[0] == "forget":
                cat.forget(f"k{step[1]}")
                got.append([])
            else:
                got.append(cat.set_limits(step[1], step[2], tuple(f"k{i}" for i in step[3])))
        assert got[0] == got[1], step
        if step[0] == "forget":
            where.pop(f"k{step[1]}", None)
        replay_footprint(got[0], fast.limits if step[0] != "limits" else {CPU: 5, NVME: 5}, where)
        where = {k: fast.tier_of(k) for k in [*fast.keys_on(CPU), *fast.keys_on(NVME)]}
        assert fast.footprint() == naive.footprint()
        assert all(n <= fast.limits[t] for t, n in fast.footprint().items())
