"""Where KV block bytes sit: tier names, block locations and moves (inference process).

Plain values shared by the manager (books), the stores (bytes) and the handler (moves). Never holds
memory, never decides placement.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Tier(Enum):
    GPU = "gpu"
    CPU = "cpu"
    NVME = "nvme"


@dataclass(frozen=True)
class KVBlockSpec:
    """Block slot `index` of `tier` (a row of the GPU/CPU store, or a block-sized region of the NVMe file)."""

    tier: Tier
    index: int

    def __str__(self) -> str:
        return f"{self.tier.value}[{self.index}]"


@dataclass(frozen=True)
class KVMove:
    """A reserved move of block `block_id` from `src` to `dst`; finished by `complete_move(move, ok)`."""

    block_id: int
    src: KVBlockSpec
    dst: KVBlockSpec

    @property
    def pair(self) -> str:
        return f"{self.src.tier.value}->{self.dst.tier.value}"
