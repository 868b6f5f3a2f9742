"""The rank's agent (`VllmAgent`) built without vLLM, for the plugin's unit tests (test process).

`vllm_config()` is the few fields of a vLLM config the agent reads; `make_agent` builds the agent over a router
capture of a 2-layer, 8-expert, top-2 model with no sidecar listening; `sent_windows` swaps its outbox sink for a
list (the windows as the link would get them); `plan` is a small valid Plan. Needs torch, not vLLM.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from tierplan.agent.adapters.vllm.capture import InPlaceRouterTap, ModelShape, RouterCapture
from tierplan.agent.adapters.vllm.link import VllmAgent
from tierplan.agent.adapters.vllm.settings import VllmPluginSettings
from tierplan.controller.protocol import Plan, Telemetry, Tier

SHAPE = ModelShape(num_layers=2, moe_layers=(0, 1), num_experts=8, top_k=2, expert_bytes=1024, dense_bytes=4096)


def vllm_config(num_gpu_blocks: int = 100) -> SimpleNamespace:
    mc = SimpleNamespace(model="/models/tiny", dtype=torch.float32, get_num_kv_heads=lambda pc: 2,
                         get_head_size=lambda: 32, get_num_layers=lambda pc: 2)
    return SimpleNamespace(model_config=mc, parallel_config=SimpleNamespace(rank=0),
                           cache_config=SimpleNamespace(block_size=32, num_gpu_blocks=num_gpu_blocks),
                           device_config=SimpleNamespace(device_type="cpu"))


def make_agent(tmp_path: Path, **settings: object) -> VllmAgent:
    tap = InPlaceRouterTap(SHAPE.moe_layers, SHAPE.num_experts, SHAPE.top_k, torch.device("cpu"))
    values = {"socket": str(tmp_path / "nobody.sock"), "window_steps": 2, "kv_cpu_blocks": 64,
              "kv_nvme_blocks": 256, **settings}
    s = VllmPluginSettings(**values)  # type: ignore[arg-type]
    return VllmAgent(RouterCapture(tap, SHAPE, 64, torch.device("cpu")), vllm_config(), s)


def sent_windows(agent: VllmAgent) -> list[Telemetry]:
    sent: list[Telemetry] = []
    agent.windows.outbox.sink = sent.append
    return sent


def plan(version: int = 1, base: int = 0, kv: dict[Tier, int] | None = None,
         kv_retention: tuple[str, ...] = ()) -> Plan:
    return Plan(plan_id=f"p{version}", version=version, base_version=base, created_s=0.0, hbm_budget_bytes=1 << 30,
                expert_bytes_per_layer=(4096, 4096), kv_blocks_per_tier={Tier.CPU: 32} if kv is None else kv,
                reason="test", kv_retention=kv_retention)
