"""`mv_wsa`: WiSP's allocator, equal marginal benefit per byte between expert slots and KV blocks.

Bench driver code. The same live loop, telemetry, predictors and cost model as `tierplan` (tierplan_live.py),
the same starting split; only the allocator differs: the controller's equal-marginal greedy
(`controller.optimizer.greedy.solve_greedy`), which grows, step by step, whichever group (a layer's expert
slots, or the GPU KV blocks) buys the most predicted step time per byte of HBM until no step fits or helps.
At its end no group's next step is worth more per byte than the last step any group took, up to the grid of
options. It stops short of a cliff in a miss-ratio curve (a flat stretch has no marginal benefit), which is
why it is a baseline and not how tierplan plans. WiSP's allocator has no link budget: the controller's only
ranks its steps, and a split the greedy ends over it is kept, the overage named in the solution's detail (the
window is planned, never failed for a constraint the rule does not model); the HBM capacity stays a hard
limit. It must never move bytes or build a plan itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierplan.bench.baselines.tierplan_live import KVFirstStart, TierplanLive, controller_class

if TYPE_CHECKING:
    pass


def greedy_controller(config: Any) -> Any:
    """The controller with the equal-marginal greedy as its allocator."""
    from tierplan.controller.optimizer.greedy import solve_greedy

    class GreedyController(controller_class()):  # type: ignore[misc]
        def _solve(self, val: Any) -> Any:
            return solve_greedy(val.problem)

    return GreedyController(config)


class MarginalWSA(KVFirstStart, TierplanLive):
    name = "mv_wsa"
    allocator = "the equal-marginal greedy (WiSP MV-WSA): most step time saved per byte first"

    factory = staticmethod(greedy_controller)
    batch_coupling = False  # its allocator as published: every layer priced at the observed batch
    tierplan_guards = False
