"""KV block tiers (inference process): GPU HBM, pinned host memory and an NVMe file.

`KVBlockManager` keeps the books (where each block sits, refcounts, checksums, the one move in flight);
`KVTierStores` owns the bytes; `KVTransferHandler` moves bytes between tiers through the transfer engine.
Mechanism only: nothing here decides which block goes where.
"""

from tierplan.runtime.kv.handler import KVMoveFuture, KVTransferHandler
from tierplan.runtime.kv.manager import KVBlockManager
from tierplan.runtime.kv.spec import KVBlockSpec, KVMove, Tier
from tierplan.runtime.kv.stores import KVTierStores

__all__ = [
    "KVBlockManager",
    "KVBlockSpec",
    "KVMove",
    "KVMoveFuture",
    "KVTierStores",
    "KVTransferHandler",
    "Tier",
]
