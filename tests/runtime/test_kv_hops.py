"""The KV handler's hop table: one plan per tier pair, each a chain from the source block to the destination."""

from __future__ import annotations

from itertools import pairwise

from tierplan.runtime.kv import Tier
from tierplan.runtime.kv.handler import PAIRS
from tierplan.runtime.kv.hops import HOP_PLANS, End
from tierplan.runtime.transfer import Link

HOST_LANDING = {Link.D2H, Link.DISK2H}  # links whose bytes land in host memory


def test_every_tier_pair_has_one_chained_hop_plan() -> None:
    assert sorted(f"{a.value}->{b.value}" for a, b in HOP_PLANS) == sorted(PAIRS)
    for (src, dst), hops in HOP_PLANS.items():
        assert hops[0].src is End.SRC and hops[-1].dst is End.DST
        assert all(a.dst is b.src is End.STAGE for a, b in pairwise(hops))
        assert all(h.lands_on_host == (h.link in HOST_LANDING) for h in hops), (src, dst)
        assert any(h.after for h in hops) == (Tier.GPU in (src, dst))  # GPU copies wait for the caller's kernels
