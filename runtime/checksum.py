"""Checksums of host bytes (inference process): xxh3-64 over a contiguous CPU tensor's memory.

Only host memory is hashed: data on the GPU is hashed when it lands on the host, never on the hot path.
"""

from __future__ import annotations

import torch
import xxhash

from tierplan.runtime.errors import ConfigError


def checksum(t: torch.Tensor) -> int:
    """xxh3-64 of the raw bytes of a contiguous CPU tensor (any dtype)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ConfigError(
            f"checksum needs a contiguous CPU tensor, got device={t.device} contiguous={t.is_contiguous()}"
        )
    raw = t.reshape(-1).view(torch.uint8)  # [N]
    return xxhash.xxh3_64_intdigest(memoryview(raw.numpy()))
