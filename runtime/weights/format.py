"""The byte layout of one expert record: its tensors packed at aligned offsets (inference process).

An expert is moved as one opaque run of bytes, whatever the dtypes inside (bf16, fp8, fp4 packed into
uint8...), so every tier moves it byte-exactly. `ExpertFormat.unpack` gives typed views for compute.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tierplan.runtime.errors import ConfigError
from tierplan.runtime.nvme import align_up

TENSOR_ALIGN_BYTES = 256  # what GEMM kernels like for operand base addresses

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32",
        "bfloat16",
        "float16",
        "float8_e4m3fn",
        "float8_e5m2",
        "uint8",
        "int8",
        "int32",
    )
    if hasattr(torch, name)
}


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclass(frozen=True)
class ExpertTensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset_bytes: int

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * dtype_from_name(self.dtype).itemsize


@dataclass(frozen=True)
class ExpertFormat:
    tensors: tuple[ExpertTensorSpec, ...]
    num_bytes: int

    @classmethod
    def from_shapes(cls, shapes: Sequence[tuple[str, tuple[int, ...], str]]) -> ExpertFormat:
        """Pack (name, shape, dtype) tensors one after another at TENSOR_ALIGN_BYTES boundaries."""
        if not shapes:
            raise ConfigError("ExpertFormat needs at least one tensor")
        specs, off = [], 0
        for name, shape, dtype in shapes:
            if any(d <= 0 for d in shape):
                raise ConfigError(f"expert tensor {name!r}: every dimension must be > 0, got {shape}")
            spec = ExpertTensorSpec(name, tuple(shape), dtype, off)
            specs.append(spec)
            off = align_up(off + spec.num_bytes, TENSOR_ALIGN_BYTES)
        return cls(tuple(specs), off)

    @classmethod
    def swiglu(cls, hidden: int, intermediate: int, dtype: str = "bfloat16") -> ExpertFormat:
        """The usual MoE expert: gate and up [I, H], down [H, I] (Mixtral, Qwen3-MoE, DeepSeek, OLMoE)."""
        return cls.from_shapes(
            [("gate_proj", (intermediate, hidden), dtype), ("up_proj", (intermediate, hidden), dtype),
             ("down_proj", (hidden, intermediate), dtype)]
        )

    def unpack(self, record: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views into a record [num_bytes] uint8 (no copy)."""
        if record.dtype != torch.uint8 or record.numel() < self.num_bytes:
            raise ConfigError(f"unpack: need a uint8 record of >= {self.num_bytes} bytes")
        out = {}
        for t in self.tensors:
            raw = record[t.offset_bytes : t.offset_bytes + t.num_bytes]
            out[t.name] = raw.view(dtype_from_name(t.dtype)).view(t.shape)
        return out

    def pack(self, tensors: dict[str, torch.Tensor], out: torch.Tensor) -> None:
        """Write named tensors into a record `out` [>= num_bytes] uint8 (CPU); padding is zeroed."""
        missing = {t.name for t in self.tensors} - set(tensors)
        if missing:
            raise ConfigError(f"pack: missing tensors {sorted(missing)}")
        out[: self.num_bytes].zero_()
        for t in self.tensors:
            src = tensors[t.name]
            if tuple(src.shape) != t.shape or src.dtype != dtype_from_name(t.dtype):
                raise ConfigError(
                    f"pack: tensor {t.name!r} is {tuple(src.shape)}/{src.dtype}, expected {t.shape}/{t.dtype}"
                )
            out[t.offset_bytes : t.offset_bytes + t.num_bytes].copy_(src.contiguous().reshape(-1).view(torch.uint8))
