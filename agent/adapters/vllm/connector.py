"""`TierplanConnector`: vLLM's KV connector API over our CPU and NVMe KV tiers (vLLM scheduler and worker
processes; vLLM builds one per role).

Enabled with `kv_transfer_config={"kv_connector": "TierplanConnector", "kv_connector_module_path":
"tierplan.agent.adapters.vllm.connector", "kv_role": "kv_both", "kv_connector_extra_config": {...}}` (keys:
`connector_config.py`). The scheduler side (`connector_scheduler.ConnectorBooks`) answers prefix hits and decides
what to store under the plan's limits; the worker side (`connector_worker.KvTierWorker`) moves the bytes through our
runtime, loading a step's hits before its forward and storing the blocks it completed after it (a load is done
before vLLM reads the block, a store before vLLM can free it; spills from our CPU tier to the NVMe file run in the
background and finish by the next step). Only models with one full-attention
KV cache group are supported; anything else is refused at start by name. A block that fails to load (its checksum,
say) is reported to vLLM, which computes it again: the connector needs `"kv_load_failure_policy": "recompute"` in
`kv_transfer_config` and refuses vLLM's default ("fail", which would fail the user's request) at start. Blocks
computed over a failed load are never kept. Failures are counted in vLLM's connector stats and told to the plan's
source (`kv_limits.report_failures`). `reset_prefix_cache(reset_connector=True)` empties our tiers
too. Never decides a plan; never waits on the network.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tierplan.agent.adapters.vllm.connector_config import ConnectorSettings, check_failure_policy
from tierplan.agent.adapters.vllm.connector_meta import WorkerReport, WorkerStep
from tierplan.agent.adapters.vllm.connector_scheduler import ConnectorBooks
from tierplan.agent.adapters.vllm.connector_stats import CounterDeltas, TierplanConnectorStats, flatten
from tierplan.agent.adapters.vllm.connector_worker import KvTierWorker
from tierplan.runtime.kv.spec import Tier

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig

HIT_SOURCE = {Tier.CPU: CacheHitSource.HOST, Tier.NVME: CacheHitSource.DISK}


class TierplanConnectorMetadata(KVConnectorMetadata):
    """One step's `WorkerStep`, carried by vLLM from the scheduler to the workers."""

    def __init__(self, step: WorkerStep) -> None:
        self.step = step


class TierplanWorkerMetadata(KVConnectorWorkerMetadata):
    """A worker's `WorkerReport`, carried back to the scheduler (vLLM merges the workers' with `aggregate`)."""

    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, TierplanWorkerMetadata):
            raise TypeError(f"TierplanWorkerMetadata.aggregate: got {type(other).__name__}")
        return TierplanWorkerMetadata(self.report.merge(other.report))


def _check_kv_cache_config(kv_cache_config: KVCacheConfig | None) -> None:
    if kv_cache_config is None:
        return
    groups = list(kv_cache_config.kv_cache_groups)
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    if len(groups) != 1 or kinds != ["FullAttentionSpec"]:
        raise ValueError(f"TierplanConnector supports one full-attention KV cache group; this model has {kinds}")


class TierplanConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None,
                 ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = ConnectorSettings.parse(self._kv_transfer_config.kv_connector_extra_config)
        check_failure_policy(getattr(self._kv_transfer_config, "kv_load_failure_policy", "fail"))
        _check_kv_cache_config(kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.books: ConnectorBooks | None = None
        self.worker: KvTierWorker | None = None
        self._pending = WorkerReport()  # this step's worker report, taken once vLLM asks for load errors
        self._deltas = CounterDeltas()
        if role is KVConnectorRole.SCHEDULER:
            self.books = ConnectorBooks(self.settings, self.block_size)
        else:
            rank = getattr(vllm_config.parallel_config, "rank", 0)
            path = self.settings.nvme_file(str(self._kv_transfer_config.engine_id), rank)
            self.worker = KvTierWorker({Tier.CPU: self.settings.cpu_blocks, Tier.NVME: self.settings.nvme_blocks},
                                       path, direct_io=self.settings.direct_io)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a store that does not happen is a later miss, never a lost hand-off

    # ---- worker side --------------------------------------------------------------------------------
    def _worker(self) -> KvTierWorker:
        if self.worker is None:
            raise RuntimeError("TierplanConnector: a worker-side call reached the scheduler-side connector")
        return self.worker

    def _step(self) -> WorkerStep | None:
        meta = self._connector_metadata
        return meta.step if isinstance(meta, TierplanConnectorMetadata) else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        step = self._step()
        if step is not None and step.loads:
            self._worker().load(step.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole and done in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # stores copy every layer at once in wait_for_save, once the forward has written them

    def wait_for_save(self) -> None:
        step = self._step()
        if step is not None:
            self._worker().apply(step)

    def get_block_ids_with_load_errors(self) -> set[int]:
        # vLLM asks this after the step's loads and saves, then build_connector_worker_meta: one report serves both.
        if self.worker is None:
            return set()
        self._pending = self._pending.merge(self.worker.take_report())
        return set(self._pending.failed_load_block_ids)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report, self._pending = self._pending, WorkerReport()
        if report.is_empty():
            return None
        return TierplanWorkerMetadata(report)

    def get_kv_connector_stats(self) -> TierplanConnectorStats | None:
        if self.worker is not None:
            w = self.worker.stats
            totals = {**flatten("stores", w.stores_per_tier), **flatten("loads", w.loads_per_tier), "moves": w.moves,
                      "drops": w.drops, "failed_stores": w.failed_stores, "failed_moves": w.failed_moves,
                      "failed_loads": w.failed_loads, "corrupt_loads": w.corrupt_loads,
                      "poisoned_stores": w.poisoned_stores, "overwrites": w.overwrites,
                      "spills_started": self.worker.spills.num_started,
                      "spills_waited": self.worker.spills.num_waited, "spill_waits": w.spill_waits,
                      "deferred_stores": w.deferred_stores,
                      "limit_violations": w.limit_violations}
        else:
            b = self._books()
            totals = {**flatten("hit_blocks", b.stats.hit_blocks_per_tier),
                      "local_hit_blocks": b.stats.local_hit_blocks, "recomputed_blocks": b.stats.recomputed_blocks,
                      "source_errors": b.stats.source_errors,
                      "not_kept": b.catalog.stats.not_kept, "limits_clamped": b.catalog.stats.limits_clamped}
        return self._deltas.take(totals)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TierplanConnectorStats | None:
        return TierplanConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()

    # ---- scheduler side -----------------------------------------------------------------------------
    def _books(self) -> ConnectorBooks:
        if self.books is None:
            raise RuntimeError("TierplanConnector: a scheduler-side call reached the worker-side connector")
        return self.books

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._books().kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: Any) -> None:
        self._books().new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._books().num_new_matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._books().after_alloc(request, list(blocks.get_block_ids()[0]), num_external_tokens)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[CacheHitSource, int]:
        tiers = self._books().hit_tiers(request.request_id)
        out: dict[CacheHitSource, int] = {}
        for tier in tiers:
            out[HIT_SOURCE[tier]] = out.get(HIT_SOURCE[tier], 0) + self.block_size
        return out

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return TierplanConnectorMetadata(self._books().build_step(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, TierplanWorkerMetadata):
            self._books().on_worker_report(meta.report)

    def reset_cache(self) -> bool:
        self._books().reset()
        return True

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._books().finished(request)
        return False, None
