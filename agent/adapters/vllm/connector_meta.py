"""What the vLLM KV connector's scheduler side tells its worker side each engine step, and what comes back
(vLLM scheduler and worker processes).

Plain, picklable values: vLLM carries them between processes inside its own metadata objects
(`connector.py` wraps them). Never holds tensors or runtime objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierplan.agent.adapters.vllm.connector_catalog import TierOp


@dataclass(frozen=True)
class BlockLoad:
    """Copy the stored block `key` into vLLM's KV block `block_id` before this step's forward; it is block
    `index` of request `req_id` (a failed load sends that request's storing back to `index`)."""

    key: str
    block_id: int
    req_id: str = ""
    index: int = 0


@dataclass(frozen=True)
class WorkerStep:
    """One engine step's work: `loads` before the forward; after it, the plan's limits (blocks per tier) are
    installed and `ops` carried out in order (each STORE copies vLLM's block `store_blocks[key]`). `seq` numbers
    the step (from 1); `ack_epoch` is the highest failure epoch of a worker report the scheduler had processed
    (forgotten its keys, rewound its requests) when it built the step: a worker whose own epoch is higher skips
    every store (blocks computed over a failed load may be among them). `req_blocks` (only in a step with loads)
    lists, per request that stores, its vLLM block ids up to its last store: a request sharing a block whose load
    failed is sent back to that block too."""

    cpu_blocks: int
    nvme_blocks: int
    loads: tuple[BlockLoad, ...] = ()
    ops: tuple[TierOp, ...] = ()
    store_blocks: dict[str, int] = field(default_factory=dict)
    req_blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    seq: int = 0
    ack_epoch: int = 0

    def is_empty(self) -> bool:
        return not self.loads and not self.ops


@dataclass
class WorkerReport:
    """What the worker could not carry out (the books forget these keys and every worker drops them), its loads
    that failed (vLLM's block ids) and, per request, the first block index a failed load poisoned (the books
    offer that request's blocks from there again once vLLM has computed them anew). `epoch` (in a report with a
    failed load) is the worker's failure epoch then: the scheduler echoes it as `WorkerStep.ack_epoch`."""

    failed_keys: set[str] = field(default_factory=set)
    failed_load_block_ids: set[int] = field(default_factory=set)
    failed_from: dict[str, int] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)  # this step's failures by name (failed_loads, ...)
    epoch: int = 0

    def merge(self, other: WorkerReport) -> WorkerReport:
        failed_from = dict(self.failed_from)
        for req_id, index in other.failed_from.items():
            failed_from[req_id] = min(index, failed_from.get(req_id, index))
        counts = dict(self.counts)
        for name, n in other.counts.items():
            counts[name] = counts.get(name, 0) + n
        return WorkerReport(self.failed_keys | other.failed_keys,
                            self.failed_load_block_ids | other.failed_load_block_ids, failed_from, counts,
                            max(self.epoch, other.epoch))

    def is_empty(self) -> bool:
        return not (self.failed_keys or self.failed_load_block_ids or self.failed_from or any(self.counts.values())
                    or self.epoch)
