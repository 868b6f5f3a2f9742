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
    """Copy the stored block `key` into vLLM's KV block `block_id` before this step's forward."""

    key: str
    block_id: int


@dataclass(frozen=True)
class WorkerStep:
    """One engine step's work: `loads` before the forward; after it, the plan's limits (blocks per tier) are
    installed and `ops` carried out in order (each STORE copies vLLM's block `store_blocks[key]`)."""

    cpu_blocks: int
    nvme_blocks: int
    loads: tuple[BlockLoad, ...] = ()
    ops: tuple[TierOp, ...] = ()
    store_blocks: dict[str, int] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not self.loads and not self.ops


@dataclass
class WorkerReport:
    """What the worker could not carry out (the books drop these keys) and its loads that failed."""

    failed_keys: set[str] = field(default_factory=set)
    failed_load_block_ids: set[int] = field(default_factory=set)

    def merge(self, other: WorkerReport) -> WorkerReport:
        return WorkerReport(self.failed_keys | other.failed_keys,
                            self.failed_load_block_ids | other.failed_load_block_ids)
