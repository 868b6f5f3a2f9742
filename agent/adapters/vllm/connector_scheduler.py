"""The scheduler side of the vLLM KV connector: prefix hits from our tiers and what to store each step (vLLM
scheduler process).

Reads vLLM's request and scheduler-output objects by their attributes (it imports nothing of vLLM, so it is tested
without it): a request's `block_hashes` name its full blocks by prefix, `get_num_new_matched_tokens` answers how
many tokens past vLLM's own prefix-cache hit our tiers hold (whole blocks, the leading run, never the prompt's last
token), `update_state_after_alloc` turns a hit into loads, and `build_step` turns every block a step completes into
the catalog's store decisions, under the limits the plan's source gives at that step (its defaults while no plan
is applied; the last plan's if the source goes away, and, counted, if it fails). Never touches bytes; never waits
on the network.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tierplan.agent.adapters.vllm.connector_catalog import STORE_TIERS, KvCatalog, OpKind, TierOp
from tierplan.agent.adapters.vllm.connector_config import ConnectorSettings
from tierplan.agent.adapters.vllm.connector_meta import BlockLoad, WorkerReport, WorkerStep
from tierplan.agent.adapters.vllm.kv_limits import (
    TIER_NAMES,
    KvLimits,
    KvLimitsSource,
    ReuseEvent,
    current_source,
    prefix_hash,
)
from tierplan.runtime.kv.spec import Tier


@dataclass
class _Lookup:
    start_block: int  # blocks vLLM's own prefix cache already holds
    max_blocks: int  # the most blocks a hit may cover (the prompt's last token is always computed)
    tiers: list[Tier]  # tiers of our leading run of hits past start_block


@dataclass
class _ReqState:
    request: Any
    keys: list[str] = field(default_factory=list)  # prefix hashes of request.block_hashes, as far as computed
    next_store: int = 0  # first block index not yet offered to the catalog

    def key_list(self) -> list[str]:
        hashes = self.request.block_hashes
        if len(self.keys) < len(hashes):
            self.keys.extend(prefix_hash(h) for h in hashes[len(self.keys):])
        return self.keys


@dataclass
class SchedulerStats:
    lookups: int = 0
    hit_blocks_per_tier: dict[str, int] = field(default_factory=lambda: {t.value: 0 for t in STORE_TIERS})
    local_hit_blocks: int = 0
    recomputed_blocks: int = 0
    source_errors: int = 0  # the limits source raised: the last good limits stayed in force
    last_source_error: str | None = None
    plan_version: int = 0
    steps: int = 0
    failed_keys: int = 0  # blocks the worker could not store/move/load (dropped from the books)
    failed_loads: int = 0
    resets: int = 0


def _empty_counts() -> dict[str, int]:
    return dict.fromkeys(TIER_NAMES, 0)


class ConnectorBooks:
    """The connector's scheduler-side state; `connector.py` forwards vLLM's calls here."""

    def __init__(self, settings: ConnectorSettings, block_size: int,
                 source: Callable[[], KvLimitsSource | None] = current_source,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"ConnectorBooks: block_size must be an int >= 1, got {block_size!r}")
        self.settings = settings
        self.block_size = block_size
        self.catalog = KvCatalog({Tier.CPU: settings.cpu_blocks, Tier.NVME: settings.nvme_blocks}, clock)
        self.stats = SchedulerStats()
        self._source = source
        self._limits: KvLimits | None = None  # the limits in force (None: the settings' defaults)
        self._reqs: dict[str, _ReqState] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._loads: list[BlockLoad] = []
        self._load_tiers: dict[str, list[Tier]] = {}  # this step's hits per request, for vLLM's hit sources
        self._hits, self._misses = _empty_counts(), _empty_counts()
        self._reuse: list[ReuseEvent] = []  # this step's prefix hits, for a source that takes them
        self._failures: dict[str, int] = {}  # failures since the last report (workers' and the source's own)
        self._pending_ops: list[TierOp] = []  # decided between steps (a reset), carried out with the next one
        self._acked_epoch = 0  # the highest worker failure epoch whose report was processed (echoed every step)
        self.kv_cache_manager: Any = None  # vLLM's KVCacheManager, bound by vLLM

    # ---- requests -----------------------------------------------------------------------------------
    def _state(self, request: Any) -> _ReqState:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _ReqState(request)
        return st

    def new_request(self, request: Any) -> None:
        self._state(request)

    def finished(self, request: Any) -> None:
        self._reqs.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)

    # ---- hits ---------------------------------------------------------------------------------------
    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens past `num_computed_tokens` (block-aligned, vLLM's own hit) that our tiers can load."""
        keys = self._state(request).key_list()
        start = num_computed_tokens // self.block_size
        max_blocks = min(len(keys), (request.num_tokens - 1) // self.block_size)
        tiers = self.catalog.lookup(keys[start:max_blocks]) if start < max_blocks else []
        self._lookups[request.request_id] = _Lookup(start, max(max_blocks, start), tiers)
        self.stats.lookups += 1
        return len(tiers) * self.block_size

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks: plan the loads of its hit and count the lookup."""
        look = self._lookups.pop(request.request_id, None)
        if look is None:
            return
        n = num_external_tokens // self.block_size
        if num_external_tokens % self.block_size or n > len(look.tiers):
            raise ValueError(f"TierplanConnector: vLLM asked to load {num_external_tokens} tokens of request "
                             f"{request.request_id}; the connector offered {len(look.tiers) * self.block_size} "
                             f"in blocks of {self.block_size}")
        keys = self._state(request).key_list()
        hit_keys = keys[look.start_block:look.start_block + n]
        for j, key in enumerate(hit_keys):
            index = look.start_block + j
            self._loads.append(BlockLoad(key, block_ids[index], request.request_id, index))
        for key, age_s, tier in self.catalog.touch(hit_keys):
            self._reuse.append((key, age_s, tier.value))
        tiers = look.tiers[:n]
        self._load_tiers[request.request_id] = tiers
        self._hits["gpu"] += look.start_block
        self.stats.local_hit_blocks += look.start_block
        for tier in tiers:
            self._misses[tier.value] += 1  # a GPU miss served by this tier (the agent's convention)
            self.stats.hit_blocks_per_tier[tier.value] += 1
        recomputed = max(0, look.max_blocks - look.start_block - n)
        self._misses["gpu"] += recomputed
        self.stats.recomputed_blocks += recomputed

    def hit_tiers(self, request_id: str) -> list[Tier]:
        """The tiers this step's load for `request_id` reads, block by block."""
        return list(self._load_tiers.get(request_id, ()))

    # ---- one step -----------------------------------------------------------------------------------
    def _refresh_limits(self) -> list[TierOp]:
        src = self._source()
        limits = self._limits
        if src is not None:
            try:
                got = src.kv_limits()
                if got is not None and not isinstance(got, KvLimits):
                    raise TypeError(f"kv_limits() returned {type(got).__name__}, expected KvLimits or None")
                limits = got
            except Exception as exc:  # fail-static: keep the limits in force, count it, never break vLLM's step
                self._source_error(exc)
        if limits is None or limits.plan_version == 0:
            cpu, nvme = self.settings.cpu_blocks, self.settings.nvme_blocks
            retention = limits.retention if limits is not None else ()
        else:
            cpu, nvme, retention = limits.cpu_blocks, limits.nvme_blocks, limits.retention
        self._limits = limits
        self.stats.plan_version = 0 if limits is None else limits.plan_version
        return self.catalog.set_limits(cpu, nvme, retention)

    def build_step(self, scheduler_output: Any) -> WorkerStep:
        """This step's loads (planned at admission) and store decisions for the blocks it completes."""
        self.stats.steps += 1
        ops, self._pending_ops = self._pending_ops, []
        ops += self._refresh_limits()
        store_blocks: dict[str, int] = {}
        req_blocks: dict[str, tuple[int, ...]] = {}
        spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
        scheduled = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        scheduled += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, num_computed in scheduled:
            st = self._reqs.get(req_id)
            if st is None:
                continue
            # Draft tokens may be rejected: only tokens that stay count towards a full block.
            done = num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0) - len(spec.get(req_id, ()))
            keys = st.key_list()
            full = min(done // self.block_size, len(keys))
            if full <= st.next_store:
                continue
            block_ids = self._block_ids(req_id)
            end = min(full, len(block_ids))
            for j in range(st.next_store, end):
                for op in self.catalog.admit(keys[j]):
                    if op.kind is OpKind.STORE and op.key == keys[j]:
                        store_blocks[op.key] = block_ids[j]
                    ops.append(op)
            if self._loads and end > st.next_store:  # a sharer of a block whose load fails is stored again from it
                req_blocks[req_id] = tuple(block_ids[:end])
            st.next_store = full
        limits = self.catalog.limits
        step = WorkerStep(limits[Tier.CPU], limits[Tier.NVME], tuple(self._loads), tuple(ops), store_blocks,
                          req_blocks, seq=self.stats.steps, ack_epoch=self._acked_epoch)
        self._loads, self._load_tiers = [], {}
        self._report()
        return step

    def _block_ids(self, req_id: str) -> list[int]:
        if self.kv_cache_manager is None:
            return []
        return list(self.kv_cache_manager.get_block_ids(req_id)[0])

    def _report(self) -> None:
        src = self._source()
        if src is None:  # nobody to tell: this step's counts go (the next source hears of its own steps only)
            self._hits, self._misses, self._reuse, self._failures = _empty_counts(), _empty_counts(), [], {}
            return
        blocks = _empty_counts()
        for tier, n in self.catalog.footprint().items():
            blocks[tier.value] = n
        pool = getattr(self.kv_cache_manager, "block_pool", None)
        if pool is not None:
            blocks["gpu"] = pool.num_gpu_blocks - pool.get_num_free_blocks()
        hits, misses, reuse = self._hits, self._misses, self._reuse
        failures = {k: n for k, n in self._failures.items() if n}
        self._hits, self._misses, self._reuse, self._failures = _empty_counts(), _empty_counts(), [], {}
        try:
            src.report_kv(hits, misses, blocks)
            report_reuse = getattr(src, "report_reuse", None)
            if reuse and report_reuse is not None:
                report_reuse(reuse)
            report_failures = getattr(src, "report_failures", None)
            if failures and report_failures is not None:
                report_failures(failures)
        except Exception as exc:  # the report is lost (counted); serving goes on
            self._source_error(exc)

    def _source_error(self, exc: Exception) -> None:
        self.stats.source_errors += 1
        self.stats.last_source_error = f"{type(exc).__name__}: {exc}"
        self._failures["source_errors"] = self._failures.get("source_errors", 0) + 1

    def reset(self) -> None:
        """vLLM reset its prefix cache and asked the connector to do the same: no hit is served from here on; the
        worker frees the blocks with the next step."""
        self._pending_ops += self.catalog.clear()
        self.stats.resets += 1

    def on_worker_report(self, report: WorkerReport) -> None:
        """Keys a worker does not hold leave the books, and every worker drops them with the next step (with
        several workers, or a late report, another may hold them); a request whose load failed is offered for
        storing again from the failed block on, once vLLM has computed it anew, and the report's failure epoch is
        acknowledged to the workers (their stores pause until then). The failures are counted and told
        to the source with the next step."""
        for key in sorted(report.failed_keys):
            tier = self.catalog.forget(key)
            self._pending_ops.append(TierOp(OpKind.DROP, key, tier or Tier.CPU))
        for req_id, index in report.failed_from.items():
            st = self._reqs.get(req_id)
            if st is not None:
                st.next_store = min(st.next_store, index)
        # Its keys forgotten and requests rewound: the workers may store again from the next step on.
        self._acked_epoch = max(self._acked_epoch, report.epoch)
        for name, n in report.counts.items():
            self._failures[name] = self._failures.get(name, 0) + n
        self.stats.failed_keys += len(report.failed_keys)
        self.stats.failed_loads += len(report.failed_load_block_ids)
