"""Expert weight stores: every expert's record in pinned host memory, or in an NVMe file (inference process).

Records sit at 4 KiB-aligned offsets so the NVMe store can use O_DIRECT and the pinned store can be the
source of an async host->device copy. Each record has an xxh3 checksum taken when the store was built;
the NVMe store's index (a JSON file beside the data) keeps format, offsets and checksums, so a store
built once is reopened without the source. Mechanism only: no decision about which expert lives where.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from tierplan.runtime.checksum import checksum
from tierplan.runtime.device import Device
from tierplan.runtime.errors import ConfigError, CorruptDataError
from tierplan.runtime.nvme import DIRECT_ALIGN_BYTES, DirectFile, FileRegion, align_up
from tierplan.runtime.weights.format import ExpertFormat, ExpertTensorSpec
from tierplan.runtime.weights.sources import ExpertSource

INDEX_VERSION = 1


class _Records:
    """Offsets and checksums of L x E records of one format."""

    def __init__(self, fmt: ExpertFormat, num_layers: int, num_experts: int) -> None:
        self.format, self.num_layers, self.num_experts = fmt, num_layers, num_experts
        self.record_bytes = align_up(fmt.num_bytes, DIRECT_ALIGN_BYTES)
        self.total_bytes = num_layers * num_experts * self.record_bytes
        self.checksums: list[int] = [0] * (num_layers * num_experts)

    def index(self, layer: int, expert: int) -> int:
        if not (0 <= layer < self.num_layers and 0 <= expert < self.num_experts):
            raise ConfigError(
                f"expert ({layer}, {expert}) out of range ({self.num_layers} layers, {self.num_experts} experts)"
            )
        return layer * self.num_experts + expert

    def offset(self, layer: int, expert: int) -> int:
        return self.index(layer, expert) * self.record_bytes

    def offsets(self, layer: int, experts: list[int]) -> list[int]:
        """`offset` of each of a layer's experts (a prefetch list: the range is checked once per expert, cheaply)."""
        if experts and not (0 <= layer < self.num_layers and all(0 <= e < self.num_experts for e in experts)):
            for e in experts:
                self.index(layer, e)  # raises for the first one out of range
        base = layer * self.num_experts
        return [(base + e) * self.record_bytes for e in experts]

    def verify(self, layer: int, expert: int, data: torch.Tensor, where: str) -> None:
        want = self.checksums[self.index(layer, expert)]
        got = checksum(data[: self.format.num_bytes])
        if got != want:
            raise CorruptDataError(
                f"expert ({layer}, {expert}) from {where}: checksum {got:#018x}, expected {want:#018x}"
            )


class PinnedExpertStore:
    """All experts in one page-aligned host buffer (pinned on a GPU)."""

    def __init__(self, device: Device, source: ExpertSource) -> None:
        self.records = _Records(source.format, source.num_layers, source.num_experts)
        self._buf = device.alloc_host(self.records.total_bytes)
        self._buf.tensor.zero_()
        for layer in range(source.num_layers):
            for e in range(source.num_experts):
                rec = self.record(layer, e)
                source.fill(layer, e, rec)
                self.records.checksums[self.records.index(layer, e)] = checksum(rec[: source.format.num_bytes])

    @property
    def format(self) -> ExpertFormat:
        return self.records.format

    def record(self, layer: int, expert: int) -> torch.Tensor:
        """The whole 4 KiB-aligned record (expert bytes, then zero padding)."""
        off = self.records.offset(layer, expert)
        return self._buf.tensor[off : off + self.records.record_bytes]  # [record_bytes]

    @property
    def buffer(self) -> torch.Tensor:
        """The whole pinned buffer [total_bytes]; expert (l, e) starts at `offset(l, e)`."""
        return self._buf.tensor

    def offset(self, layer: int, expert: int) -> int:
        return self.records.offset(layer, expert)

    def offsets(self, layer: int, experts: list[int]) -> list[int]:
        return self.records.offsets(layer, experts)

    def expert(self, layer: int, expert: int) -> torch.Tensor:
        """Host view of the expert's bytes [format.num_bytes]."""
        off = self.records.offset(layer, expert)
        return self._buf.tensor[off : off + self.records.format.num_bytes]  # [num_bytes]

    def checksum(self, layer: int, expert: int) -> int:
        return self.records.checksums[self.records.index(layer, expert)]

    def verify(self, layer: int, expert: int) -> None:
        self.records.verify(layer, expert, self.expert(layer, expert), "pinned store")

    def close(self) -> None:
        self._buf.close()


class NvmeExpertStore:
    """All experts in one file read with O_DIRECT; `<path>.index.json` holds layout and checksums."""

    def __init__(self, path: str | os.PathLike[str], direct_io: bool = True) -> None:
        self.path = Path(path)
        index_path = self.path.with_name(self.path.name + ".index.json")
        if not index_path.is_file():
            raise ConfigError(f"NVMe expert store index {index_path} not found; build the store first")
        meta = json.loads(index_path.read_text())
        if meta.get("version") != INDEX_VERSION:
            raise ConfigError(f"{index_path}: index version {meta.get('version')}, expected {INDEX_VERSION}")
        specs = (ExpertTensorSpec(t["name"], tuple(t["shape"]), t["dtype"], t["offset_bytes"]) for t in meta["tensors"])
        fmt = ExpertFormat(tuple(specs), meta["expert_bytes"])
        self.records = _Records(fmt, meta["num_layers"], meta["num_experts"])
        self.records.checksums = [int(c, 16) for c in meta["checksums"]]
        self.file = DirectFile(self.path, self.records.total_bytes, direct=direct_io)

    @classmethod
    def build(cls, path: str | os.PathLike[str], source: ExpertSource, device: Device,
              direct_io: bool = True) -> NvmeExpertStore:
        """Write every expert of `source` to `path` (+ index) and open it."""
        path = Path(path)
        rec = _Records(source.format, source.num_layers, source.num_experts)
        staging = device.alloc_host(rec.record_bytes)
        try:
            with DirectFile(path, rec.total_bytes, direct=direct_io) as f:
                for layer in range(source.num_layers):
                    for e in range(source.num_experts):
                        staging.tensor.zero_()
                        source.fill(layer, e, staging.tensor)
                        rec.checksums[rec.index(layer, e)] = checksum(staging.tensor[: source.format.num_bytes])
                        f.write_from(rec.offset(layer, e), staging.tensor)
        finally:
            staging.close()
        meta = {
            "version": INDEX_VERSION,
            "num_layers": rec.num_layers,
            "num_experts": rec.num_experts,
            "expert_bytes": source.format.num_bytes,
            "record_bytes": rec.record_bytes,
            "tensors": [
                {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "offset_bytes": t.offset_bytes}
                for t in source.format.tensors
            ],
            "checksums": [f"{c:016x}" for c in rec.checksums],
        }
        path.with_name(path.name + ".index.json").write_text(json.dumps(meta))
        return cls(path, direct_io=direct_io)

    @property
    def format(self) -> ExpertFormat:
        return self.records.format

    def region(self, layer: int, expert: int) -> FileRegion:
        """The whole aligned record (O_DIRECT reads whole 4 KiB pages)."""
        return self.file.region(self.records.offset(layer, expert), self.records.record_bytes)

    def verify(self, layer: int, expert: int, data: torch.Tensor) -> None:
        self.records.verify(layer, expert, data, f"NVMe store {self.path}")

    def close(self) -> None:
        self.file.close()
