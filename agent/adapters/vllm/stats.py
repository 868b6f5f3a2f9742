"""The `vllm.stat_logger_plugins` logger: forwards vLLM's own scheduler and prefix-cache stats to the rank's
tierplan agent (API server process; vLLM loads stat logger plugins there, in async serving).

`TierplanStatLogger.record` turns each `SchedulerStats` into an `EngineStats` datagram (prefix-cache hits
and misses since the last one, in blocks; GPU KV blocks in use from `kv_cache_usage`; running and waiting
requests) and sends it without blocking to the agent's stats socket; the agent folds them into its windows
as the GPU tier's KV numbers where no connector reports them. A datagram that cannot go (no agent yet, a
full buffer) is dropped and counted in `dropped` by errno name; nothing is retried, nothing waits.
It never changes what vLLM logs or serves.
"""

from __future__ import annotations

import errno
import os
from collections import Counter
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from tierplan.agent.adapters.vllm.settings import VllmPluginSettings
from tierplan.agent.adapters.vllm.stats_inbox import send_stats, stats_socket
from tierplan.agent.sidecar import default_socket_path
from tierplan.controller.protocol_service import EngineStats


class TierplanStatLogger(StatLoggerBase):
    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        from tierplan.agent.adapters.vllm.plugin import refuse
        from tierplan.agent.adapters.vllm.settings import SettingsError

        try:
            settings = VllmPluginSettings.from_env(os.environ)
        except SettingsError as exc:  # the same one line as register()'s, no traceback of ours
            raise refuse(exc) from None
        self.enabled = settings.enabled
        self.vllm_config, self.engine_index = vllm_config, engine_index
        dp_size = int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1)
        try:
            settings = settings.for_engine(engine_index, dp_size, default_socket_path(settings.agent_id))
        except SettingsError as exc:
            raise refuse(exc) from None
        self.path = settings.stats_socket_path(settings.socket_path(default_socket_path(settings.agent_id)))
        self.block_tokens = max(1, int(vllm_config.cache_config.block_size))
        self.sent = 0
        self.dropped: Counter[str] = Counter()
        self._sock = stats_socket()

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if not self.enabled or scheduler_stats is None:
            return
        p = scheduler_stats.prefix_cache_stats
        hits, queries = int(p.hits), int(p.queries)
        total_blocks = int(self.vllm_config.cache_config.num_gpu_blocks or 0)
        st = EngineStats(engine_index=engine_idx, gpu_hit_blocks=hits // self.block_tokens,
                         gpu_miss_blocks=max(0, queries - hits) // self.block_tokens,
                         gpu_blocks=round(float(scheduler_stats.kv_cache_usage) * total_blocks),
                         num_running_reqs=int(scheduler_stats.num_running_reqs),
                         num_waiting_reqs=int(scheduler_stats.num_waiting_reqs))
        try:
            send_stats(self._sock, self.path, st)
            self.sent += 1
        except OSError as exc:
            self.dropped[errno.errorcode.get(exc.errno or 0, "OSError")] += 1

    def log_engine_initialized(self) -> None:
        pass
