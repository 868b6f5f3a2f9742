"""`fluxmoe`: KV first, experts streamed with a two-layer window, residency by the rho rule (FluxMoE).

Bench driver code. FluxMoE gives the KV cache priority and streams experts layer by layer, loading the next
two layers' experts while one computes (`EngineConfig.expert_lookahead_layers=2`), and balances residency by
bandwidth: rho = compute time per step / expert load time per step. KV first: the GPU KV share is capped at
what the batch's KV demand needs (the run starts at the point's: its `batch` largest requests whole; each
window at the controller's, where more KV blocks stop lowering the predicted cost) and experts get the rest,
up to every expert; rho < 0.9 (loads cannot hide behind compute) moves memory from KV to experts, rho > 1.0
moves it back only while KV is under its cap (experts never shrink to give KV memory it cannot use), and
inside the dead zone [0.9, 1.0] the split holds (`controller.optimizer.greedy.fluxmoe_split`, run to its
fixed point each window on the live loop's cost model, with an even expert share per layer). Not modelled:
FluxMoE's expert compression (the paper's smaller expert format); our experts move at full size. It must
never move bytes or build a plan itself.
"""

from __future__ import annotations

from typing import Any

from tierplan.bench.baselines.base import PointContext
from tierplan.bench.baselines.tierplan_live import (
    KVFirstStart,
    TierplanLive,
    controller_class,
)

LOOKAHEAD_LAYERS = 2


def rho_controller(config: Any) -> Any:
    """The controller with FluxMoE's rho rule as its allocator (compute from the cost model's step, loads over
    the H2D link's bandwidth)."""
    from tierplan.controller.optimizer.greedy import fluxmoe_split
    from tierplan.controller.protocol import Link

    link_bytes_per_ms = float(config.hardware.link_bytes_per_s[Link.H2D]) / 1e3

    class RhoController(controller_class()):  # type: ignore[misc]
        def _solve(self, val: Any) -> Any:
            return fluxmoe_split(val.problem, max(val.step_ms, 1e-6), link_bytes_per_ms)

    return RhoController(config)


class FluxMoE(KVFirstStart, TierplanLive):
    name = "fluxmoe"
    allocator = "FluxMoE's rho rule (dead zone [0.9, 1.0]), even expert share per layer"

    def engine_options(self, ctx: PointContext) -> dict[str, Any]:
        return {"expert_lookahead_layers": LOOKAHEAD_LAYERS}

    factory = staticmethod(rho_controller)
    batch_coupling = False  # its allocator as published: every layer priced at the observed batch
    tierplan_guards = False
    notes = ("KV capped at its demand, experts the rest, rho rule in between; no expert compression (FluxMoE "
             "compresses experts; ours move at full size)")

