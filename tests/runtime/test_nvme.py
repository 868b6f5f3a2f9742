"""DirectFile: aligned O_DIRECT round trips, alignment and range refusals, and the never-silent fallback."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

from tests.conftest import host_copy, start_thread
from tierplan.runtime.device import Device
from tierplan.runtime.errors import AlignmentError, ConfigError
from tierplan.runtime.nvme import DIRECT_ALIGN_BYTES, DirectFile, FileRegion, align_up

A = DIRECT_ALIGN_BYTES
SIZE = 64 * A


@pytest.fixture
def f(tmp_path):
    with DirectFile(tmp_path / "d.tpnvme", SIZE) as df:
        yield df


def read_back(cpu: Device, df: DirectFile, offset: int, n: int) -> torch.Tensor:
    buf = cpu.alloc_host(n).tensor
    df.read_into(offset, buf)
    return buf


def test_opens_with_o_direct_on_a_real_filesystem(f):
    assert f.direct_io is True and f.fallback_reason is None
    assert os.path.getsize(f.path) == SIZE


@pytest.mark.parametrize(("offset", "n"), [(0, A), (A, 3 * A), (0, SIZE), (SIZE - A, A), (17 * A, 20 * A)])
def test_round_trip_bit_exact(f, cpu, rand, offset, n):
    data = rand(n)
    f.write_from(offset, host_copy(cpu, data))
    assert torch.equal(read_back(cpu, f, offset, n), data)


def test_writes_land_where_asked_and_persist_across_reopen(tmp_path, cpu, rand):
    path = tmp_path / "p.tpnvme"
    whole = rand(SIZE)
    with DirectFile(path, SIZE) as df:
        df.write_from(0, host_copy(cpu, whole))
        patch = rand(2 * A)
        df.write_from(5 * A, host_copy(cpu, patch))
        whole[5 * A : 7 * A] = patch
    with DirectFile(path, SIZE) as df:
        assert torch.equal(read_back(cpu, df, 0, SIZE), whole)
    assert path.read_bytes() == whole.numpy().tobytes()


def test_view_at_an_aligned_offset_of_an_aligned_buffer_is_accepted(f, cpu, rand):
    big = host_copy(cpu, rand(4 * A))
    f.write_from(A, big[A : 3 * A])  # contiguous view, address still page aligned
    assert torch.equal(read_back(cpu, f, A, 2 * A), big[A : 3 * A])


# ---- O_DIRECT alignment ------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize(
    ("what", "offset", "start", "n"),
    [("offset", 512, 0, A), ("offset", A + 1, 0, A), ("length", 0, 0, A + 512), ("length", A, 0, 100),
     ("buffer address", 0, 1, A), ("buffer address", 0, 512, A)],
)
def test_misaligned_direct_io_raises_alignment_error_before_any_io(f, cpu, rand, op, what, offset, start, n):
    before = rand(SIZE)
    f.write_from(0, host_copy(cpu, before))
    base = host_copy(cpu, rand(start + n + A))
    buf = base[start : start + n]  # a misaligned view of an aligned buffer when start % A
    snapshot = buf.clone()
    with pytest.raises(AlignmentError, match=what):
        (f.read_into if op == "read" else f.write_from)(offset, buf)
    assert torch.equal(read_back(cpu, f, 0, SIZE), before), "a refused write must not touch the file"
    assert torch.equal(buf, snapshot), "a refused read must not touch the buffer"


@pytest.mark.parametrize("size", [0, -A, 1, A + 1, A // 2])
def test_file_size_must_be_a_positive_multiple_of_the_alignment(tmp_path, size):
    with pytest.raises(AlignmentError):
        DirectFile(tmp_path / "bad.tpnvme", size)


# ---- ranges and buffer types --------------------------------------------------------------------------
@pytest.mark.parametrize(("offset", "n"), [(-A, A), (SIZE, A), (SIZE - A, 2 * A), (0, SIZE + A)])
@pytest.mark.parametrize("op", ["read", "write"])
def test_out_of_range_raises_config_error(f, cpu, rand, op, offset, n):
    buf = host_copy(cpu, rand(n))
    with pytest.raises(ConfigError, match="outside file"):
        (f.read_into if op == "read" else f.write_from)(offset, buf)


@pytest.mark.parametrize(
    "make",
    [lambda c: c.alloc_host(2 * A).tensor.view(torch.int16),  # wrong dtype
     lambda c: c.alloc_host(2 * A).tensor[::2],  # non-contiguous
     lambda c: torch.empty(A, dtype=torch.uint8, device="meta")],  # not host memory
)
def test_buffer_must_be_contiguous_uint8_host_memory(f, cpu, make):
    with pytest.raises(ConfigError):
        f.read_into(0, make(cpu))


# ---- fallback -------------------------------------------------------------------------------------
def test_direct_false_is_buffered_and_says_why(tmp_path, cpu, rand):
    with DirectFile(tmp_path / "b.tpnvme", SIZE, direct=False) as df:
        assert df.direct_io is False
        assert df.fallback_reason and "disabled" in df.fallback_reason
        data = rand(1000)
        df.write_from(123, data[5:])  # unaligned offset, length and address are fine when buffered
        back = torch.empty(995, dtype=torch.uint8)
        df.read_into(123, back)
        assert torch.equal(back, data[5:])


def _refuse_o_direct(monkeypatch, err: int) -> list[int]:
    real_open = os.open
    refused: list[int] = []

    def fake_open(path, flags, *args, **kw):
        if flags & os.O_DIRECT:
            refused.append(flags)
            raise OSError(err, os.strerror(err))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", fake_open)
    return refused


def test_filesystem_refusing_o_direct_falls_back_and_says_so(tmp_path, monkeypatch, cpu, rand):
    refused = _refuse_o_direct(monkeypatch, errno.EINVAL)  # what tmpfs and some overlays answer
    with DirectFile(tmp_path / "fb.tpnvme", SIZE) as df:
        assert refused, "O_DIRECT was tried first"
        assert df.direct_io is False
        assert df.fallback_reason and "refused" in df.fallback_reason
        data = rand(A + 7)
        df.write_from(3, data)
        back = torch.empty(A + 7, dtype=torch.uint8)
        df.read_into(3, back)
        assert torch.equal(back, data)


def test_other_open_errors_are_not_swallowed(tmp_path, monkeypatch):
    _refuse_o_direct(monkeypatch, errno.EACCES)
    with pytest.raises(PermissionError):
        DirectFile(tmp_path / "x.tpnvme", SIZE)


# ---- lifecycle and threads ------------------------------------------------------------------------
def test_close_is_idempotent_and_io_after_close_raises(tmp_path, cpu):
    df = DirectFile(tmp_path / "c.tpnvme", SIZE)
    with df:
        pass
    df.close()
    with pytest.raises(Exception, match="closed"):
        df.read_into(0, cpu.alloc_host(A).tensor)


def test_regions_and_sub_regions(f):
    r = f.region(2 * A, 8 * A)
    assert r == FileRegion(f, 2 * A, 8 * A)
    assert r.sub(A, 2 * A) == FileRegion(f, 3 * A, 2 * A)
    assert align_up(0, A) == 0 and align_up(1, A) == A and align_up(A, A) == A and align_up(A + 1, A) == 2 * A


def test_threads_do_positional_io_on_one_file(f, cpu):
    num_threads, per = 8, SIZE // 8
    barrier = threading.Barrier(num_threads)

    def work(i: int) -> None:
        gen = torch.Generator().manual_seed(i)
        data = torch.randint(0, 256, (per,), dtype=torch.uint8, generator=gen)
        barrier.wait(10)
        for _ in range(20):
            f.write_from(i * per, host_copy(cpu, data))
            assert torch.equal(read_back(cpu, f, i * per, per), data)

    runs = [start_thread(lambda i=i: work(i)) for i in range(num_threads)]
    for t, errs in runs:
        t.join(30)
        assert not t.is_alive() and not errs, errs


def test_short_read_of_a_file_truncated_behind_our_back_raises(f, cpu, rand):
    f.write_from(0, host_copy(cpu, rand(SIZE)))
    os.truncate(f.path, 4 * A)
    with pytest.raises(OSError) as ei:
        f.read_into(2 * A, cpu.alloc_host(4 * A).tensor)  # 2 pages exist, 4 asked: never silent zeros
    assert ei.value.errno == errno.EIO
