"""Co-activation statistics of the routing stream and the per-expert features built from them.

Runs in the controller (trained online from each window's routing; read by the learned predictor and the
cost-aware policy). The stream is fed in execution order (step s, layers 0..L-1, then s+1); for a target
(s, l) the signals known when the previous position (s, l - 1) has routed are:
- `xlayer1`: the experts at the previous execution position (the same token's layer l - 1; for l = 0 the
  previous step's last layer), through P(j at target | i at source) row means (`CoactivationCounts`);
- `xlayer2`: the same from two positions back (layer l - 2 of the same token);
- `context`: the exact expert set at l - 1 as one context (strong for small top-k, e.g. Mixtral's 28 pairs),
  backed off to `xlayer1` while a context is rare;
- `temporal`: the previous step's experts at the same layer l (previous token), and `prev`: the indicator;
- `freq`: layer l's demand frequency so far, `ewma`: the same with a half-life of `half_life_steps`.
Probabilities are smoothed toward the layer's frequency with `prior` pseudo-counts. Never imports torch,
runtime or agent.

Shape letters: L layers, E experts per layer, F features.
"""

from __future__ import annotations

import numpy as np

FEATURE_NAMES = ("xlayer1", "xlayer2", "context", "temporal", "prev", "freq", "ewma", "layer_frac")
_EPS = 1e-4


class CoactivationCounts:
    """n[t, i, j]: source sets holding i followed by target sets at target slot t holding j."""

    def __init__(self, num_targets: int, num_experts: int, decay: float = 0.0) -> None:
        self.pair = np.zeros((num_targets, num_experts, num_experts))  # [L, E, E]
        self.src = np.zeros((num_targets, num_experts))  # [L, E]
        self.decay = decay

    def add(self, target: int, src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
        if self.decay:
            self.pair[target] *= 1.0 - self.decay
            self.src[target] *= 1.0 - self.decay
        self.pair[target][src_ids[:, None], dst_ids] += 1.0  # ids are distinct within a set
        self.src[target, src_ids] += 1.0

    def predict(self, target: int, src_ids: np.ndarray, marginal: np.ndarray, prior: float) -> np.ndarray:
        """[E] mean over i in src of P(j | i), each smoothed toward `marginal` with `prior` pseudo-counts."""
        if src_ids.size == 0:
            return marginal
        inv = 1.0 / (self.src[target, src_ids] + prior)  # [S]
        return (inv @ self.pair[target, src_ids] + prior * inv.sum() * marginal) / src_ids.size


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, _EPS, 1.0 - _EPS)
    return np.log(p / (1.0 - p))


class CoactivationFeatures:
    """Online co-activation tables over the stream, and `features(step, layer)` for the next target."""

    name = "cooccurrence"
    version = 1

    def __init__(self, prior: float = 1.0, half_life_steps: float = 32.0, decay: float = 0.0) -> None:
        self.prior, self.decay = prior, decay
        self._ewma_rate = 1.0 - 0.5 ** (1.0 / half_life_steps)

    def reset(self, num_layers: int, num_experts: int) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self._x1 = CoactivationCounts(num_layers, num_experts, self.decay)
        self._x2 = CoactivationCounts(num_layers, num_experts, self.decay)
        self._tmp = CoactivationCounts(num_layers, num_experts, self.decay)
        self._ctx: dict[tuple[int, tuple[int, ...]], list] = {}  # (layer, sorted src set) -> [counts [E], n]
        self._count = np.zeros((num_layers, num_experts))  # [L, E]
        self._steps = np.zeros(num_layers)  # [L]
        self._ewma = np.zeros((num_layers, num_experts))  # [L, E]
        self._history: list[tuple[int, int, np.ndarray]] = []  # last (step, layer, ids), at most L + 2
        self._by_layer: dict[int, tuple[int, np.ndarray]] = {}  # layer -> (step, ids) last seen there

    def _back(self, step: int, layer: int, n: int) -> np.ndarray | None:
        """Ids at the execution position n before (step, layer), if it was the last or second-last observed."""
        pos = step * self.num_layers + layer - n
        for s, lyr, ids in reversed(self._history[-2:]):
            if s * self.num_layers + lyr == pos:
                return ids
        return None

    def marginal(self, layer: int) -> np.ndarray:
        n = self._steps[layer]
        return self._count[layer] / n if n else np.full(self.num_experts, 1.0 / self.num_experts)

    def observe(self, step: int, layer: int, expert_ids: np.ndarray) -> None:
        ids = np.asarray(expert_ids, np.int64)
        ids = ids[ids >= 0]
        src1, src2 = self._back(step, layer, 1), self._back(step, layer, 2)
        if src1 is not None:
            self._x1.add(layer, src1, ids)
            entry = self._ctx.setdefault((layer, tuple(sorted(src1.tolist()))), [np.zeros(self.num_experts), 0.0])
            entry[0][ids] += 1.0
            entry[1] += 1.0
        if src2 is not None:
            self._x2.add(layer, src2, ids)
        last = self._by_layer.get(layer)
        if last is not None and last[0] == step - 1:
            self._tmp.add(layer, last[1], ids)
        demanded = np.zeros(self.num_experts)
        demanded[ids] = 1.0
        self._count[layer] += demanded
        self._steps[layer] += 1.0
        self._ewma[layer] += self._ewma_rate * (demanded - self._ewma[layer])
        self._history.append((step, layer, ids))
        del self._history[:-2]
        self._by_layer[layer] = (step, ids)

    def probabilities(self, step: int, layer: int) -> dict[str, np.ndarray]:
        """Each signal's [E] probability for target (step, layer) (call before observing it)."""
        q = self.marginal(layer)
        src1, src2 = self._back(step, layer, 1), self._back(step, layer, 2)
        x1 = q if src1 is None else self._x1.predict(layer, src1, q, self.prior)
        x2 = q if src2 is None else self._x2.predict(layer, src2, q, self.prior)
        ctx = x1
        if src1 is not None:
            entry = self._ctx.get((layer, tuple(sorted(src1.tolist()))))
            if entry is not None:
                ctx = (entry[0] + 2.0 * self.prior * x1) / (entry[1] + 2.0 * self.prior)
        last = self._by_layer.get(layer)
        prev = np.zeros(self.num_experts)
        tmp = q
        if last is not None and last[0] == step - 1:
            prev[last[1]] = 1.0
            tmp = self._tmp.predict(layer, last[1], q, self.prior)
        return {"xlayer1": x1, "xlayer2": x2, "context": ctx, "temporal": tmp, "prev": prev, "freq": q,
                "ewma": self._ewma[layer]}

    def features(self, step: int, layer: int) -> np.ndarray:
        """[E, F] features (FEATURE_NAMES order) for target (step, layer): logits of the probabilities."""
        p = self.probabilities(step, layer)
        out = np.empty((self.num_experts, len(FEATURE_NAMES)))  # [E, F]
        for f, name in enumerate(FEATURE_NAMES[:7]):
            out[:, f] = p[name]
        out[:, 6] += 1e-3
        logit_cols = [0, 1, 2, 3, 5, 6]
        out[:, logit_cols] = _logit(out[:, logit_cols])
        out[:, 7] = layer / max(self.num_layers - 1, 1)
        return out

    def scores(self, step: int, layer: int) -> np.ndarray:
        """The context signal alone (a DemandPredictor without learning a blend)."""
        return self.probabilities(step, layer)["context"]
