"""The bytes of the KV tiers (inference process): a GPU block array, a pinned host array and an NVMe file.

Each tier is `capacity` blocks of `block_bytes`, addressed by `KVBlockSpec(tier, index)`. Blocks are 4 KiB
multiples so that every host block is page-aligned (async copies, O_DIRECT) and every file block sits at an
aligned offset. A tier with capacity 0 is absent. Owns memory only: never keeps books, never moves bytes.
"""

from __future__ import annotations

import os

import torch

from tierplan.runtime.device import AlignedHostBuffer, Device
from tierplan.runtime.errors import AlignmentError, ConfigError
from tierplan.runtime.kv.spec import KVBlockSpec, Tier
from tierplan.runtime.nvme import DIRECT_ALIGN_BYTES, DirectFile, FileRegion


class KVTierStores:
    """Memory of the three KV tiers: `memory(spec)` for GPU/CPU blocks, `region(spec)` for NVMe blocks."""

    def __init__(
        self,
        device: Device,
        block_bytes: int,
        capacity: dict[Tier, int],
        nvme_path: str | os.PathLike[str] | None = None,
        direct_io: bool = True,
        gpu_scratch_blocks: int = 0,
    ) -> None:
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int):
            raise ConfigError(f"KVTierStores: block_bytes must be an int, got {block_bytes!r}")
        if block_bytes <= 0 or block_bytes % DIRECT_ALIGN_BYTES:
            raise AlignmentError(
                f"KVTierStores: block_bytes must be a positive multiple of {DIRECT_ALIGN_BYTES}, got {block_bytes}"
            )
        caps = dict.fromkeys(Tier, 0)
        for tier, n in capacity.items():
            if not isinstance(tier, Tier) or isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ConfigError(f"KVTierStores: capacity entry {tier!r}: {n!r}; expected Tier -> int >= 0")
            caps[tier] = n
        if caps[Tier.NVME] > 0 and nvme_path is None:
            raise ConfigError(f"KVTierStores: NVMe tier has capacity {caps[Tier.NVME]} but nvme_path is None")
        self.device = device
        self.block_bytes = block_bytes
        self.capacity = caps
        self._gpu: torch.Tensor | None = None  # [G, B] on the device
        self._host: AlignedHostBuffer | None = None
        self._cpu: torch.Tensor | None = None  # [C, B] pinned host
        self.nvme_file: DirectFile | None = None
        if gpu_scratch_blocks < 0 or (gpu_scratch_blocks and not caps[Tier.GPU]):
            raise ConfigError(f"KVTierStores: gpu_scratch_blocks={gpu_scratch_blocks} needs a GPU tier and >= 0")
        if caps[Tier.GPU]:
            rows = caps[Tier.GPU] + gpu_scratch_blocks  # scratch rows sit past the capacity: never a block's home
            self._gpu = device.alloc(rows * block_bytes).view(rows, block_bytes)
        if caps[Tier.CPU]:
            self._host = device.alloc_host(caps[Tier.CPU] * block_bytes)
            self._cpu = self._host.tensor.view(caps[Tier.CPU], block_bytes)
        if caps[Tier.NVME] and nvme_path is not None:
            try:
                self.nvme_file = DirectFile(nvme_path, caps[Tier.NVME] * block_bytes, direct=direct_io)
            except BaseException:
                self.close()
                raise

    def _check(self, spec: KVBlockSpec, what: str) -> None:
        if not isinstance(spec, KVBlockSpec):
            raise ConfigError(f"{what}: expected a KVBlockSpec, got {spec!r}")
        cap = self.capacity[spec.tier]
        if cap == 0:
            raise ConfigError(f"{what}({spec}): tier {spec.tier.value} is absent (capacity 0)")
        if not 0 <= spec.index < cap:
            raise ConfigError(f"{what}({spec}): index outside [0, {cap}) of tier {spec.tier.value}")

    @property
    def gpu_tensor(self) -> torch.Tensor:
        """The whole GPU tier [capacity + gpu_scratch_blocks, block_bytes] uint8 (kernels view it with their own
        layout). Scratch rows follow the capacity: no block ever lives there, moves never touch them."""
        if self._gpu is None:
            raise ConfigError("this KVTierStores has no GPU tier (capacity 0)")
        return self._gpu

    def tier_tensor(self, tier: Tier) -> torch.Tensor:
        """The GPU or CPU tier's blocks [capacity, block_bytes] uint8 (the GPU tier without its scratch rows): the
        buffer one request addresses a list of blocks in, by byte offset."""
        if tier is Tier.GPU and self._gpu is not None:
            return self._gpu[: self.capacity[Tier.GPU]]
        if tier is Tier.CPU and self._cpu is not None:
            return self._cpu
        raise ConfigError(f"tier_tensor({tier.value}): absent, or the NVMe tier (no memory view; use region())")

    def memory(self, spec: KVBlockSpec) -> torch.Tensor:
        """The block's bytes as a contiguous [block_bytes] uint8 view (GPU tier: device, CPU tier: host)."""
        self._check(spec, "memory")
        if spec.tier is Tier.GPU and self._gpu is not None:
            return self._gpu[spec.index]  # [B]
        if spec.tier is Tier.CPU and self._cpu is not None:
            return self._cpu[spec.index]  # [B]
        raise ConfigError(f"memory({spec}): the NVMe tier has no memory view; use region()")

    def region(self, spec: KVBlockSpec) -> FileRegion:
        """The block's place in the NVMe file."""
        self._check(spec, "region")
        if spec.tier is not Tier.NVME or self.nvme_file is None:
            raise ConfigError(f"region({spec}): only NVMe blocks have a file region; use memory()")
        return self.nvme_file.region(spec.index * self.block_bytes, self.block_bytes)

    def close(self) -> None:
        """Unpin host memory and close the file; the caller has finished every transfer first."""
        if self._host is not None:
            self._host.close()
        if self.nvme_file is not None:
            self.nvme_file.close()

    def __enter__(self) -> KVTierStores:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
