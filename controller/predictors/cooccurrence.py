"""Co-activation statistics of the routing stream and the per-expert features built from them.

Runs in the controller (trained online from each window's routing; read by the learned predictor and the
cost-aware policy). The stream is fed in execution order (step s, layers 0..L-1, then s+1); for a target
(s, l) the signals known once the previous execution position has routed are:
- `xlayer1`: the experts at the previous position (the same token's layer l - 1; for l = 0 the previous step's
  last layer), through P(j at target | i at source) averaged over the source's experts (cross-layer
  co-activation);
- `xlayer2`: the same from two positions back (layer l - 2 of the same token);
- `context`: the exact expert set at the previous position as one context (strong for small top-k, e.g.
  Mixtral's 28 pairs), backed off to `xlayer1` while a context is rare;
- `temporal`: the previous step's experts at the same layer (the previous token), and `prev` its indicator;
- `freq`: the layer's demand frequency.
Probabilities are smoothed toward the layer's frequency with `prior` pseudo-counts and fed to models as logits.

Learning is in chunks of `chunk_steps` steps: the tables fold in a chunk's observations when the next chunk
starts, so every position of a chunk is scored by the tables as they stood at its start (a plan window, as the
agent would hold them); the sources themselves are always the latest. `CoactivationFeatures` is the online form
(observe / features), `feature_stream` computes the same numbers for a whole recorded stream at once
(vectorized per chunk; tests check both agree). Never imports torch, runtime or agent.

Shape letters: S steps, L layers, E experts per layer, F features, N positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

FEATURE_NAMES = ("xlayer1", "xlayer2", "context", "temporal", "prev", "freq", "layer_frac")
_LOGIT_COLS = (0, 1, 2, 3, 5)
_EPS = 1e-4


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, _EPS, 1.0 - _EPS)
    return np.log(p / (1.0 - p))


def indicators(unions: Sequence[Sequence[np.ndarray]], num_layers: int, num_experts: int) -> np.ndarray:
    """[S, L, E] float64 one-hot of each step's demanded set."""
    x = np.zeros((len(unions), num_layers, num_experts))
    for s, per_layer in enumerate(unions):
        for layer, ids in enumerate(per_layer):
            x[s, layer, ids] = 1.0
    return x


def _sources(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every target (s, l): sets at 1 and 2 execution positions back and at (s - 1, l); [S, L, E] each."""
    num_steps, num_layers, num_experts = x.shape
    flat = x.reshape(num_steps * num_layers, num_experts)  # [S*L, E] execution order
    s1 = np.zeros_like(flat)
    s2 = np.zeros_like(flat)
    s1[1:], s2[2:] = flat[:-1], flat[:-2]
    tmp = np.zeros_like(x)
    tmp[1:] = x[:-1]
    return s1.reshape(x.shape), s2.reshape(x.shape), tmp


class _Tables:
    """The frozen-per-chunk counts and the feature formulas both forms share."""

    def __init__(self, num_layers: int, num_experts: int, prior: float) -> None:
        self.prior = prior
        self.num_layers, self.num_experts = num_layers, num_experts
        self.pair = np.zeros((3, num_layers, num_experts, num_experts))  # [3, L, E, E] x1, x2, temporal
        self.src = np.zeros((3, num_layers, num_experts))  # [3, L, E]
        self.count = np.zeros((num_layers, num_experts))  # [L, E]
        self.steps = np.zeros(num_layers)  # [L]
        self.ctx: dict[tuple[int, bytes], np.ndarray] = {}  # (layer, source set) -> [E + 1] counts, n

    def fold(self, s1: np.ndarray, s2: np.ndarray, tmp: np.ndarray, x: np.ndarray) -> None:
        """Add positions [n, L, E] of whole steps (sources and demanded sets)."""
        for k, src in enumerate((s1, s2, tmp)):
            self.pair[k] += np.einsum("sli,slj->lij", src, x)
            self.src[k] += src.sum(axis=0)
        self.count += x.sum(axis=0)
        self.steps += x.shape[0]
        for s in range(x.shape[0]):
            for layer in range(self.num_layers):
                key = (layer, np.packbits(s1[s, layer] > 0).tobytes())
                entry = self.ctx.get(key)
                if entry is None:
                    entry = self.ctx[key] = np.zeros(self.num_experts + 1)
                entry[:-1] += x[s, layer]
                entry[-1] += 1.0

    def features(self, s1: np.ndarray, s2: np.ndarray, tmp: np.ndarray) -> np.ndarray:
        """[n, L, E, F] features for targets of n steps given their sources [n, L, E]."""
        n, num_layers, num_experts = s1.shape
        steps = np.maximum(self.steps, 1.0)[:, None]
        q = np.where(self.steps[:, None] > 0, self.count / steps, 1.0 / num_experts)  # [L, E]
        out = np.empty((n, num_layers, num_experts, len(FEATURE_NAMES)))
        probs = []
        for k, src in enumerate((s1, s2, tmp)):
            inv = src / (self.src[k] + self.prior)  # [n, L, E]
            size = src.sum(axis=2, keepdims=True)  # [n, L, 1]
            p = np.einsum("sli,lij->slj", inv, self.pair[k]) + self.prior * inv.sum(axis=2, keepdims=True) * q
            probs.append(np.where(size > 0, p / np.maximum(size, 1.0), q))
        out[..., 0], out[..., 1], out[..., 3] = probs
        ctx = probs[0].copy()
        for s in range(n):
            for layer in range(num_layers):
                entry = self.ctx.get((layer, np.packbits(s1[s, layer] > 0).tobytes()))
                if entry is not None:
                    w = 2.0 * self.prior
                    ctx[s, layer] = (entry[:-1] + w * probs[0][s, layer]) / (entry[-1] + w)
        out[..., 2] = ctx
        out[..., 4] = tmp
        out[..., 5] = q
        out[..., 6] = (np.arange(num_layers) / max(num_layers - 1, 1))[:, None]
        out[..., _LOGIT_COLS] = _logit(out[..., _LOGIT_COLS])
        return out


def feature_stream(unions: Sequence[Sequence[np.ndarray]], num_layers: int, num_experts: int,
                   chunk_steps: int = 16, prior: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Features [S, L, E, F] of every target, as the online form gives them, and labels [S, L, E]."""
    x = indicators(unions, num_layers, num_experts)  # [S, L, E]
    s1, s2, tmp = _sources(x)
    tables = _Tables(num_layers, num_experts, prior)
    out = np.empty((x.shape[0], num_layers, num_experts, len(FEATURE_NAMES)))
    for a in range(0, x.shape[0], chunk_steps):
        b = min(a + chunk_steps, x.shape[0])
        out[a:b] = tables.features(s1[a:b], s2[a:b], tmp[a:b])
        tables.fold(s1[a:b], s2[a:b], tmp[a:b], x[a:b])
    return out, x


class CoactivationFeatures:
    """Online form: `observe` positions in execution order, `features(step, layer)` for the next target."""

    name = "cooccurrence"
    version = 1

    def __init__(self, chunk_steps: int = 16, prior: float = 1.0) -> None:
        if chunk_steps < 1 or prior <= 0:
            raise ValueError(f"cooccurrence: need chunk_steps >= 1, prior > 0; got {chunk_steps}, {prior}")
        self.chunk_steps, self.prior = chunk_steps, prior

    def reset(self, num_layers: int, num_experts: int) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self.tables = _Tables(num_layers, num_experts, self.prior)
        self._chunk = 0
        self._rows: dict[int, np.ndarray] = {}  # step -> [L, E] demanded sets of the open chunk and the last step
        self._last: tuple[int, int] | None = None

    def _row(self, step: int) -> np.ndarray:
        if step not in self._rows:
            self._rows[step] = np.zeros((self.num_layers, self.num_experts))
        return self._rows[step]

    def _source_rows(self, step: int, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sources of target (step, layer) from what was observed, each [E] (zeros where unknown)."""
        def at(pos: int) -> np.ndarray:
            s, lyr = divmod(pos, self.num_layers)
            row = self._rows.get(s)
            return row[lyr] if row is not None and pos >= 0 else np.zeros(self.num_experts)
        pos = step * self.num_layers + layer
        return at(pos - 1), at(pos - 2), at(pos - self.num_layers)

    def _maybe_fold(self, step: int) -> None:
        chunk = step // self.chunk_steps
        if chunk == self._chunk:
            return
        steps = [s for s in sorted(self._rows) if s // self.chunk_steps == self._chunk]
        if steps:
            x = np.stack([self._rows[s] for s in steps])  # [n, L, E]
            src = [np.stack(rows) for rows in zip(*[self._step_sources(s) for s in steps], strict=True)]
            self.tables.fold(src[0], src[1], src[2], x)
        self._chunk = chunk
        # The last two steps stay: they are the sources of the new chunk's first positions.
        newest = max(self._rows) if self._rows else 0
        self._rows = {s: r for s, r in self._rows.items() if s >= min(chunk * self.chunk_steps, newest - 1)}

    def _step_sources(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rows = [self._source_rows(step, layer) for layer in range(self.num_layers)]
        return tuple(np.stack(r) for r in zip(*rows, strict=True))  # type: ignore[return-value]

    def observe(self, step: int, layer: int, expert_ids: np.ndarray) -> None:
        pos = (step, layer)
        if self._last is not None and step * self.num_layers + layer != self._last[0] * self.num_layers + \
                self._last[1] + 1:
            raise ValueError(f"cooccurrence: observed {pos} after {self._last}; expected execution order")
        self._maybe_fold(step)
        ids = np.asarray(expert_ids, np.int64)
        self._row(step)[layer, ids[ids >= 0]] = 1.0
        self._last = pos

    def features(self, step: int, layer: int) -> np.ndarray:
        """[E, F] features (FEATURE_NAMES order) of target (step, layer), the next position to observe."""
        self._maybe_fold(step)
        s1, s2, tmp = self._source_rows(step, layer)
        full = [np.zeros((1, self.num_layers, self.num_experts)) for _ in range(3)]
        for arr, row in zip(full, (s1, s2, tmp), strict=True):
            arr[0, layer] = row
        return self.tables.features(*full)[0, layer]

    def probabilities(self, step: int, layer: int) -> dict[str, np.ndarray]:
        """Each signal's [E] probability for target (step, layer)."""
        f = self.features(step, layer)
        out = {name: f[:, i] for i, name in enumerate(FEATURE_NAMES)}
        for i in _LOGIT_COLS:
            out[FEATURE_NAMES[i]] = 1.0 / (1.0 + np.exp(-f[:, i]))
        return out

    def scores(self, step: int, layer: int) -> np.ndarray:
        """The context signal alone (a DemandPredictor without a learned blend)."""
        return self.probabilities(step, layer)["context"]
