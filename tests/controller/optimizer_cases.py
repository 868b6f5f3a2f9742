"""Problems the optimizer tests share: seeded random small instances and a constructed cliff."""

from __future__ import annotations

import numpy as np

from tierplan.controller.optimizer import Group, GroupKind, Option, SplitProblem
from tierplan.controller.optimizer.synthetic import BenchShape


def random_problem(rng: np.random.Generator) -> SplitProblem:
    """2..6 groups of 1..9 options; half are slot curves (non-increasing, often non-concave), half arbitrary."""
    groups = []
    for g in range(int(rng.integers(1, 7))):
        n = int(rng.integers(1, 10))
        if rng.random() < 0.5:  # a miss-ratio-like curve: flat stretches and a cliff somewhere
            units = np.arange(n)
            drops = rng.random(n) * (rng.random(n) < 0.5) * rng.choice([1.0, 8.0], size=n)
            cost = 10.0 - np.concatenate([[0.0], np.cumsum(drops[1:])])
            link = (np.sort(rng.integers(0, 1000, n))[::-1]).astype(int)
        else:
            units, cost, link = rng.integers(0, 10, n), rng.random(n) * 10, rng.integers(0, 1000, n)
        kind = GroupKind.KV if g == 0 and rng.random() < 0.3 else GroupKind.EXPERTS
        current = int(rng.integers(0, n)) if rng.random() < 0.3 else None
        groups.append(Group(f"g{g}", tuple(Option(int(u), float(c), int(v)) for u, c, v in zip(units, cost, link,
                                                                                              strict=True)),
                            current=current, kind=kind))
    least = sum(min(o.units for o in g.options) for g in groups)
    capacity = int(rng.integers(0, 6 * len(groups) + 1)) + (least if rng.random() < 0.9 else 0)
    least_link = sum(min(o.link_bytes for o in g.options) for g in groups)
    budget = None if rng.random() < 0.2 else int(rng.integers(0, 500 * len(groups) + 1)) + least_link
    migration = float(rng.random() * 0.3) if rng.random() < 0.3 else 0.0
    return SplitProblem(tuple(groups), capacity, 1, budget, migration)


def cliff_problem() -> SplitProblem:
    """Two layers, 10 units of HBM. Layer A's curve is concave (each slot saves a little); layer B's is flat
    until 8 slots, where its working set fits and the stall vanishes (a cliff). The best split gives B its 8;
    an equal-marginal greedy sees zero benefit in B's first slots and pours everything into A."""
    a = tuple(Option(k, 10.0 - 0.5 * k, label=f"{k} slots") for k in range(11))
    b = tuple(Option(k, 20.0 if k < 8 else 1.0, label=f"{k} slots") for k in range(11))
    return SplitProblem((Group("layer 0", a), Group("layer 1", b)), capacity_units=10, unit_bytes=9 << 20)


def small_shape(**overrides: object) -> BenchShape:
    """A 6-layer, 16-expert model whose experts and KV do not both fit in 60 slots of HBM."""
    base = dict(num_layers=6, num_experts=16, hbm_budget_bytes=60 * (9 << 20), dense_bytes=0, workspace_bytes=0,
                context_tokens=512, kv_option_step_blocks=16, link_budget_bytes=None)
    base.update(overrides)
    return BenchShape(**base)  # type: ignore[arg-type]
