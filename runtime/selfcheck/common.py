"""Shared set-up of the substrate self-checks (inference process; CPU twin or one CUDA GPU).

Builds synthetic expert stores (pinned + NVMe) and a position-weighted
fingerprint that a GPU can compute without copying a record back: sum((i+1) * word_i) over int32 words,
mod 2^64 (integer wrap-around is associative, so every reduction order gives the same number).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tierplan.runtime.device import Device
from tierplan.runtime.weights.format import ExpertFormat
from tierplan.runtime.weights.sources import SyntheticExpertSource
from tierplan.runtime.weights.stores import NvmeExpertStore, PinnedExpertStore

Progress = Callable[[int], None]  # called with the number of operations just finished


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Position-weighted sum of a uint8 record's int32 words, as a 0-d int64 tensor on t's device."""
    words = t.view(torch.int32).to(torch.int64)  # [W]
    idx = torch.arange(1, words.numel() + 1, device=t.device, dtype=torch.int64)  # [W]
    return (words * idx).sum()


@dataclass
class ExpertFixture:
    format: ExpertFormat
    source: SyntheticExpertSource
    pinned: PinnedExpertStore
    nvme: NvmeExpertStore
    expected: dict[tuple[int, int], int]  # fingerprint of each expert record

    def close(self) -> None:
        self.pinned.close()
        self.nvme.close()


def build_experts(device: Device, workdir: Path, num_layers: int, num_experts: int, hidden: int,
                  intermediate: int, seed: int) -> ExpertFixture:
    fmt = ExpertFormat.swiglu(hidden, intermediate, "bfloat16")
    src = SyntheticExpertSource(fmt, num_layers, num_experts, seed)
    pinned = PinnedExpertStore(device, src)
    nvme = NvmeExpertStore.build(workdir / "experts.tpnvme", src, device)
    expected = {
        (layer, e): int(fingerprint(pinned.expert(layer, e)))
        for layer in range(num_layers)
        for e in range(num_experts)
    }
    return ExpertFixture(fmt, src, pinned, nvme, expected)


def flip_byte(path: Path, offset_bytes: int) -> None:
    """Corrupt one byte of a file behind the runtime's back (plain buffered I/O, then fsync)."""
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, 1, offset_bytes)
        os.pwrite(fd, bytes([old[0] ^ 0x5A]), offset_bytes)
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def workdir_for(path: str | os.PathLike[str] | None) -> Any:
    if path is not None:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    # Not /tmp: tmpfs refuses O_DIRECT. The project folder is on the real disk.
    with tempfile.TemporaryDirectory(prefix="tierplan-check-", dir=os.environ.get("TIERPLAN_SCRATCH")) as d:
        yield Path(d)
