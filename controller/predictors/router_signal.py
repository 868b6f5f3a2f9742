"""The in-engine signal: the next layer's router applied to the current hidden state, where an engine gives it.

Runs wherever the signal arrives (in the agent's process it is the sharpest one-layer-ahead predictor there is:
the same token's hidden state barely changes between adjacent layers, so layer l + 1's router on layer l's
output usually names most of l + 1's experts). An engine adapter calls `provide(step, layer, probs)` with the
router's softmax over layer `layer`'s experts, computed one layer early; `scores` serves it, mixed with the
`fallback` predictor by `mix` (1.0 = the signal alone), and falls back entirely where no signal came (each such
position counted in `num_fallbacks`: nothing silently ignored).

The recorded routing traces carry no hidden states, so `tierplan eval predictors` cannot evaluate this
predictor and says so; it is tested on synthetic signals. Never imports torch, runtime or agent.

Shape letters: E experts per layer.
"""

from __future__ import annotations

import numpy as np

from tierplan.controller.predictors.base import DemandPredictor


class RouterLookaheadPredictor:
    """DemandPredictor over an engine-provided next-layer router signal, with a fallback."""

    name = "router-lookahead"
    version = 1

    def __init__(self, fallback: DemandPredictor, top_k: int, mix: float = 1.0) -> None:
        if top_k < 1 or not 0.0 <= mix <= 1.0:
            raise ValueError(f"router-lookahead: need top_k >= 1 and mix in [0, 1], got {top_k}, {mix}")
        self.fallback, self.top_k, self.mix = fallback, top_k, mix

    def reset(self, num_layers: int, num_experts: int) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self.fallback.reset(num_layers, num_experts)
        self._signal: dict[tuple[int, int], np.ndarray] = {}
        self.num_signals = 0
        self.num_fallbacks = 0

    def provide(self, step: int, layer: int, router_probs: np.ndarray) -> None:
        """The router softmax [E] of `layer` on the hidden state one layer earlier, for `step`."""
        probs = np.asarray(router_probs, np.float64)
        if probs.shape != (self.num_experts,) or not np.isfinite(probs).all() or (probs < 0).any():
            raise ValueError(f"router-lookahead: signal for ({step}, {layer}) must be {self.num_experts} finite "
                             f"probabilities >= 0, got shape {probs.shape}")
        self._signal[(step, layer)] = probs
        self.num_signals += 1

    def observe(self, step: int, layer: int, expert_ids: np.ndarray) -> None:
        self._signal.pop((step, layer), None)
        self.fallback.observe(step, layer, expert_ids)

    def scores(self, step: int, layer: int) -> np.ndarray:
        base = self.fallback.scores(step, layer)
        probs = self._signal.get((step, layer))
        if probs is None:
            self.num_fallbacks += 1
            return base
        # A softmax sums to 1 while top-k of E are demanded: rank by the signal, scaled to top-k mass.
        demand = np.minimum(probs / max(probs.sum(), 1e-12) * self.top_k, 1.0)
        return self.mix * demand + (1.0 - self.mix) * base
