"""An agent's controller configuration from its registration and its group's policy knobs (service process).

`controller_config(reg, knobs)` maps every `PolicyKnobs` field onto `ControllerConfig` / `SplitSpace`, except
`plan_every_windows`, which the hub's planner honours (windows per agent between two `step_next` calls).
`knobs_misfit(reg, knobs)` names the first knob this agent cannot run with (a pin outside its model, a budget
above what it registered, a floor above its experts), so a policy is refused before it is accepted, never
accepted and ignored. Pure construction: no I/O, no state.
"""

from __future__ import annotations

from tierplan.controller.costmodel import ComputeParams, HardwareSpec
from tierplan.controller.demand import CurveSource
from tierplan.controller.loop import ControllerConfig, Solver, pinned_by_layer
from tierplan.controller.model_shape import ModelShape
from tierplan.controller.protocol_service import AgentRegistration, PolicyKnobs
from tierplan.controller.valuation import SplitSpace


def model_shape(reg: AgentRegistration) -> ModelShape:
    s = reg.shape
    return ModelShape(name=s.name, num_layers=s.num_layers, moe_layers=s.moe_layers, num_experts=s.num_experts,
                      top_k=s.top_k, expert_bytes=s.expert_bytes, dense_bytes=s.dense_bytes,
                      kv_bytes_per_token=s.kv_bytes_per_token, block_tokens=s.block_tokens)


def knobs_misfit(reg: AgentRegistration, knobs: PolicyKnobs) -> str | None:
    """Why `knobs` cannot drive this agent's controller ('<knob>: ...'), or None when they fit."""
    shape, split = model_shape(reg), reg.split
    try:
        pins = pinned_by_layer(shape, knobs.pinned_experts)
    except ValueError as exc:
        return f"{exc} (agent {reg.agent_id})"
    cap = knobs.max_slots_per_layer
    for layer, experts in pins.items():  # a layer with pins keeps them plus one token's top-k (controller/loop.py)
        need = min(shape.num_experts, len(experts) + shape.top_k)
        if cap is not None and cap < need:
            return (f"max_slots_per_layer: {cap} is below the {need} slots layer {layer} needs for its "
                    f"{len(experts)} pinned expert(s) plus top_k={shape.top_k} (agent {reg.agent_id})")
    if knobs.hbm_budget_bytes is not None and knobs.hbm_budget_bytes > split.hbm_budget_bytes:
        return (f"hbm_budget_bytes: {knobs.hbm_budget_bytes} exceeds agent {reg.agent_id}'s registered budget of "
                f"{split.hbm_budget_bytes} bytes")
    budget = knobs.hbm_budget_bytes or split.hbm_budget_bytes
    floor_bytes = (split.dense_bytes + split.workspace_bytes + split.kv_gpu_blocks_min * split.kv_block_bytes
                   + len(shape.moe_layers) * min(knobs.min_slots_per_layer, shape.num_experts) * split.slot_bytes)
    if floor_bytes > budget:
        return (f"min_slots_per_layer / hbm_budget_bytes: agent {reg.agent_id} needs {floor_bytes} bytes for its "
                f"dense weights, workspace, KV floor and {knobs.min_slots_per_layer} slot(s) per MoE layer, over "
                f"the budget of {budget} bytes")
    return None


def controller_config(reg: AgentRegistration, knobs: PolicyKnobs) -> ControllerConfig:
    """The controller of one agent under one policy; ValueError (from `knobs_misfit`) if they do not fit."""
    why = knobs_misfit(reg, knobs)
    if why is not None:
        raise ValueError(why)
    hw, split = reg.hardware, reg.split
    hardware = HardwareSpec(link_bytes_per_s=dict(hw.link_bytes_per_s), transfer_overhead_s=hw.transfer_overhead_s,
                            hbm_bytes=hw.hbm_bytes, hbm_bytes_per_s=hw.hbm_bytes_per_s, name=hw.name)
    space = SplitSpace(hbm_budget_bytes=knobs.hbm_budget_bytes or split.hbm_budget_bytes,
                       dense_bytes=split.dense_bytes, workspace_bytes=split.workspace_bytes,
                       slot_bytes=split.slot_bytes, kv_block_bytes=split.kv_block_bytes,
                       kv_gpu_blocks_max=split.kv_gpu_blocks_max, kv_gpu_blocks_min=split.kv_gpu_blocks_min,
                       max_running_seqs=split.max_running_seqs, min_slots_per_layer=knobs.min_slots_per_layer,
                       kv_block_tokens=split.kv_block_tokens,
                       link_share=knobs.link_share, max_slots_per_layer=knobs.max_slots_per_layer,
                       stall_weight=knobs.stall_weight, kv_weight=knobs.kv_weight)
    compute = ComputeParams(**reg.compute.model_dump()) if reg.compute is not None else None
    shadow = CurveSource(knobs.shadow_predictor.value) if knobs.shadow_predictor is not None else None
    return ControllerConfig(shape=model_shape(reg), hardware=hardware, space=space, kv_cpu_blocks=split.kv_cpu_blocks,
                            kv_nvme_blocks=split.kv_nvme_blocks, solver=Solver(knobs.solver.value),
                            hysteresis=knobs.hysteresis, cooldown_windows=knobs.cooldown_windows,
                            horizon_steps=knobs.horizon_steps, top_m=knobs.top_m, min_prob=knobs.min_prob,
                            min_score=knobs.min_score, min_prefetch_precision=knobs.min_prefetch_precision,
                            pin_frac=knobs.pin_frac, calibrate=knobs.calibrate,
                            pinned_experts=knobs.pinned_experts, predictor=CurveSource(knobs.predictor.value),
                            shadow_predictor=shadow, auto_promote=knobs.auto_promote, compute=compute,
                            batch_coupling=knobs.batch_coupling, weigh_start=knobs.weigh_start,
                            hold_slots_while_filling=knobs.hold_slots_while_filling,
                            quiet_windows=knobs.quiet_windows)
