"""What a reference engine will allocate, checked against what the machine has, before anything is allocated.

Runs in the inference process when an engine is built. Counts the big allocations by where they land: device
memory (dense weights, the expert slot pool, GPU KV blocks), host memory (the pinned expert store, CPU KV
blocks; on the CPU twin the device is the host too) and disk (the NVMe expert store and KV file), and
refuses a configuration that cannot fit with one message naming each part, instead of an out-of-memory
error (or the OOM killer) halfway through building. Estimates, not promises: small buffers are left out.
Never allocates, never decides placement.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from tierplan.runtime.device import Device
from tierplan.runtime.engine.config import ModelSpec
from tierplan.runtime.engine.kv_cache import block_shape
from tierplan.runtime.engine.weights import _attn_shapes, expert_format
from tierplan.runtime.errors import ConfigError
from tierplan.runtime.weights.loader import StoreKind

if TYPE_CHECKING:
    from tierplan.runtime.engine.engine import EngineConfig

GIB = 1 << 30


def dense_weight_bytes(spec: ModelSpec) -> int:
    """Embeddings, LM head, attention, norms, routers, shared experts and dense MLPs (device-resident)."""
    h, moe = spec.hidden_size, set(spec.moe_layers)
    per_layer_attn = 2 * h + sum(math.prod(s) for s in _attn_shapes(spec).values())
    n = 2 * spec.vocab_size * h + h + spec.num_layers * per_layer_attn
    n += len(moe) * (spec.num_experts * h + 3 * spec.shared_intermediate * h)
    n += (spec.num_layers - len(moe)) * 3 * spec.dense_intermediate * h
    return n * spec.dtype_bytes


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), else free physical pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def check_fits(spec: ModelSpec, device: Device, cfg: EngineConfig) -> None:
    """ConfigError naming every part when the engine `cfg` builds would not fit device, host memory or disk."""
    fmt = expert_format(spec)
    n_moe, num_experts = len(spec.moe_layers), spec.num_experts
    all_experts = n_moe * num_experts * fmt.num_bytes
    num_slots = n_moe * num_experts if cfg.resident_frac >= 1.0 else max(
        1, math.ceil(cfg.resident_frac * n_moe * num_experts))
    block_bytes = math.prod(block_shape(spec, cfg.block_tokens)) * spec.dtype_bytes
    host = not cfg.experts_on_device
    dev_parts = {"dense weights": dense_weight_bytes(spec), "expert slots": num_slots * fmt.num_bytes,
                 "GPU KV blocks": (cfg.kv_gpu_blocks + 1) * block_bytes}
    host_parts = {"pinned expert store": all_experts if host and cfg.expert_store is StoreKind.PINNED else 0,
                  "CPU KV blocks": cfg.kv_cpu_blocks * block_bytes}
    disk_parts = {"NVMe expert store": all_experts if host and cfg.expert_store is StoreKind.NVME else 0,
                  "NVMe KV blocks": cfg.kv_nvme_blocks * block_bytes}
    if not device.is_cuda:  # the CPU twin's device memory is host memory
        host_parts, dev_parts = {**dev_parts, **host_parts}, {}
    folder = Path(cfg.workdir) if cfg.workdir is not None else Path(tempfile.gettempdir())
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    checks = [("host memory", host_parts, host_available_bytes(), "MemAvailable"),
              ("disk", disk_parts, shutil.disk_usage(folder).free, f"free under {folder}")]
    if dev_parts:
        import torch

        checks.append(("device memory", dev_parts, torch.cuda.mem_get_info(device.torch_device)[0], "free on the GPU"))
    for what, parts, have, how in checks:
        need = sum(parts.values())
        if need > have:
            items = ", ".join(f"{k} {_gib(v)}" for k, v in parts.items() if v)
            raise ConfigError(f"model {spec.name!r}: the engine needs {_gib(need)} of {what} ({items}) but "
                              f"{_gib(have)} is available ({how}); expected a configuration that fits: fewer layers "
                              f"(--layers), a smaller resident_frac, or the NVMe expert store")
