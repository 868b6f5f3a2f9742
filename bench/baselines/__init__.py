"""The phase diagram's baselines: one policy per module, all on the reference engine through the agent's enforcer.

Bench driver code. `BASELINES` is the report order; `make(name)` builds one (ValueError naming the known ones
for an unknown name); `oracle_splits(ctx)` lists the splits the runner tries for the oracle. Modules are
imported when a baseline is made, never at import time.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierplan.bench.baselines.base import Baseline, PointContext, Split

BASELINES: tuple[str, ...] = ("resident", "static_lru", "static_lfru", "fluxmoe", "kv_tiering", "mv_wsa",
                              "tierplan", "oracle")
VARIANTS: tuple[str, ...] = ("tierplan_rs", "tierplan_kf")  # run only when named, never baselines in the report
POLICIES: tuple[str, ...] = BASELINES + VARIANTS
# name -> (module under bench.baselines, class)
_WHERE: dict[str, tuple[str, str]] = {
    "resident": ("static", "Resident"), "static_lru": ("static", "StaticLRU"), "static_lfru": ("lfru", "StaticLFRU"),
    "fluxmoe": ("fluxmoe", "FluxMoE"), "kv_tiering": ("kv_tiering", "KVTiering"), "mv_wsa": ("mv_wsa", "MarginalWSA"),
    "tierplan": ("tierplan_live", "TierplanLive"), "oracle": ("oracle", "Oracle"),
    "tierplan_rs": ("tierplan_live", "TierplanResidentStart"), "tierplan_kf": ("tierplan_live", "TierplanKVFirst"),
}


def make(name: str) -> Baseline:
    """A fresh baseline by its row name; ValueError naming the known ones otherwise."""
    if name not in _WHERE:
        raise ValueError(f"unknown baseline {name!r}: expected one of {', '.join(POLICIES)}")
    module, cls = _WHERE[name]
    return getattr(importlib.import_module(f"tierplan.bench.baselines.{module}"), cls)()


def oracle_splits(ctx: PointContext, max_splits: int = 5) -> list[Split]:
    """The oracle's candidate static splits for this point (at most `max_splits`), see oracle.py."""
    from tierplan.bench.baselines.oracle import candidate_splits

    return candidate_splits(ctx, max_splits)
