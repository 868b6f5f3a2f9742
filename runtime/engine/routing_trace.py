"""Forced-routing replay: real MoE router traces (normalized npz) fitted to any model shape (inference process).

The reference engine can ignore its own router and route token t, layer l to the experts a real model chose,
so expert-cache and prefetch experiments see real skew and real cross-layer structure. `RoutingTrace.load`
checks every field of the npz (dtype, shape, value range) and refuses with the field's name; `routes` cycles
the trace to any token and layer count, remaps expert ids into the model's expert count, adapts top-k and
fills missing entries, all deterministically.

Never decides which experts to cache or prefetch (that is policy), never touches the network, and never
needs the shared data folder: `data/routing/flame_moe_290m_sample.npz` is enough for tests.

Shape letters: T trace tokens, L trace layers, K trace top-k, N requested tokens, M requested layers,
k requested top_k, E requested num_experts.
"""

from __future__ import annotations

import json
import zipfile
from collections import OrderedDict
from enum import IntEnum
from pathlib import Path

import numpy as np

from tierplan.runtime.errors import ConfigError

_FIELDS: dict[str, tuple[np.dtype, str]] = {
    "expert_ids": (np.dtype(np.int16), "[T, L, K]"),
    "weights": (np.dtype(np.float32), "[T, L, K]"),
    "seq_id": (np.dtype(np.int32), "[T]"),
    "pos": (np.dtype(np.int32), "[T]"),
    "phase": (np.dtype(np.uint8), "[T]"),
    "layers": (np.dtype(np.int32), "[L]"),
}
# The forced router's table length (runner.ForcedRouter): sequences walk these tokens of the fitted trace; the
# bench's offline replay rebuilds the same table from it (bench/phase_cost_replay.py).
ROUTER_HORIZON_TOKENS = 4096
_MISSING_ID = -1  # the npz format's marker; never leaves this module
_FILL_STRIDE_TOKEN = 7919  # primes: spread the fill start of all-missing rows over the experts
_FILL_STRIDE_LAYER = 104729


class Phase(IntEnum):
    """Values of the `phase` field."""

    PREFILL = 0
    DECODE = 1


def _validate(arrays: dict[str, np.ndarray], where: str) -> None:
    """Dtype, shape and value checks of every field; raises ConfigError naming the field."""
    for name, (dtype, shape_text) in _FIELDS.items():
        if name not in arrays:
            raise ConfigError(f"{where}: missing field '{name}' (expected {dtype} {shape_text})")
        arr = arrays[name]
        if arr.dtype != dtype:
            raise ConfigError(f"{where}: field '{name}' must be {dtype} {shape_text}, got {arr.dtype} {arr.shape}")
    ids = arrays["expert_ids"]  # [T, L, K]
    if ids.ndim != 3 or 0 in ids.shape:
        raise ConfigError(f"{where}: field 'expert_ids' must have shape [T, L, K] with T, L, K >= 1, got {ids.shape}")
    num_tokens, num_layers, _ = ids.shape
    expected = {
        "weights": ids.shape,
        "seq_id": (num_tokens,),
        "pos": (num_tokens,),
        "phase": (num_tokens,),
        "layers": (num_layers,),
    }
    for name, shape in expected.items():
        if arrays[name].shape != shape:
            raise ConfigError(
                f"{where}: field '{name}' must have shape {shape} (from expert_ids {ids.shape}), "
                f"got {arrays[name].shape}"
            )
    if ids.min() < _MISSING_ID:
        raise ConfigError(f"{where}: field 'expert_ids' must be >= 0 or -1 (missing), got min {int(ids.min())}")
    if not (ids >= 0).any():
        raise ConfigError(f"{where}: field 'expert_ids' has no expert ids (all missing)")
    weights = arrays["weights"]  # [T, L, K]
    bad = ~np.isnan(weights) & ~((weights >= 0) & np.isfinite(weights))
    if bad.any():
        t, layer, j = (int(x) for x in np.argwhere(bad)[0])
        raise ConfigError(
            f"{where}: field 'weights' must be finite and >= 0 or NaN (missing), "
            f"got {float(weights[t, layer, j])} at [{t}, {layer}, {j}]"
        )
    for name in ("seq_id", "pos"):
        if arrays[name].size and arrays[name].min() < 0:
            at = int(np.argmax(arrays[name] < 0))
            raise ConfigError(f"{where}: field '{name}' must be >= 0, got {int(arrays[name][at])} at [{at}]")
    ordered = np.sort(ids, axis=-1)  # [T, L, K]
    repeats = ((np.diff(ordered, axis=-1) == 0) & (ordered[..., 1:] >= 0)).any(-1)  # [T, L]
    if repeats.any():
        t, layer = (int(x) for x in np.argwhere(repeats)[0])
        raise ConfigError(f"{where}: field 'expert_ids' repeats an expert in row [{t}, {layer}]: "
                          f"{ids[t, layer].tolist()} (expected distinct ids, -1 for missing)")
    zero = (np.nan_to_num(weights, nan=1.0) == 0).all(-1)  # [T, L]: no weight and none marked missing (NaN)
    if zero.any():
        t, layer = (int(x) for x in np.argwhere(zero)[0])
        raise ConfigError(f"{where}: field 'weights' is all zero in row [{t}, {layer}] (expected a positive "
                          "weight, or NaN for a missing one)")
    phases = arrays["phase"]
    if not np.isin(phases, [p.value for p in Phase]).all():
        raise ConfigError(
            f"{where}: field 'phase' must be 0 (prefill) or 1 (decode), got values "
            f"{sorted(set(phases.tolist()) - {p.value for p in Phase})}"
        )


def _read_meta_num_experts(meta_path: Path, max_id: int) -> int | None:
    if not meta_path.exists():
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"routing trace meta {meta_path}: not readable JSON ({exc})") from exc
    if not isinstance(meta, dict) or "num_experts" not in meta:
        return None
    value = meta["num_experts"]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"routing trace meta {meta_path}: field 'num_experts' must be an int >= 1, got {value!r}")
    return value  # checked against the ids by RoutingTrace, which says where the first id out of range is


def _fit_row(
    ids: list[int], weights: list[float], top_k: int, num_experts: int, fill_start: int
) -> tuple[list[int], list[float]]:
    """One (token, layer): K trace entries (id -1 = missing, NaN weight = missing) -> top_k distinct ids in
    [0, num_experts) and weights summing to 1.

    Entries with an id keep their recorded order and come first (truncated to top_k); an id that collides
    after `% num_experts` moves to the next unused id. The first min(top_k, K) slots are trace slots: a slot
    whose id or weight is missing gets the mean of the present weights (all equal when none is present).
    Slots beyond K (a trace with fewer experts per token) get weight 0. Filled ids continue after the last id
    (or from `fill_start` when the row has none), skipping used ones.
    """
    used: set[int] = set()

    def take_unused(start: int) -> int:
        candidate = start % num_experts
        while candidate in used:
            candidate = (candidate + 1) % num_experts
        used.add(candidate)
        return candidate

    out_ids: list[int] = []
    out_w: list[float | None] = []
    for expert, w in zip(ids, weights, strict=True):
        if len(out_ids) == top_k:
            break
        if expert >= 0:
            out_ids.append(take_unused(expert))
            out_w.append(None if w != w else float(w))  # w != w: NaN without a numpy call per element
    present = [w for w in out_w if w is not None]
    fill_w = sum(present) / len(present) if present else 1.0
    filled = [fill_w if w is None else w for w in out_w]
    next_start = out_ids[-1] + 1 if out_ids else fill_start
    while len(out_ids) < top_k:
        out_ids.append(take_unused(next_start))
        next_start = out_ids[-1] + 1
        filled.append(fill_w if len(filled) < len(ids) else 0.0)
    total = sum(filled)
    if total <= 0:
        return out_ids, [1.0 / top_k] * top_k
    return out_ids, [w / total for w in filled]


class RoutingTrace:
    """A recorded routing trace (see module docstring); build with `load` or `from_arrays`."""

    def __init__(self, arrays: dict[str, np.ndarray], num_experts: int | None, source: str) -> None:
        _validate(arrays, f"routing trace {source}")
        self._expert_ids = arrays["expert_ids"]  # [T, L, K] int16, -1 missing
        self._weights = arrays["weights"]  # [T, L, K] float32, NaN missing
        self.seq_id = arrays["seq_id"]  # [T]
        self.pos = arrays["pos"]  # [T]
        self.phase = arrays["phase"]  # [T] Phase values
        self.layers = arrays["layers"]  # [L] original layer numbers
        max_id = int(self._expert_ids.max())
        if num_experts is not None and num_experts <= max_id:
            t, layer, j = (int(x) for x in np.argwhere(self._expert_ids == max_id)[0])
            raise ConfigError(f"routing trace {source}: field 'expert_ids' holds expert {max_id} at [{t}, {layer}, "
                              f"{j}], but the trace declares num_experts={num_experts} (expected ids 0.."
                              f"{num_experts - 1}, or -1 for missing)")
        self._num_experts = num_experts if num_experts is not None else max_id + 1
        self.source = source
        self._fitted: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    @classmethod
    def load(cls, path: str | Path) -> RoutingTrace:
        """Read a normalized npz; `num_experts` comes from `<stem>.meta.json` beside it when present."""
        path = Path(path)
        where = f"routing trace {path}"
        expected = "expected a normalized .npz of expert_ids, weights, seq_id, pos, phase, layers"
        try:
            if path.is_file() and path.stat().st_size == 0:
                raise ConfigError(f"{where}: the file is empty (0 bytes; {expected})")
            loaded = np.load(path, allow_pickle=False)
            if not isinstance(loaded, np.lib.npyio.NpzFile):
                raise ConfigError(f"{where}: holds one array ({loaded.dtype} {loaded.shape}, a .npy file), not an npz "
                                  f"archive ({expected})")
            with loaded as npz:
                arrays = {name: npz[name] for name in npz.files}
        except FileNotFoundError:
            raise ConfigError(f"{where}: file not found") from None
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise ConfigError(f"{where}: not a readable npz file ({exc}; {expected})") from None
        _validate(arrays, where)
        num_experts = _read_meta_num_experts(path.with_suffix(".meta.json"), int(arrays["expert_ids"].max()))
        return cls(arrays, num_experts, str(path))

    @classmethod
    def from_arrays(
        cls,
        expert_ids: np.ndarray,
        weights: np.ndarray,
        seq_id: np.ndarray | None = None,
        pos: np.ndarray | None = None,
        phase: np.ndarray | None = None,
        layers: np.ndarray | None = None,
        num_experts: int | None = None,
        source: str = "<arrays>",
    ) -> RoutingTrace:
        """Build from arrays (tests, synthetic traces). Integer ids and float weights are cast to the npz dtypes;
        seq_id defaults to 0, pos to 0..T-1, phase to prefill, layers to 0..L-1."""
        ids = np.asarray(expert_ids)
        w = np.asarray(weights)
        if ids.dtype.kind not in "iu" or (ids.size and (ids.min() < _MISSING_ID or ids.max() > np.iinfo(np.int16).max)):
            raise ConfigError(
                f"routing trace {source}: field 'expert_ids' must be integers in [-1, 32767], got {ids.dtype}"
            )
        if w.dtype.kind != "f":
            raise ConfigError(f"routing trace {source}: field 'weights' must be floating point, got {w.dtype}")
        num_tokens = ids.shape[0] if ids.ndim >= 1 else 0
        num_layers = ids.shape[1] if ids.ndim >= 2 else 0
        arrays = {
            "expert_ids": ids.astype(np.int16),
            "weights": w.astype(np.float32),
            "seq_id": np.zeros(num_tokens, np.int32) if seq_id is None else np.asarray(seq_id),
            "pos": np.arange(num_tokens, dtype=np.int32) if pos is None else np.asarray(pos),
            "phase": np.zeros(num_tokens, np.uint8) if phase is None else np.asarray(phase),
            "layers": np.arange(num_layers, dtype=np.int32) if layers is None else np.asarray(layers),
        }
        return cls(arrays, num_experts, source)

    @property
    def num_tokens(self) -> int:
        return int(self._expert_ids.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self._expert_ids.shape[1])

    @property
    def top_k(self) -> int:
        return int(self._expert_ids.shape[2])

    @property
    def num_experts(self) -> int:
        return self._num_experts

    @property
    def expert_ids(self) -> np.ndarray:
        """The raw ids, read-only view ([T, L, K] int16, -1 missing)."""
        view = self._expert_ids.view()
        view.flags.writeable = False
        return view

    @property
    def weights(self) -> np.ndarray:
        """The raw weights, read-only view ([T, L, K] float32, NaN missing)."""
        view = self._weights.view()
        view.flags.writeable = False
        return view

    def routes(
        self, num_tokens: int, num_layers: int, top_k: int, num_experts: int, start: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """-> (ids int64 [N, M, k], weights float32 [N, M, k]) for a model with `num_experts` experts.

        Token t replays trace token (start + t) % T, layer l trace layer l % L. Ids are distinct per (t, l)
        and in [0, num_experts); weights sum to 1 per (t, l). See `_fit_row` for remapping and filling.
        """
        for name, value, low in (
            ("num_tokens", num_tokens, 0),
            ("num_layers", num_layers, 1),
            ("top_k", top_k, 1),
            ("num_experts", num_experts, 1),
            ("start", start, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
                raise ConfigError(f"routes: {name} must be an int >= {low}, got {value!r}")
        if top_k > num_experts:
            raise ConfigError(
                f"routes: top_k must be <= num_experts ({num_experts}) to pick distinct experts, got {top_k}"
            )
        fit_ids, fit_w = self._fit(int(top_k), int(num_experts))  # [T, L, k]
        token_idx = (start + np.arange(num_tokens, dtype=np.int64)) % self.num_tokens  # [N]
        layer_idx = np.arange(num_layers, dtype=np.int64) % self.num_layers  # [M]
        ids = fit_ids[token_idx[:, None], layer_idx[None, :]]  # [N, M, k]
        weights = fit_w[token_idx[:, None], layer_idx[None, :]]  # [N, M, k]
        return ids, weights

    def _fit(self, top_k: int, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
        """The whole trace fitted to (top_k, num_experts), memoized: ([T, L, k] int64, [T, L, k] float32)."""
        key = (top_k, num_experts)
        if key in self._fitted:
            return self._fitted[key]
        raw_ids = self._expert_ids.astype(np.int64)  # [T, L, K]
        raw_w = self._weights.astype(np.float64)  # [T, L, K]
        k_kept = min(top_k, self.top_k)
        ids = np.zeros((self.num_tokens, self.num_layers, top_k), np.int64)  # [T, L, k]
        weights = np.zeros((self.num_tokens, self.num_layers, top_k), np.float64)  # [T, L, k]
        # Fast path (most rows of a clean trace): first top_k entries present, no collisions after the modulo.
        head_ids = raw_ids[..., :k_kept] % num_experts  # [T, L, k']
        head_w = raw_w[..., :k_kept]  # [T, L, k']
        sorted_ids = np.sort(head_ids, axis=-1)
        clean = (
            (raw_ids[..., :k_kept] >= 0).all(-1)
            & np.isfinite(head_w).all(-1)
            & ~(np.diff(sorted_ids, axis=-1) == 0).any(-1)
            & (head_w.sum(-1) > 0)
        )  # [T, L]
        if k_kept < top_k:
            clean[:] = False
        else:
            ids[clean] = head_ids[clean]
            weights[clean] = head_w[clean] / head_w[clean].sum(-1, keepdims=True)
        for t, layer in np.argwhere(~clean).tolist():
            fill_start = t * _FILL_STRIDE_TOKEN + layer * _FILL_STRIDE_LAYER
            row_ids, row_w = _fit_row(
                raw_ids[t, layer].tolist(), raw_w[t, layer].tolist(), top_k, num_experts, fill_start
            )
            ids[t, layer] = row_ids
            weights[t, layer] = row_w
        ids.flags.writeable = False
        weights_f32 = weights.astype(np.float32)
        weights_f32.flags.writeable = False
        self._fitted[key] = (ids, weights_f32)
        return self._fitted[key]


def expert_hit_rate_lru(routes: np.ndarray | tuple[np.ndarray, np.ndarray], cache_experts_per_layer: int) -> float:
    """Hit rate of a per-layer LRU expert cache walking tokens in order (ids [N, M, k], or routes()' tuple).

    Each (token, layer, expert) is one access; negative ids are skipped. A quick sanity number, not a policy.
    """
    ids = routes[0] if isinstance(routes, tuple) else routes  # [N, M, k]
    ids = np.asarray(ids)
    if ids.ndim != 3:
        raise ConfigError(f"expert_hit_rate_lru: routes must be [N, M, k], got shape {ids.shape}")
    if (
        isinstance(cache_experts_per_layer, bool)
        or not isinstance(cache_experts_per_layer, int)
        or (cache_experts_per_layer < 1)
    ):
        raise ConfigError(
            f"expert_hit_rate_lru: cache_experts_per_layer must be an int >= 1, got {cache_experts_per_layer!r}"
        )
    hits = 0
    accesses = 0
    for layer in range(ids.shape[1]):
        cache: OrderedDict[int, None] = OrderedDict()
        for token_ids in ids[:, layer, :].tolist():
            for expert in token_ids:
                if expert < 0:
                    continue
                accesses += 1
                if expert in cache:
                    hits += 1
                    cache.move_to_end(expert)
                else:
                    cache[expert] = None
                    if len(cache) > cache_experts_per_layer:
                        cache.popitem(last=False)
    return hits / accesses if accesses else 0.0
