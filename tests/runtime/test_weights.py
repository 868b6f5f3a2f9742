"""Expert formats, sources and stores (CPU twin); the loader into slots is in test_loader.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.runtime.conftest import MIXED
from tierplan.runtime.checksum import checksum
from tierplan.runtime.device import Device
from tierplan.runtime.errors import ConfigError
from tierplan.runtime.weights.format import ExpertFormat
from tierplan.runtime.weights.sources import SafetensorsExpertSource, SyntheticExpertSource
from tierplan.runtime.weights.stores import NvmeExpertStore, PinnedExpertStore


@pytest.fixture()
def dev() -> Device:
    return Device("cpu")


def test_format_offsets_are_aligned_and_roundtrip_every_dtype() -> None:
    assert all(t.offset_bytes % 256 == 0 for t in MIXED.tensors)
    g = torch.Generator().manual_seed(3)
    tensors = {
        "w_bf16": torch.randn(24, 40, generator=g).to(torch.bfloat16),
        "w_fp8": torch.randn(40, 24, generator=g).to(torch.float8_e4m3fn),
        "w_fp4_packed": torch.randint(0, 256, (24, 20), dtype=torch.uint8, generator=g),
        "scale": torch.rand(3, generator=g),
    }
    rec = torch.full((MIXED.num_bytes,), 7, dtype=torch.uint8)
    MIXED.pack(tensors, rec)
    back = MIXED.unpack(rec)
    for k, v in tensors.items():
        assert torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)), k


def test_format_rejects_bad_input() -> None:
    with pytest.raises(ConfigError, match="dimension"):
        ExpertFormat.from_shapes([("w", (0, 4), "bfloat16")])
    with pytest.raises(ConfigError, match="unknown dtype"):
        ExpertFormat.from_shapes([("w", (2, 4), "float128")])
    rec = torch.empty(MIXED.num_bytes, dtype=torch.uint8)
    with pytest.raises(ConfigError, match="missing tensors"):
        MIXED.pack({}, rec)
    with pytest.raises(ConfigError, match="w_bf16"):
        MIXED.pack({t.name: torch.zeros(1) for t in MIXED.tensors}, rec)


def test_synthetic_source_is_deterministic_and_distinct() -> None:
    src = SyntheticExpertSource(MIXED, 2, 3, seed=5)
    a, b, c = (torch.empty(MIXED.num_bytes, dtype=torch.uint8) for _ in range(3))
    src.fill(1, 2, a)
    src.fill(1, 2, b)
    src.fill(1, 1, c)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_safetensors_source_reads_a_local_checkpoint(tmp_path: Path) -> None:
    fmt = ExpertFormat.swiglu(16, 24)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in (3, 5):
        for e in range(2):
            for name in ("gate_proj", "up_proj", "down_proj"):
                shape = (16, 24) if name == "down_proj" else (24, 16)
                tensors[f"model.layers.{layer}.mlp.experts.{e}.{name}.weight"] = torch.randn(
                    shape, generator=g).to(torch.bfloat16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    src = SafetensorsExpertSource(tmp_path, fmt, num_experts=2, layer_ids=[3, 5])
    rec = torch.empty(fmt.num_bytes, dtype=torch.uint8)
    src.fill(1, 1, rec)
    got = fmt.unpack(rec)
    assert torch.equal(got["down_proj"], tensors["model.layers.5.mlp.experts.1.down_proj.weight"])
    with pytest.raises(ConfigError, match="not in checkpoint"):
        SafetensorsExpertSource(tmp_path, fmt, 2, [3], name_template="blocks.{layer}.{expert}.{name}")
    with pytest.raises(ConfigError, match="not found"):
        SafetensorsExpertSource(tmp_path / "nope", fmt, 2, [3])


def test_nvme_store_reopens_from_its_index_and_matches_pinned(tmp_path: Path, dev: Device) -> None:
    src = SyntheticExpertSource(MIXED, 2, 4, seed=1)
    pinned = PinnedExpertStore(dev, src)
    NvmeExpertStore.build(tmp_path / "e.bin", src, dev).close()
    nvme = NvmeExpertStore(tmp_path / "e.bin")
    buf = dev.alloc_host(nvme.records.record_bytes)
    for layer in range(2):
        for e in range(4):
            r = nvme.region(layer, e)
            nvme.file.read_into(r.offset_bytes, buf.tensor)
            nvme.verify(layer, e, buf.tensor)
            assert checksum(buf.tensor[: MIXED.num_bytes]) == pinned.checksum(layer, e)
    assert nvme.format == MIXED
    assert pinned.offsets(1, [3, 0]) == [pinned.offset(1, 3), pinned.offset(1, 0)] and pinned.offsets(0, []) == []
    for layer, experts in ((1, [0, 4]), (2, [0]), (0, [-1])):
        with pytest.raises(ConfigError, match="out of range"):
            pinned.offsets(layer, experts)
    with pytest.raises(ConfigError, match="index"):
        NvmeExpertStore(tmp_path / "missing.bin")
    nvme.close()
    pinned.close()
