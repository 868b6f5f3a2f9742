"""ExpertSlotPool on the memfd twin: one test (at least) per invariant I1..I6 of runtime/memory/slots.py (the
randomized sequence and the publish-while-copying tests are in test_slots_sequences.py).

Unsignalled `HostEvent`s stand in for kernels still reading a slot or copies still loading one. Every refused
call is checked to leave the pool exactly as it was (errors.py: refusals come before any state change).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import start_thread, wait_until
from tests.runtime.conftest import (
    ABSENT,
    ALL,
    EB,
    EVICTING,
    LOADING,
    STRIDE,
    E,
    L,
    S,
    T,
    is_poison,
    load,
    refused,
    stride_view,
)
from tierplan.runtime.errors import BusyError, CapacityError, ConfigError, NotResidentError, PinnedError
from tierplan.runtime.memory.backend import LiveCounts
from tierplan.runtime.memory.host import HostBackend
from tierplan.runtime.memory.slots import ExpertSlotPool
from tierplan.runtime.transfer import Link, TrafficClass, TransferEngine, TransferRequest


# ---- I1 ------------------------------------------------------------------------------------------------
def test_I1_layer_address_is_stable_across_loads_and_evictions(pool, rand):
    ptrs = [pool.layer_tensor(layer).data_ptr() for layer in range(L)]
    assert all(pool.layer_tensor(layer).numel() == E * STRIDE for layer in range(L))
    r = random.Random(1)
    for _ in range(40):
        layer, e = r.choice(ALL)
        load(pool, layer, e, rand(EB))
        assert pool.expert_tensor(layer, e).data_ptr() == ptrs[layer] + e * STRIDE
        pool.unmap(layer, e)
    assert [pool.layer_tensor(layer).data_ptr() for layer in range(L)] == ptrs
    assert pool.remaps == 40


# ---- I2 ------------------------------------------------------------------------------------------------
def test_I2_one_range_one_slot_and_one_slot_one_expert(pool, rand):
    keys = [(0, 1), (1, 1), (0, 5), (1, 0)]
    data = {k: rand(EB) for k in keys}
    for k in keys:
        load(pool, *k, data[k])
    assert sorted(pool.slot_of(*k) for k in keys) == list(range(S))
    pool.check_invariants()
    for k in keys:
        refused(pool, BusyError, lambda k=k: pool.prepare_load(*k))  # a second slot under a mapped range
    new = rand(EB)
    pool.expert_tensor(0, 5).copy_(new)  # writing one expert touches no other range
    data[(0, 5)] = new
    for k in ALL:
        if k in data:
            assert torch.equal(pool.expert_tensor(*k), data[k])
        else:
            assert is_poison(stride_view(pool, *k))


# ---- I3 ------------------------------------------------------------------------------------------------
def test_I3_absent_and_loading_experts_cannot_be_read(pool, env, rand):
    refused(pool, NotResidentError, lambda: pool.expert_tensor(0, 2))
    dst = pool.prepare_load(0, 2)
    assert pool.state(0, 2) is LOADING
    for call in (lambda: pool.expert_tensor(0, 2), lambda: pool.wait_ready(0, [2]),
                 lambda: pool.record_read(0, [2], env.event()), lambda: pool.pin(0, 2)):
        refused(pool, NotResidentError, call)
    data = rand(EB)
    dst.copy_(data)
    pool.complete_load(0, 2, True)
    assert pool.is_resident(0, 2) and pool.resident_experts(0) == [2]
    assert torch.equal(pool.expert_tensor(0, 2), data)


def test_I3_wait_ready_orders_the_reader_after_the_load_event(pool, env, rand):
    loaded = env.event()
    load(pool, 1, 3, rand(EB), event=loaded)
    order: list[str] = []
    t, errs = start_thread(lambda: (pool.wait_ready(1, [3]), order.append("ready")))
    t.join(0.05)
    assert t.is_alive() and order == [], "wait_ready returned before the load's event"
    order.append("load done")
    loaded.set()
    t.join(T)
    assert not t.is_alive() and not errs
    assert order == ["load done", "ready"]


# ---- I4 ------------------------------------------------------------------------------------------------
def test_I4_unmap_without_wait_refuses_while_a_reader_is_in_flight(pool, env, rand):
    data = rand(EB)
    load(pool, 0, 4, data)
    r1, r2 = env.event(), env.event()
    pool.record_read(0, [4], r1)
    pool.record_read(0, [4], r2)
    refused(pool, BusyError, lambda: pool.unmap(0, 4, wait=False))
    r1.set()
    refused(pool, BusyError, lambda: pool.unmap(0, 4, wait=False))
    assert torch.equal(pool.expert_tensor(0, 4), data), "the slot still holds the reader's bytes"
    r2.set()
    pool.unmap(0, 4, wait=False)
    assert pool.state(0, 4) is ABSENT and pool.num_free_slots == S


def test_I4_a_pool_wide_read_fence_holds_every_unmap(pool, env, rand):
    """A step that read experts without per-expert bookkeeping (all resident, or a CUDA-graph replay)."""
    load(pool, 0, 4, rand(EB))
    load(pool, 1, 2, rand(EB))
    step = env.event()
    pool.record_read_all(step)
    refused(pool, BusyError, lambda: pool.unmap(0, 4, wait=False))
    refused(pool, BusyError, lambda: pool.unmap(1, 2, wait=False))
    step.set()
    pool.unmap(0, 4, wait=False)
    pool.unmap(1, 2, wait=False)


def test_I4_unmap_with_wait_blocks_until_the_reader_event_is_set(pool, env, rand):
    data = rand(EB)
    load(pool, 1, 2, data)
    load(pool, 1, 4, rand(EB))
    reader = env.event()
    pool.record_read(1, [2, 4], reader)
    order: list[str] = []
    t, errs = start_thread(lambda: (pool.unmap(1, 2, wait=True), order.append("unmapped")))
    wait_until(lambda: pool.state(1, 2) is EVICTING, T, "unmap to start waiting")
    assert t.is_alive()
    assert pool.slot_of(1, 2) is not None and pool.num_free_slots == S - 2, "slot freed before the reader"
    assert torch.equal(stride_view(pool, 1, 2)[:EB], data), "bytes changed under an in-flight reader"
    refused(pool, BusyError, lambda: pool.unmap(1, 2, wait=False))
    refused(pool, BusyError, lambda: pool.prepare_load(1, 2))
    refused(pool, NotResidentError, lambda: pool.expert_tensor(1, 2))
    load(pool, 0, 0, rand(EB))  # other experts stay usable while it waits
    order.append("reader done")
    reader.set()
    t.join(T)
    assert not t.is_alive() and not errs, errs
    assert order == ["reader done", "unmapped"]
    assert pool.state(1, 2) is ABSENT and is_poison(stride_view(pool, 1, 2))
    assert pool.num_free_slots == S - 2
    pool.check_invariants()


def test_I4_unmap_refuses_while_the_load_copy_is_in_flight(pool, env, rand):
    loading = env.event()
    load(pool, 0, 1, rand(EB), event=loading)
    refused(pool, BusyError, lambda: pool.unmap(0, 1, wait=False))


def test_record_read_refusal_leaves_no_phantom_reader(pool, env, rand):
    load(pool, 0, 0, rand(EB))
    ev = env.event()
    refused(pool, NotResidentError, lambda: pool.record_read(0, [0, 3], ev))  # 3 is absent
    pool.unmap(0, 0, wait=False)  # nothing was recorded, so nothing is in flight


# ---- I5 ------------------------------------------------------------------------------------------------
def test_I5_non_resident_ranges_read_poison(pool, rand):
    assert all(is_poison(stride_view(pool, *k)) for k in ALL)
    load(pool, 0, 0, rand(EB))
    pool.unmap(0, 0)
    assert is_poison(stride_view(pool, 0, 0))
    pool.prepare_load(1, 5).copy_(rand(EB))
    pool.complete_load(1, 5, False)  # a failed load gives its slot back and shows poison again
    assert is_poison(stride_view(pool, 1, 5)) and pool.num_free_slots == S
    assert all(is_poison(stride_view(pool, *k)) for k in ALL)


@pytest.mark.parametrize("scrub", [False, True])
def test_I5_scrub_on_unmap_poisons_a_slot_before_reuse(env, rand, scrub):
    pool = env.pool(scrub_on_unmap=scrub)
    old = rand(EB)
    load(pool, 0, 0, old)
    slot = pool.slot_of(0, 0)
    pool.unmap(0, 0)
    dst = pool.prepare_load(1, 3)
    assert pool.slot_of(1, 3) == slot, "the freed slot is the one reused"
    if scrub:
        assert is_poison(stride_view(pool, 1, 3))
    else:  # why scrub exists: without it the reused slot still holds the previous expert's bytes
        assert torch.equal(dst, old)


def test_I5_poison_off_means_a_non_resident_read_faults():
    code = textwrap.dedent(f"""
        from tierplan.runtime.device import Device
        from tierplan.runtime.memory.host import HostBackend
        from tierplan.runtime.memory.slots import ExpertSlotPool
        pool = ExpertSlotPool(HostBackend(), Device("cpu"), 1, 3, {EB}, 1, poison_unmapped=False)
        pool.prepare_load(0, 0).fill_(7)
        pool.complete_load(0, 0, True)
        assert int(pool.expert_tensor(0, 0).sum()) == 7 * {EB}
        pool.unmap(0, 0)
        pool.prepare_load(0, 1).fill_(9)
        pool.complete_load(0, 1, True)
        print("ready", flush=True)
        print(int(pool.layer_tensor(0)[{2 * STRIDE + 1}]), flush=True)
    """)
    repo = Path(__file__).resolve().parents[2]
    got = subprocess.run([sys.executable, "-c", code], cwd=repo, env=os.environ,
                         capture_output=True, text=True, timeout=60)
    assert got.stdout.strip() == "ready", got.stderr
    assert got.returncode == -signal.SIGSEGV


def test_I5_reserved_but_unmapped_slot_shows_poison_until_map_reserved(pool, rand):
    before = pool.backend.live()
    dst = pool.prepare_load(0, 3, map_now=False)
    assert pool.backend.live() == before, "map_now=False leaves the backend alone"
    assert pool.num_free_slots == S - 1 and pool.slot_of(0, 3) is not None and pool.state(0, 3) is LOADING
    assert is_poison(stride_view(pool, 0, 3))
    refused(pool, BusyError, lambda: pool.complete_load(0, 3, True))  # nothing can have been copied
    pool.map_reserved(0, 3)
    refused(pool, BusyError, lambda: pool.map_reserved(0, 3))
    data = rand(EB)
    dst.copy_(data)
    pool.complete_load(0, 3, True)
    assert torch.equal(pool.expert_tensor(0, 3), data)
    refused(pool, BusyError, lambda: pool.map_reserved(0, 3))
    pool.prepare_load(1, 1, map_now=False)
    live = pool.backend.live()
    pool.complete_load(1, 1, False)  # I6: a reservation that never mapped gives its slot back too
    assert pool.num_free_slots == S - 1 and pool.backend.live() == live and is_poison(stride_view(pool, 1, 1))


def test_load_through_the_transfer_engine_maps_in_the_worker(pool, cpu, rand):
    src = rand(EB)
    with TransferEngine(cpu) as eng:
        dst = pool.prepare_load(1, 4, map_now=False)
        eng.submit(TransferRequest(
            Link.H2D, TrafficClass.EXPERT, src, dst,
            before_issue=lambda: pool.map_reserved(1, 4),
            on_done=lambda h: pool.complete_load(1, 4, h.ok, h.device_event()),
        )).wait(T)
    assert torch.equal(pool.expert_tensor(1, 4), src)
    pool.wait_ready(1, [4])


# ---- I6 ------------------------------------------------------------------------------------------------
def test_I6_capacity_and_failed_loads_recycle_slots(pool, rand):
    for i, k in enumerate(ALL[:S]):
        load(pool, *k, rand(EB))
        assert pool.num_free_slots == S - i - 1
        pool.check_invariants()
    refused(pool, CapacityError, lambda: pool.prepare_load(*ALL[S]))
    pool.unmap(*ALL[0])
    pool.prepare_load(*ALL[S])
    refused(pool, CapacityError, lambda: pool.prepare_load(*ALL[S + 1]))
    pool.complete_load(*ALL[S], False)
    assert pool.num_free_slots == 1 and pool.state(*ALL[S]) is ABSENT
    pool.check_invariants()


def test_I6_close_releases_every_backend_object(cpu, rand):
    pool = ExpertSlotPool(HostBackend(), cpu, L, E, EB, S, poison_unmapped=True)
    load(pool, 0, 0, rand(EB))
    pool.pin(0, 0)
    load(pool, 1, 1, rand(EB))
    pool.prepare_load(1, 2)  # still loading at close
    assert pool.backend.live() == LiveCounts(L, S + 1, L * E)
    pool.close()
    assert pool.backend.live() == LiveCounts(0, 0, 0)


# ---- pinning and other refusals ---------------------------------------------------------------------
def test_pin_blocks_unmap_until_unpinned(pool, rand):
    refused(pool, NotResidentError, lambda: pool.pin(0, 3))
    refused(pool, ConfigError, lambda: pool.unpin(0, 3))
    load(pool, 0, 3, rand(EB))
    pool.pin(0, 3)
    assert pool.is_pinned(0, 3)
    refused(pool, PinnedError, lambda: pool.unmap(0, 3, wait=False))
    refused(pool, PinnedError, lambda: pool.unmap(0, 3, wait=True))
    pool.unpin(0, 3)
    refused(pool, ConfigError, lambda: pool.unpin(0, 3))
    pool.unmap(0, 3)
    assert not pool.is_pinned(0, 3) and pool.state(0, 3) is ABSENT


def test_wrong_state_and_out_of_range_calls_are_refused(pool, env):
    refused(pool, NotResidentError, lambda: pool.unmap(0, 0))
    refused(pool, BusyError, lambda: pool.complete_load(0, 0, True))
    pool.prepare_load(0, 0)
    refused(pool, BusyError, lambda: pool.unmap(0, 0))
    for layer, e in [(L, 0), (-1, 0), (0, E), (0, -1)]:
        for call in (pool.state, pool.slot_of, pool.prepare_load, pool.expert_tensor, pool.pin, pool.unmap):
            refused(pool, ConfigError, lambda c=call, a=layer, b=e: c(a, b))
        refused(pool, ConfigError, lambda a=layer, b=e: pool.complete_load(a, b, True))
        refused(pool, ConfigError, lambda a=layer, b=e: pool.record_read(a, [b], env.event()))
    refused(pool, ConfigError, lambda: pool.layer_tensor(L))


@pytest.mark.parametrize("kw", [{"num_slots": 0}, {"expert_bytes": 0}, {"num_experts": 0}, {"num_layers": -1}])
def test_bad_layout_raises_config_error_and_leaks_nothing(cpu, kw):
    args = {"num_layers": L, "num_experts": E, "expert_bytes": EB, "num_slots": S, **kw}
    backend = HostBackend()
    with pytest.raises(ConfigError):
        ExpertSlotPool(backend, cpu, **args)
    assert backend.live() == LiveCounts(0, 0, 0)
