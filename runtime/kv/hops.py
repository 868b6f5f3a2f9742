"""The hop plans of KV block moves (inference process): which links a move between two tiers takes, in order.

Plain data read by `runtime.kv.handler`: one plan per (source tier, destination tier), each a chain of copies
from the move's source block to its destination block, through a staging buffer where no link joins the
two tiers. Never moves bytes, never decides which block goes where.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from tierplan.runtime.kv.spec import Tier
from tierplan.runtime.transfer_types import Link


class End(Enum):
    """Where a hop reads or writes: the move's source block, its destination block, or its staging buffer."""

    SRC = "src"
    DST = "dst"
    STAGE = "stage"


@dataclass(frozen=True)
class HopSpec:
    """One copy of a move: its link, its ends, whether it waits for the caller's device work (it touches the
    GPU) and whether the bytes it lands are on the host (then checksummed, or verified)."""

    link: Link
    src: End
    dst: End
    after: bool = False
    lands_on_host: bool = False


# One hop plan per (source tier, destination tier). GPU <-> NVMe has no direct link: two hops through a
# page-aligned host staging buffer (O_DIRECT needs aligned host memory; the GPU tier is not host memory).
HOP_PLANS: dict[tuple[Tier, Tier], tuple[HopSpec, ...]] = {
    (Tier.GPU, Tier.CPU): (HopSpec(Link.D2H, End.SRC, End.DST, after=True, lands_on_host=True),),
    (Tier.CPU, Tier.GPU): (HopSpec(Link.H2D, End.SRC, End.DST, after=True),),
    (Tier.CPU, Tier.NVME): (HopSpec(Link.H2DISK, End.SRC, End.DST),),
    (Tier.NVME, Tier.CPU): (HopSpec(Link.DISK2H, End.SRC, End.DST, lands_on_host=True),),
    (Tier.GPU, Tier.NVME): (HopSpec(Link.D2H, End.SRC, End.STAGE, after=True, lands_on_host=True),
                            HopSpec(Link.H2DISK, End.STAGE, End.DST)),
    (Tier.NVME, Tier.GPU): (HopSpec(Link.DISK2H, End.SRC, End.STAGE, lands_on_host=True),
                            HopSpec(Link.H2D, End.STAGE, End.DST, after=True)),
}
