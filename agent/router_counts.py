"""One window of router counters on the host, and the per-layer Telemetry parts made from them.

The engine thread only takes the snapshot (`RouterTap.snapshot`: one packed host copy, kept as numpy arrays);
the outbox thread turns it into `LayerStats`. Two ways, same result (tests compare them field by field):
  * `layer_stats(trusted=False)`: every row through pydantic validation (the slower way: bench/results/design_notes.md);
  * `layer_stats(trusted=True)`: the invariants LayerStats checks are checked on the arrays at once (counts
    >= 0, pairs a < b and unique, sizes within the protocol's limits, finite non-negative entropy); a window
    that breaks one raises ValueError naming the layer and field, as validation would, and nothing is sent.
    The parts are then built without re-validation. The Telemetry message around them is still validated,
    and the sidecar and controller validate every message they receive.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tierplan.controller.protocol import MAX_EXPERTS, MAX_LAYERS, MAX_PAIRS_PER_LAYER, CoPair, LayerStats


@dataclass(frozen=True)
class RouterCounts:
    """One window of router counters on the host, per MoE layer (row m is layer `moe_layers[m]`)."""

    moe_layers: tuple[int, ...]
    num_experts: int
    counts: np.ndarray  # [L, E] int64 tokens routed to each expert
    pair_counts: np.ndarray  # [L, P] int64 top co-occurrence counts, descending (0 = no pair)
    pair_flat: np.ndarray  # [L, P] int64 a * E + b
    entropy_sum: np.ndarray  # [L] float64 router entropy summed over tokens
    tokens: list[int]  # [L]

    def _mean_entropy(self) -> np.ndarray:
        t = np.asarray(self.tokens, dtype=np.float64)  # [L]
        return np.divide(self.entropy_sum, t, out=np.zeros_like(self.entropy_sum), where=t > 0)  # [L]

    def _pairs(self, m: int) -> list[tuple[int, int, int]]:
        e = self.num_experts
        keep = self.pair_counts[m] > 0  # [P]
        f, c = self.pair_flat[m][keep], self.pair_counts[m][keep]
        return list(zip((f // e).tolist(), (f % e).tolist(), c.tolist(), strict=True))

    def check(self) -> None:
        """The invariants `LayerStats` validates, on the whole window at once; ValueError names the first break."""
        n_l, e = self.counts.shape
        if n_l != len(self.moe_layers) or n_l != len(self.tokens) or e != self.num_experts or e > MAX_EXPERTS:
            raise ValueError(f"router counts: shape {self.counts.shape} for {len(self.moe_layers)} layers and "
                             f"num_experts={self.num_experts} (at most {MAX_EXPERTS})")
        if self.pair_counts.shape[1] > MAX_PAIRS_PER_LAYER:
            raise ValueError(f"router counts: {self.pair_counts.shape[1]} pairs per layer, at most "
                             f"{MAX_PAIRS_PER_LAYER}")
        bad = [layer for layer in self.moe_layers if not 0 <= layer < MAX_LAYERS]
        if bad:
            raise ValueError(f"router counts: layer {bad[0]} out of range 0..{MAX_LAYERS - 1}")
        for name, arr in (("activation_counts", self.counts), ("num_tokens", np.asarray(self.tokens))):
            if arr.size and arr.min() < 0:
                m = int(np.argwhere(arr < 0)[0][0])
                raise ValueError(f"layers.{m}.{name}: negative count in layer {self.moe_layers[m]}")
        ent = self._mean_entropy()
        if not np.isfinite(ent).all() or (ent < 0).any():
            m = int(np.argwhere(~np.isfinite(ent) | (ent < 0))[0][0])
            raise ValueError(f"layers.{m}.router_entropy_mean: {ent[m]} must be finite and >= 0")
        live = self.pair_counts > 0  # [L, P]
        a, b = self.pair_flat // e, self.pair_flat % e  # [L, P]
        wrong = live & ((a >= b) | (self.pair_flat < 0))
        if wrong.any():
            m, k = (int(x) for x in np.argwhere(wrong)[0])
            raise ValueError(f"layers.{m}.cooccurrence.{k}: pair ({a[m, k]}, {b[m, k]}) must have a < b")
        for m in range(n_l):
            f = self.pair_flat[m][live[m]]
            if np.unique(f).size != f.size:
                raise ValueError(f"layers.{m}.cooccurrence: a pair repeats in layer {self.moe_layers[m]}")

    def layer_stats(self, trusted: bool = False,
                    between_layers: Callable[[], None] | None = None) -> list[LayerStats]:
        """The window's LayerStats (see the module docstring for the two ways); `between_layers` runs after
        each layer (the outbox yields the GIL there, so a waiting engine thread gets in)."""
        if trusted:
            self.check()
        ent = self._mean_entropy().tolist()
        out = []
        for m, layer in enumerate(self.moe_layers):
            if trusted:
                out.append(LayerStats.model_construct(
                    layer=layer, activation_counts=tuple(self.counts[m].tolist()),
                    cooccurrence=tuple(map(CoPair._make, self._pairs(m))), router_entropy_mean=ent[m],
                    num_tokens=self.tokens[m]))
            else:
                out.append(LayerStats.model_validate(
                    {"layer": layer, "activation_counts": self.counts[m].tolist(), "cooccurrence": self._pairs(m),
                     "router_entropy_mean": ent[m], "num_tokens": self.tokens[m]}))
            if between_layers is not None:
                between_layers()
        return out
