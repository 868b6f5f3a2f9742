"""The `AgentRegistration` of a vLLM engine rank: its model shape and memory split, read from vLLM's config
and the loaded model (engine-core / worker process, once, at the first served step: vLLM sizes its GPU KV
cache after loading the model).

The split says what vLLM lets us control: its GPU KV cache is sized at start-up and never resized, so the
GPU KV blocks are fixed (`kv_gpu_blocks_min == kv_gpu_blocks_max`), and every expert stays resident (the
budget covers all of them). The slower KV tiers are the connector's (its `cpu_blocks`, `nvme_blocks`, or the
settings' when another connector or none is configured). It must never change vLLM's config.
"""

from __future__ import annotations

import re
import time
from typing import Any

from tierplan.agent.adapters.vllm.capture import ModelShape
from tierplan.agent.adapters.vllm.connector_config import ConnectorSettings
from tierplan.agent.adapters.vllm.settings import VllmPluginSettings
from tierplan.controller.protocol import Link
from tierplan.controller.protocol_service import AgentRegistration, HardwareSheet, ShapeSpec, SplitSheet

TRANSFER_OVERHEAD_S = 2e-4  # per-transfer host cost the cost model assumes before calibration


def model_id(text: str) -> str:
    """A protocol Id from a model path or name (its last path part; characters outside the Id set become '-')."""
    tail = text.rstrip("/").rsplit("/", 1)[-1] or "model"
    return re.sub(r"[^A-Za-z0-9._:-]", "-", tail)[:128]


def kv_bytes_per_token(vllm_config: Any) -> int:
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    elem = mc.dtype.itemsize if hasattr(mc.dtype, "itemsize") else 2
    return max(1, 2 * mc.get_num_kv_heads(pc) * mc.get_head_size() * mc.get_num_layers(pc) * elem)


def tier_capacity(vllm_config: Any, settings: VllmPluginSettings) -> tuple[int, int]:
    """The connector's CPU and NVMe tier capacity in blocks: its own `kv_connector_extra_config` as the connector
    reads it (`cpu_blocks`, `nvme_blocks`, its defaults where absent) when our connector is configured, else the
    settings' (no connector: 0, 0)."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {}) if ktc is not None else {}
    if ktc is None or getattr(ktc, "kv_connector", None) != "TierplanConnector":
        return settings.kv_cpu_blocks, settings.kv_nvme_blocks
    ours = ConnectorSettings.parse(extra)  # the connector's own reading, defaults included (ValueError if bad)
    return ours.cpu_blocks, ours.nvme_blocks


def expert_footprint(shape: ModelShape) -> tuple[int, ...]:
    """Bytes of experts per model layer as vLLM holds them: all resident."""
    moe = set(shape.moe_layers)
    return tuple(shape.num_experts * shape.expert_bytes if layer in moe else 0 for layer in range(shape.num_layers))


def max_num_seqs(vllm_config: Any) -> int | None:
    """The scheduler's max_num_seqs (the most sequences a step runs), None where this vLLM has no such setting."""
    n = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", None)
    return int(n) if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None


def build_registration(shape: ModelShape, vllm_config: Any, settings: VllmPluginSettings,
                       rank: int = 0) -> AgentRegistration:
    cc = vllm_config.cache_config
    block_tokens = int(cc.block_size)
    gpu_blocks = max(1, int(cc.num_gpu_blocks or 1))
    block_bytes = kv_bytes_per_token(vllm_config) * block_tokens
    experts = sum(expert_footprint(shape))
    cpu_blocks, nvme_blocks = tier_capacity(vllm_config, settings)
    budget = settings.hbm_budget_bytes or experts + shape.dense_bytes + gpu_blocks * block_bytes
    links = {Link.H2D: settings.link_bytes_per_s, Link.D2H: settings.link_bytes_per_s,
             Link.DISK2H: settings.nvme_bytes_per_s, Link.H2DISK: settings.nvme_bytes_per_s}
    return AgentRegistration(
        agent_id=settings.agent_id, rank=rank, group=settings.group, engine="vllm", registered_s=time.time(),
        shape=ShapeSpec(name=model_id(str(vllm_config.model_config.model)), num_layers=shape.num_layers,
                        moe_layers=shape.moe_layers, num_experts=shape.num_experts, top_k=shape.top_k,
                        expert_bytes=shape.expert_bytes, dense_bytes=shape.dense_bytes,
                        kv_bytes_per_token=kv_bytes_per_token(vllm_config), block_tokens=block_tokens),
        hardware=HardwareSheet(name=f"vllm {vllm_config.device_config.device_type}", link_bytes_per_s=links,
                               transfer_overhead_s=TRANSFER_OVERHEAD_S, hbm_bytes=budget),
        split=SplitSheet(hbm_budget_bytes=budget, dense_bytes=shape.dense_bytes, workspace_bytes=0,
                         slot_bytes=shape.expert_bytes, kv_block_bytes=block_bytes, kv_gpu_blocks_max=gpu_blocks,
                         kv_gpu_blocks_min=gpu_blocks, kv_block_tokens=block_tokens,
                         kv_cpu_blocks=cpu_blocks, kv_nvme_blocks=nvme_blocks,
                         max_running_seqs=max_num_seqs(vllm_config)))
