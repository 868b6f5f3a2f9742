"""HostBackend (memfd + mmap twin of CUDA VMM): stable addresses, bytes that follow their chunk, clean-up.

Faults (a write to the read-only poison map, a read of an unmapped page) kill the process, so those run in a
child interpreter and the test asserts it died of SIGSEGV right where expected.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tierplan.runtime.errors import ConfigError
from tierplan.runtime.memory.backend import LiveCounts
from tierplan.runtime.memory.host import HostBackend

P = mmap.PAGESIZE
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def b():
    be = HostBackend()
    yield be
    be.close()


def test_granularity_is_the_page_size(b):
    assert b.granularity_bytes == P
    assert b.live() == LiveCounts(0, 0, 0)


def test_map_write_unmap_and_live_counts(b, rand):
    va = b.reserve(4 * P)
    c = b.create_physical(2 * P)
    assert b.live() == LiveCounts(1, 1, 0)
    b.map(va + P, 2 * P, c)
    assert b.live() == LiveCounts(1, 1, 1)
    data = rand(2 * P)
    b.tensor(va + P, 2 * P).copy_(data)
    assert torch.equal(b.tensor(va + P, 2 * P), data)
    b.unmap(va + P, 2 * P)
    assert b.live() == LiveCounts(1, 1, 0)
    b.release_physical(c)
    b.free_reservation(va, 4 * P)
    assert b.live() == LiveCounts(0, 0, 0)


def test_bytes_follow_the_chunk_across_remaps(b, rand):
    r1, r2 = b.reserve(4 * P), b.reserve(2 * P)
    c = b.create_physical(2 * P)
    data = rand(2 * P)
    b.map(r1, 2 * P, c)
    b.tensor(r1, 2 * P).copy_(data)
    b.unmap(r1, 2 * P)
    for va in (r1 + 2 * P, r2, r1):  # elsewhere in the same range, another range, back home
        b.map(va, 2 * P, c)
        assert torch.equal(b.tensor(va, 2 * P), data)
        b.unmap(va, 2 * P)


def test_one_chunk_mapped_twice_aliases_the_same_bytes(b, rand):
    va = b.reserve(4 * P)
    c = b.create_physical(P)
    b.map(va, P, c)
    b.map(va + 2 * P, P, c)
    data = rand(P)
    b.tensor(va, P).copy_(data)
    assert torch.equal(b.tensor(va + 2 * P, P), data)


def test_address_is_stable_and_tensor_made_once_sees_every_remap(b, rand):
    va = b.reserve(2 * P)
    c1, c2 = b.create_physical(P), b.create_physical(P)
    b.map(va, P, c1)
    view = b.tensor(va, P)  # made once, like the pool's layer tensor
    d1, d2 = rand(P), rand(P)
    view.copy_(d1)
    b.unmap(va, P)
    b.map(va, P, c2)
    view.copy_(d2)
    b.unmap(va, P)
    b.map(va, P, c1)
    assert view.data_ptr() == va
    assert torch.equal(view, d1), "c1 kept its bytes while c2 was mapped at the same address"


def test_fill_physical_is_visible_through_a_mapping(b, rand):
    va = b.reserve(P)
    c = b.create_physical(P)
    b.map(va, P, c)
    b.tensor(va, P).copy_(rand(P))
    b.fill_physical(c, 0xAB)
    assert bool((b.tensor(va, P) == 0xAB).all())


def test_read_only_map_reads_the_poison(b):
    va = b.reserve(2 * P)
    poison = b.create_physical(P)
    b.fill_physical(poison, 0xFF)
    b.map(va, P, poison, read_only=True)
    b.map(va + P, P, poison, read_only=True)
    assert bool((b.tensor(va, 2 * P) == 0xFF).all())


# ---- refusals leave state unchanged -------------------------------------------------------------------
def test_double_map_of_the_same_va_raises_and_keeps_the_first_mapping(b, rand):
    va = b.reserve(2 * P)
    c1, c2 = b.create_physical(P), b.create_physical(P)
    b.map(va, P, c1)
    data = rand(P)
    b.tensor(va, P).copy_(data)
    with pytest.raises(ConfigError, match="already mapped"):
        b.map(va, P, c2)
    assert b.live() == LiveCounts(1, 2, 1)
    assert torch.equal(b.tensor(va, P), data)


def test_bad_sizes_and_unknown_objects_raise_config_error(b):
    va = b.reserve(2 * P)
    c = b.create_physical(P)
    before = b.live()
    for call in (
        lambda: b.reserve(P + 1),
        lambda: b.reserve(0),
        lambda: b.create_physical(P // 2),
        lambda: b.map(va, 2 * P, c),  # more than the chunk holds
        lambda: b.map(va, P + 1, c),
        lambda: b.unmap(va, P),  # nothing mapped
        lambda: b.free_reservation(va + P, P),  # not a reservation base
    ):
        with pytest.raises(ConfigError):
            call()
        assert b.live() == before
    b.map(va, P, c)
    with pytest.raises(ConfigError):
        b.unmap(va, 2 * P)  # wrong size
    with pytest.raises(ConfigError, match="still mapped"):
        b.release_physical(c)
    b.unmap(va, P)
    b.release_physical(c)
    with pytest.raises(ConfigError, match="already released"):
        b.release_physical(c)


def test_close_releases_everything_even_while_mapped():
    be = HostBackend()
    for _ in range(3):
        va = be.reserve(4 * P)
        for i in range(4):
            c = be.create_physical(P)
            be.map(va + i * P, P, c, read_only=bool(i % 2))
    be.create_physical(P)  # never mapped
    assert be.live() == LiveCounts(3, 13, 12)
    be.close()
    assert be.live() == LiveCounts(0, 0, 0)
    be.close()  # idempotent
    assert be.live() == LiveCounts(0, 0, 0)


def test_released_chunks_close_their_memfd():
    be = HostBackend()
    fds_before = set(os.listdir("/proc/self/fd"))
    for _ in range(8):
        be.create_physical(P)
    be.close()
    assert set(os.listdir("/proc/self/fd")) <= fds_before


# ---- faults, in a child process -------------------------------------------------------------------------
def _run_child(body: str) -> subprocess.CompletedProcess[str]:
    code = "from tierplan.runtime.memory.host import HostBackend\nimport mmap\nP = mmap.PAGESIZE\nb = HostBackend()\n"
    code += textwrap.dedent(body)
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)


def test_writing_through_a_read_only_poison_map_faults():
    got = _run_child("""
        va = b.reserve(P)
        poison = b.create_physical(P)
        b.fill_physical(poison, 0xFF)
        b.map(va, P, poison, read_only=True)
        t = b.tensor(va, P)
        assert int(t[7]) == 0xFF
        print("ready", flush=True)
        t.fill_(0)
        print("wrote through a read-only map", flush=True)
    """)
    assert got.stdout.strip() == "ready", got.stderr
    assert got.returncode == -signal.SIGSEGV


def test_reading_an_unmapped_page_faults():
    got = _run_child("""
        va = b.reserve(P)
        c = b.create_physical(P)
        b.map(va, P, c)
        t = b.tensor(va, P)
        t.fill_(1)
        b.unmap(va, P)
        print("ready", flush=True)
        print(int(t.sum()), flush=True)
    """)
    assert got.stdout.strip() == "ready", got.stderr
    assert got.returncode == -signal.SIGSEGV


# ---- contract gaps (the CUDA backend refuses these; the twin must too) ------------------------------------
def test_map_overlapping_an_existing_mapping_raises(b, rand):
    va = b.reserve(4 * P)
    c1, c2 = b.create_physical(2 * P), b.create_physical(P)
    b.map(va, 2 * P, c1)
    data = rand(2 * P)
    b.tensor(va, 2 * P).copy_(data)
    with pytest.raises(ConfigError):
        b.map(va + P, P, c2)  # its second page is already c1's
    assert b.live().mappings == 1
    assert torch.equal(b.tensor(va, 2 * P), data)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def test_map_outside_any_reservation_raises(b):
    # The test owns this memory, so the unchecked MAP_FIXED (if the bug is present) clobbers nothing else.
    mine = _libc.mmap(None, 2 * P, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert mine not in (None, ctypes.c_void_p(-1).value)
    c = b.create_physical(P)
    try:
        with pytest.raises(ConfigError):
            b.map(mine, P, c)
    finally:
        if b.live().mappings:
            b.unmap(mine, P)
        _libc.munmap(mine, 2 * P)


def test_free_reservation_with_live_mappings_raises(b):
    va = b.reserve(2 * P)
    c = b.create_physical(P)
    b.map(va, P, c)
    try:
        with pytest.raises(ConfigError):
            b.free_reservation(va, 2 * P)
        assert b.live() == LiveCounts(1, 1, 1)
    finally:
        if b.live().reservations == 0:  # the bug happened: forget the dangling mapping before close()
            b._mapped.pop(va, None)
