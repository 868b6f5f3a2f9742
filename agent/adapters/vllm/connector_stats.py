"""The KV connector's counters in vLLM's own stats stream (vLLM scheduler and worker processes).

vLLM asks each side for `get_kv_connector_stats()` every step, merges them (`aggregate`) and hands the dict to its
stat loggers (`SchedulerStats.kv_connector_stats`; `vllm.stat_logger_plugins` loggers see it too), which rebuild
it through `TierplanConnector.build_kv_connector_stats`. Counts are since the previous step, keyed by name;
`reduce` sums an interval. Plain ints only: the dict crosses processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass
class TierplanConnectorStats(KVConnectorStats):
    """Counter deltas of one or more steps: `{"stores_cpu": 3, "loads_nvme": 1, ...}`."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        out = dict(self.data)
        for key, value in (other.data or {}).items():
            out[key] = out.get(key, 0) + value
        return TierplanConnectorStats(data=out)

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class CounterDeltas:
    """Turns cumulative counters into per-call deltas (zero deltas left out)."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def take(self, totals: dict[str, int]) -> TierplanConnectorStats | None:
        delta = {k: v - self._last.get(k, 0) for k, v in totals.items() if v != self._last.get(k, 0)}
        self._last = dict(totals)
        return TierplanConnectorStats(data=delta) if delta else None


def flatten(prefix: str, counts: dict[str, Any]) -> dict[str, int]:
    """{"cpu": 2, "nvme": 1} under "loads" -> {"loads_cpu": 2, "loads_nvme": 1}."""
    return {f"{prefix}_{k}": int(v) for k, v in counts.items()}
