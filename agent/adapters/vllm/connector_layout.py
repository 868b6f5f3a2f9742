"""The shape of the vLLM KV connector's stored blocks and the worker side's counters (vLLM worker process).

`KvLayout` says where each attention layer's part of one vLLM block sits in a stored block (the layers' bytes end
to end, padded to the 4 KiB our tiers need); `WorkerStats` counts what `KvTierWorker` did. Plain values: never
touches bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tierplan.agent.adapters.vllm.connector_catalog import STORE_TIERS
from tierplan.runtime.nvme import DIRECT_ALIGN_BYTES, align_up


@dataclass(frozen=True)
class KvLayout:
    """Where each attention layer's part of one vLLM block sits in a stored block."""

    layer_names: tuple[str, ...]
    bytes_per_layer: tuple[int, ...]
    block_bytes: int  # the layers' bytes end to end, rounded up to DIRECT_ALIGN_BYTES
    device_type: str

    @staticmethod
    def of(kv_caches: dict[str, torch.Tensor]) -> KvLayout:
        """The layout of vLLM's registered caches: per layer a tensor whose first axis is the block."""
        if not kv_caches:
            raise ValueError("TierplanConnector: vLLM registered no KV cache tensors; expected one per attention layer")
        names = tuple(sorted(kv_caches))
        sizes, devices, num_blocks = [], set(), set()
        for name in names:
            kv = kv_caches[name]
            if not isinstance(kv, torch.Tensor) or kv.dim() < 2 or not kv[0].is_contiguous():
                raise ValueError(f"TierplanConnector: KV cache of layer {name!r} is not a tensor with one contiguous "
                                 "block per index of its first axis; this KV layout is not supported")
            sizes.append(kv[0].numel() * kv.element_size())
            devices.add(kv.device.type)
            num_blocks.add(kv.shape[0])
        if len(devices) != 1 or len(num_blocks) != 1:
            raise ValueError(f"TierplanConnector: KV caches span devices {sorted(devices)} and block counts "
                             f"{sorted(num_blocks)}; expected one device and one block count (one KV cache group)")
        return KvLayout(names, tuple(sizes), align_up(sum(sizes), DIRECT_ALIGN_BYTES), devices.pop())


@dataclass
class WorkerStats:
    stores_per_tier: dict[str, int] = field(default_factory=lambda: {t.value: 0 for t in STORE_TIERS})
    loads_per_tier: dict[str, int] = field(default_factory=lambda: {t.value: 0 for t in STORE_TIERS})
    moves: int = 0
    drops: int = 0
    failed_stores: int = 0
    failed_moves: int = 0
    failed_loads: int = 0  # every failed load (missing, corrupt, I/O error): vLLM computed the block again
    corrupt_loads: int = 0  # of those, a checksum mismatch
    poisoned_stores: int = 0  # stores skipped: made while a failed load was not yet acknowledged
    overwrites: int = 0  # stores of a key already held (books that lost track of it): the new bytes replaced it
    spill_waits: int = 0  # stores that had to wait for spills to free room on their tier (no buffer left)
    deferred_stores: int = 0  # stores held in a host buffer until the spill freeing their room was done
    limit_violations: int = 0  # a footprint past the installed limits after an op (the books should make it 0)
    peak_blocks_per_tier: dict[str, int] = field(default_factory=lambda: {t.value: 0 for t in STORE_TIERS})
    footprint_checks: int = 0
    nvme_fallback_reason: str | None = None
