"""What the plan lets the vLLM KV connector hold, and where the connector reports back (vLLM scheduler process).

The connector (`connector.py`) is built by vLLM itself, so it cannot be handed its plan through a constructor: the
plugin's link registers a `KvLimitsSource` here with `set_source`, once per process, and the connector asks
`current_source()` at every engine step. This one slot is the only process-level state of the adapter; it holds a
reference, does no work at import time and never talks to the network.

Prefix hashes (`KvLimits.retention`, and the keys the connector stores under) are `prefix_hash(block_hash)`: the
lower-case hex of vLLM's chained block hash, so equal hashes mean the same tokens at the same prefix position.

`report_kv` counts follow our engine's agent (agent/adapters/reference.py): per block of a prompt the scheduler
admits, `hits_per_tier["gpu"]` counts blocks vLLM found in its own prefix cache, `misses_per_tier["cpu"|"nvme"]`
counts blocks the connector loaded back from that tier (a GPU miss served there) and `misses_per_tier["gpu"]`
blocks found nowhere (computed again). One call per engine step, with that step's counts; `blocks_per_tier` is the
footprint now ("gpu": vLLM's blocks in use, "cpu"/"nvme": the connector's). Tier names are controller.protocol's
`Tier` values.
A source that also has `report_reuse(events)` gets, at the same call, each prefix hit of the step as
(prefix hash, seconds since that block was last stored or hit, tier it was found on): the `ReuseEvent`s the KV
reuse predictor learns from. It is optional, so a source with the two methods above stays valid.
So is `report_failures(counts)`: at the same call, a step's failures by name, only when there are any (each
call carries the failures since the previous one, never a total): `failed_loads` (blocks vLLM computed again;
`corrupt_loads` of them failed their checksum), `failed_stores`, `failed_moves`, `poisoned_stores` (blocks
computed over a failed load, never kept), `source_errors` (this source raised). Each is a fallback to count.
Two engines in one process each register their own source; `clear_source(src)` at shutdown clears the slot only if
it still holds `src`, so one engine going away never unregisters the other's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from tierplan.controller.protocol import Tier

TIER_NAMES = tuple(t.value for t in Tier)  # the protocol's tier names: the keys of every per-tier count


def prefix_hash(block_hash: bytes) -> str:
    """The prefix hash of one vLLM block hash (its hex): the key of a stored block and of `retention`."""
    return bytes(block_hash).hex()


ReuseEvent = tuple[str, float, str]  # prefix hash, age in seconds, tier name


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"KvLimits.{name}: expected an int >= 0, got {value!r}")


@dataclass(frozen=True)
class KvLimits:
    """The KV blocks per tier the connector may hold, from the applied plan (`plan_version` 0: none applied yet,
    the connector then uses its configured defaults), and the prefix hashes to keep first, most important first."""

    plan_version: int
    cpu_blocks: int
    nvme_blocks: int
    retention: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("plan_version", "cpu_blocks", "nvme_blocks"):
            _check_count(name, getattr(self, name))
        if not isinstance(self.retention, tuple):
            got = type(self.retention).__name__
            raise ValueError(f"KvLimits.retention: expected a tuple of prefix hashes, got {got}")
        bad = [h for h in self.retention if not isinstance(h, str) or not h]
        if bad:
            raise ValueError(f"KvLimits.retention: prefix hashes must be non-empty str, got {bad[:3]!r}")
        if len(set(self.retention)) != len(self.retention):
            seen: set[str] = set()
            dup = next(h for h in self.retention if h in seen or seen.add(h))
            raise ValueError(f"KvLimits.retention: prefix hash {dup!r} is listed twice (a keep-first order)")


@runtime_checkable
class KvLimitsSource(Protocol):
    """Implemented by the plugin's link (agent/adapters/vllm/link.py); called from vLLM's scheduler loop, so both
    methods must return at once (no network on this path)."""

    def kv_limits(self) -> KvLimits | None: ...

    def report_kv(self, hits_per_tier: dict[str, int], misses_per_tier: dict[str, int],
                  blocks_per_tier: dict[str, int]) -> None: ...


class _SourceSlot:
    """Holds the process's source; a class rather than a bare global so tests can see what is held."""

    def __init__(self) -> None:
        self.source: KvLimitsSource | None = None


_SLOT = _SourceSlot()


def set_source(src: KvLimitsSource | None) -> None:
    """Register the process's source (None unregisters it); a later call replaces the earlier one."""
    if src is not None and not isinstance(src, KvLimitsSource):
        raise TypeError(f"set_source: {type(src).__name__} has no kv_limits()/report_kv(); expected a KvLimitsSource")
    _SLOT.source = src


def clear_source(src: KvLimitsSource) -> bool:
    """Unregister `src` if it is the registered source (True); another engine's source stays (False)."""
    if _SLOT.source is src:
        _SLOT.source = None
        return True
    return False


def current_source() -> KvLimitsSource | None:
    """The registered source, or None (then the connector runs on its configured defaults)."""
    return _SLOT.source
