"""ExpertSlotPool on the memfd twin: a randomized sequence of operations against a model (every refusal matches
the model and changes nothing; no read is ever stale), and loads published while their copy still runs."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from tests.conftest import start_thread
from tests.runtime.conftest import (
    ABSENT,
    ALL,
    EB,
    LOADING,
    RESIDENT,
    S,
    T,
    is_poison,
    refused,
    stride_view,
)
from tierplan.runtime.device import HostEvent
from tierplan.runtime.errors import BusyError, CapacityError, ConfigError, NotResidentError, PinnedError
from tierplan.runtime.memory.host import HostBackend
from tierplan.runtime.memory.slots import ExpertSlotPool


# ---- randomized sequence ------------------------------------------------------------------------------
@pytest.mark.parametrize(("seed", "scrub", "window"), [(0, False, False), (1, True, False), (2, False, False),
                                                       (3, False, True), (5, True, True)])
def test_random_sequence_keeps_invariants_and_never_reads_stale_bytes(env, seed, scrub, window):
    """1000 random ops against a model; each refusal must match the model and change nothing. With a slot
    window, some loads write through it before the expert's range is mapped: the range shows poison until
    `map_reserved`, then exactly the bytes written."""
    pool = env.pool(scrub_on_unmap=scrub, slot_window=window)
    r = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    state = dict.fromkeys(ALL, ABSENT)
    data: dict[tuple[int, int], torch.Tensor] = {}
    mapped: set[tuple[int, int]] = set()  # LOADING experts whose slot is mapped (map_now or map_reserved)
    pinned: set[tuple[int, int]] = set()
    readers: dict[tuple[int, int], list[HostEvent]] = {k: [] for k in ALL}
    seen: Counter[str] = Counter()

    windowed: set[tuple[int, int]] = set()  # LOADING experts whose bytes went in through the slot window

    def fill(k: tuple[int, int], dst: torch.Tensor | None = None) -> None:
        dst = stride_view(pool, *k)[:EB] if dst is None else dst  # [EB] what prepare_load returned
        if scrub:  # a fresh slot is zeros, a reused one was scrubbed: never another expert's bytes
            assert bool((dst == 0).all()) or is_poison(dst)
        data[k] = torch.randint(0, 256, (EB,), dtype=torch.uint8, generator=gen)
        dst.copy_(data[k])
        if dst.data_ptr() == stride_view(pool, *k).data_ptr():
            mapped.add(k)
        else:
            windowed.add(k)

    def expected(op: str, k: tuple[int, int], ok: bool) -> tuple[type[Exception] | None, str]:
        st, busy = state[k], any(not ev.query() for ev in readers[k])
        full = sum(x is not ABSENT for x in state.values()) == S
        rules = {  # (refusal, why) in the order the pool checks
            "prepare": [(st is not ABSENT, BusyError, "busy"), (full, CapacityError, "full")],
            "map": [(st is not LOADING or k in mapped, BusyError, "busy")],
            "complete": [(st is not LOADING or (ok and k not in mapped), BusyError, "busy")],
            "unmap": [(st is ABSENT, NotResidentError, "absent"), (st is LOADING, BusyError, "loading"),
                      (k in pinned, PinnedError, "pinned"), (busy, BusyError, "reader busy")],
            "read": [(st is not RESIDENT, NotResidentError, "absent")],
            "pin": [(st is not RESIDENT, NotResidentError, "absent")],
            "unpin": [(k not in pinned, ConfigError, "not pinned")],
            "wait": [(st is not RESIDENT, NotResidentError, "absent")],
        }[op]
        return next(((exc, why) for cond, exc, why in rules if cond), (None, op))

    def step(k: tuple[int, int], op: str) -> None:
        if op == "finish":
            for ev in readers[k]:
                if r.random() < 0.5:
                    ev.set()
            return
        ok, now, ev = r.random() < 0.8, r.random() < 0.6, HostEvent()
        via = window and not now and r.random() < 0.7
        exc, why = expected(op, k, ok)
        call = {
            "prepare": lambda: pool.prepare_load(*k, map_now=now, via_window=via),
            "map": lambda: pool.map_reserved(*k),
            "complete": lambda: pool.complete_load(*k, ok),
            "unmap": lambda: pool.unmap(*k, wait=exc is None and r.random() < 0.5),
            "read": lambda: pool.record_read(k[0], [k[1]], ev),
            "pin": lambda: pool.pin(*k),
            "unpin": lambda: pool.unpin(*k),
            "wait": lambda: pool.wait_ready(k[0], [k[1]]),
        }[op]
        seen[f"{op}: {why}" if exc else op] += 1
        if exc is not None:
            refused(pool, exc, call)
            return
        got = call()
        if op == "prepare":
            state[k] = LOADING
            if now:
                fill(k)
            elif via:
                assert is_poison(stride_view(pool, *k)) and got.data_ptr() != stride_view(pool, *k).data_ptr()
                fill(k, got)
                seen["through the window"] += 1
        elif op == "map":
            if k in windowed:  # the bytes are in the slot already: mapping the range shows them
                windowed.discard(k)
                mapped.add(k)
                assert torch.equal(stride_view(pool, *k)[:EB], data[k])
            else:
                fill(k)
            seen["mapped late"] += 1
        elif op == "complete":
            state[k] = RESIDENT if ok else ABSENT
            mapped.discard(k)
            windowed.discard(k)
            seen["published" if ok else "failed"] += 1
        elif op == "unmap":
            state[k], readers[k] = ABSENT, []
        elif op == "read":
            env.events.append(ev)
            readers[k].append(ev)
        elif op in ("pin", "unpin"):
            (pinned.add if op == "pin" else pinned.discard)(k)

    ops = ["prepare"] * 3 + ["complete"] * 3 + ["unmap"] * 3 + ["map", "read", "finish", "finish", "pin", "unpin",
                                                                "wait"]
    fits = {"complete": LOADING, "map": LOADING, "unmap": RESIDENT, "read": RESIDENT, "pin": RESIDENT,
            "wait": RESIDENT}
    for _ in range(1000):
        op = r.choice(ops)
        if op in fits:
            cands = [x for x in ALL if state[x] is fits[op]]
        elif op == "unpin":
            cands = sorted(pinned)
        else:
            cands = [x for x in ALL if any(not ev.query() for ev in readers[x])]
        step(r.choice(cands) if cands and r.random() < 0.75 else r.choice(ALL), op)  # mostly legal, some not
        pool.check_invariants()
        assert pool.num_free_slots == S - sum(st is not ABSENT for st in state.values())
        for x in ALL:
            assert pool.state(*x) is state[x]
            assert (pool.slot_of(*x) is None) == (state[x] is ABSENT)
            if state[x] is RESIDENT:
                assert torch.equal(pool.expert_tensor(*x), data[x]), f"stale or torn bytes for {x}"
            elif state[x] is ABSENT or x not in mapped:  # absent, or reserved but not mapped yet
                assert is_poison(stride_view(pool, *x)), f"non-resident {x} shows non-poison bytes"
    wanted = ["prepare: full", "prepare", "mapped late", "published", "failed", "unmap: pinned",
              "unmap: reader busy", "unmap"]
    wanted += ["through the window"] if window else []
    assert min(seen[w] for w in wanted) >= 5, seen  # the walk reached every interesting branch


def test_wait_published_orders_readers_after_loads_published_while_copying(env, pool) -> None:
    """I3 for readers that name no experts (an all-resident layer, a graph replay): a load published with a copy
    still running (publish="issued") is waited for; once its event is done it is no longer waited on."""
    pool.prepare_load(0, 1)
    copying = env.event()
    pool.complete_load(0, 1, True, event=copying)
    assert pool.is_resident(0, 1)
    t, errors = start_thread(pool.wait_published)
    t.join(0.2)
    assert t.is_alive()  # the reader's stream (the host, on the CPU twin) waits for the copy
    copying.set()
    t.join(T)
    assert not t.is_alive() and not errors
    pool.wait_published()  # nothing pending any more: returns at once
    assert pool.reads.unsettled == []


def test_all_resident_layers_wait_for_loads_published_while_copying(env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The MoE fast path for a layer whose experts all hold slots names no expert: it must still wait."""
    from tierplan.runtime.engine.experts import OnDemandExperts

    pool = ExpertSlotPool(HostBackend(), env.device, 1, 2, EB, 2, poison_unmapped=True)
    env.pools.append(pool)
    waited: list[bool] = []
    monkeypatch.setattr(pool, "wait_published", lambda stream=None: waited.append(True))
    experts = OnDemandExperts(pool, None, None)  # type: ignore[arg-type]
    assert not experts.all_resident(0) and waited == []
    for e in range(2):
        pool.prepare_load(0, e)
        pool.complete_load(0, e, True)
    assert experts.all_resident(0) and waited == [True]


def test_only_loads_still_copying_are_kept_for_wait_published(env, pool) -> None:
    """Regression (review): every published load's event was kept until a wait_published call, which a pool that
    never has a whole layer resident never makes: one entry per load, for good. Done copies are not kept, and
    those that finish are dropped at the next publish."""
    for e in range(2):
        pool.prepare_load(0, e)
        pool.complete_load(0, e, True, event=HostEvent(done=True))  # published once its copy was done
    assert pool.reads.unsettled == []
    copying = env.event()
    pool.prepare_load(0, 2)
    pool.complete_load(0, 2, True, event=copying)
    assert pool.reads.unsettled == [copying]
    copying.set()
    pool.prepare_load(0, 3)
    pool.complete_load(0, 3, True, event=HostEvent(done=True))
    assert pool.reads.unsettled == []
