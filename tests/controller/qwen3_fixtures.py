"""A qwen3-30b-a3b-sized controller (cut to 8 layers: 128 experts, top-8, 256 KiB KV blocks) as the phase bench
registers one, with the compute prior given and no calibration, so its plans are the same on any machine."""

from __future__ import annotations

import dataclasses

from tierplan.api.hub_config import controller_config
from tierplan.controller.loop import Controller
from tierplan.controller.protocol import Link
from tierplan.controller.protocol_service import (
    AgentRegistration,
    ComputeSheet,
    HardwareSheet,
    PolicyKnobs,
    ShapeSpec,
    SplitSheet,
)

LAYERS, EXPERTS, TOP_K = 8, 128, 8
BLOCK_BYTES = 256 << 10


def qwen3_controller(budget_bytes: int, slot_bytes: int, kv_max: int, kv_min: int, hbm_bytes_per_s: float,
                     device: str, moe_ms_per_miss: float = 0.0) -> Controller:
    """The coupled controller for one phase point's sizes (a 50 GB/s host link)."""
    reg = AgentRegistration(
        agent_id="a", group="phase", engine="tierplan-reference", registered_s=0.0,
        shape=ShapeSpec(name="qwen3-30b-a3b", num_layers=LAYERS, moe_layers=tuple(range(LAYERS)),
                        num_experts=EXPERTS, top_k=TOP_K, expert_bytes=slot_bytes, dense_bytes=0,
                        kv_bytes_per_token=BLOCK_BYTES // 16, block_tokens=16),
        hardware=HardwareSheet(name=device, link_bytes_per_s=dict.fromkeys(Link, 50e9), transfer_overhead_s=2e-4,
                               hbm_bytes=budget_bytes, hbm_bytes_per_s=hbm_bytes_per_s),
        split=SplitSheet(hbm_budget_bytes=budget_bytes, dense_bytes=0, workspace_bytes=0, slot_bytes=slot_bytes,
                         kv_block_bytes=BLOCK_BYTES, kv_gpu_blocks_max=kv_max, kv_gpu_blocks_min=kv_min,
                         kv_block_tokens=16, kv_cpu_blocks=1 << 20, kv_nvme_blocks=0),
        compute=ComputeSheet(step_ms=1.0, dense_ms=0.5, moe_ms=0.3, dense_ms_per_token=0.01, moe_ms_per_token=0.01,
                             moe_ms_per_active_expert=slot_bytes / hbm_bytes_per_s * 1e3,
                             moe_ms_per_miss=moe_ms_per_miss))
    cfg = controller_config(reg, PolicyKnobs(min_slots_per_layer=TOP_K, horizon_steps=64, calibrate=False))
    return Controller(dataclasses.replace(cfg, batch_coupling=True))
