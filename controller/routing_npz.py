"""Read and validate a normalized npz routing trace for the controller's predictors (pure numpy).

Runs in whatever process evaluates or trains demand models (the CLI, the controller). The layout is the one in
data/README.md: `expert_ids` int [T, L, k] (-1 = missing), `weights` float [T, L, k] (NaN = missing), `seq_id`
int [T], `pos` int [T] (>= 0), `phase` uint8 [T] (0 prefill, 1 decode), `layers` int [L]. `num_experts` comes
from `<stem>.meta.json` beside the npz when it names one, else max id + 1.

The rules follow the runtime's loader (runtime/engine/routing_trace.py), plus three the predictors need: ids
below num_experts, no negative `pos`, no id twice in one (token, layer) row. Integer and float fields may have
any width of their kind (they are cast to the npz dtypes). Never imports torch or the runtime, never fills or
repairs a row (a bad trace is refused, naming the field, the index and what was expected).

Shape letters: T tokens, L layers, K experts per token (the trace's top-k).
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGIC = b"PK"
_INT_FIELDS = {"expert_ids": np.int16, "seq_id": np.int32, "pos": np.int32, "phase": np.uint8, "layers": np.int32}
_SHAPES = {"expert_ids": "[T, L, K]", "weights": "[T, L, K]", "seq_id": "[T]", "pos": "[T]", "phase": "[T]",
           "layers": "[L]"}


class RoutingTraceError(ValueError):
    """A routing trace that cannot be used; the message says what, where and what was expected."""


@dataclass(frozen=True)
class RoutingNpz:
    """A validated trace; arrays are read-only. Missing ids are -1 only inside `expert_ids`."""

    expert_ids: np.ndarray  # [T, L, K] int16, -1 missing
    weights: np.ndarray  # [T, L, K] float32, NaN missing
    seq_id: np.ndarray  # [T] int32
    pos: np.ndarray  # [T] int32
    phase: np.ndarray  # [T] uint8
    layers: np.ndarray  # [L] int32 original layer numbers
    num_experts: int
    source: str

    @property
    def num_tokens(self) -> int:
        return int(self.expert_ids.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.expert_ids.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.expert_ids.shape[2])

    def row(self, token: int, layer: int) -> np.ndarray:
        """The present expert ids of one (token, layer), in the router's order."""
        ids = self.expert_ids[token, layer]  # [K]
        return ids[ids >= 0]


def _fail(where: str, detail: str) -> RoutingTraceError:
    return RoutingTraceError(f"routing trace {where}: {detail}")


def _check_kinds(arrays: dict[str, np.ndarray], where: str) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, shape_text in _SHAPES.items():
        if name not in arrays:
            raise _fail(where, f"missing array '{name}' (expected {shape_text}); found {sorted(arrays)}")
        arr = np.asarray(arrays[name])
        if name == "weights":
            if arr.dtype.kind != "f":
                raise _fail(where, f"array 'weights' must be floating point {shape_text}, got {arr.dtype}")
            out[name] = arr.astype(np.float32)
            continue
        dtype = _INT_FIELDS[name]
        if arr.dtype.kind not in "iu":
            raise _fail(where, f"array '{name}' must be integers {shape_text}, got {arr.dtype}")
        info = np.iinfo(dtype)
        if arr.size and (int(arr.min()) < info.min or int(arr.max()) > info.max):
            raise _fail(where, f"array '{name}' must fit {np.dtype(dtype)}, got range "
                               f"[{int(arr.min())}, {int(arr.max())}]")
        out[name] = arr.astype(dtype)
    return out


def _check_shapes(a: dict[str, np.ndarray], where: str) -> None:
    ids = a["expert_ids"]
    if ids.ndim != 3 or 0 in ids.shape:
        raise _fail(where, f"array 'expert_ids' must have shape [T, L, K] with T, L, K >= 1, got {ids.shape}")
    num_tokens, num_layers, _ = ids.shape
    expected = {"weights": ids.shape, "seq_id": (num_tokens,), "pos": (num_tokens,), "phase": (num_tokens,),
                "layers": (num_layers,)}
    for name, shape in expected.items():
        if a[name].shape != shape:
            raise _fail(where, f"array '{name}' must have shape {shape} (from expert_ids {ids.shape}), "
                               f"got {a[name].shape}")


def _check_values(a: dict[str, np.ndarray], num_experts: int, where: str) -> None:
    ids = a["expert_ids"]  # [T, L, K]
    if (ids < -1).any():
        t, layer, j = (int(x) for x in np.argwhere(ids < -1)[0])
        raise _fail(where, f"expert_ids[{t}, {layer}, {j}] = {int(ids[t, layer, j])}; expected an id >= 0 "
                           "or -1 (missing)")
    if not (ids >= 0).any():
        raise _fail(where, "array 'expert_ids' holds no expert id (all -1)")
    if (ids >= num_experts).any():
        t, layer, j = (int(x) for x in np.argwhere(ids >= num_experts)[0])
        raise _fail(where, f"expert_ids[{t}, {layer}, {j}] = {int(ids[t, layer, j])}; expected < num_experts "
                           f"{num_experts}")
    ordered = np.sort(ids, axis=-1)  # [T, L, K]
    dup = (np.diff(ordered, axis=-1) == 0) & (ordered[..., 1:] >= 0)  # [T, L, K-1]
    if dup.any():
        t, layer, j = (int(x) for x in np.argwhere(dup)[0])
        raise _fail(where, f"expert_ids[{t}, {layer}] names expert {int(ordered[t, layer, j + 1])} twice "
                           f"({ids[t, layer].tolist()}); expected distinct ids per (token, layer)")
    weights = a["weights"]
    bad = ~np.isnan(weights) & ~(np.isfinite(weights) & (weights >= 0))
    if bad.any():
        t, layer, j = (int(x) for x in np.argwhere(bad)[0])
        raise _fail(where, f"weights[{t}, {layer}, {j}] = {float(weights[t, layer, j])}; expected finite >= 0 "
                           "or NaN (missing)")
    if (a["pos"] < 0).any():
        t = int(np.argmax(a["pos"] < 0))
        raise _fail(where, f"pos[{t}] = {int(a['pos'][t])}; expected >= 0")
    bad_phase = ~np.isin(a["phase"], (0, 1))
    if bad_phase.any():
        t = int(np.argmax(bad_phase))
        raise _fail(where, f"phase[{t}] = {int(a['phase'][t])}; expected 0 (prefill) or 1 (decode)")


def routing_from_arrays(arrays: dict[str, np.ndarray], num_experts: int | None = None,
                        source: str = "<arrays>") -> RoutingNpz:
    """Validate arrays named as in the npz; `num_experts` None means max id + 1."""
    a = _check_kinds(arrays, source)
    _check_shapes(a, source)
    max_id = int(a["expert_ids"].max())
    if num_experts is None:
        num_experts = max(max_id + 1, 1)
    elif isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise _fail(source, f"num_experts must be an int >= 1, got {num_experts!r}")
    _check_values(a, num_experts, source)
    for arr in a.values():
        arr.flags.writeable = False
    return RoutingNpz(num_experts=num_experts, source=source, **a)


def synthetic_routing(expert_ids: np.ndarray, num_experts: int | None = None, source: str = "<synthetic>"
                      ) -> RoutingNpz:
    """A trace from ids alone (tests, synthetic streams): equal weights, one sequence, pos 0..T-1, prefill."""
    ids = np.asarray(expert_ids)
    num_tokens = ids.shape[0] if ids.ndim else 0
    num_layers = ids.shape[1] if ids.ndim > 1 else 0
    weights = np.where(ids >= 0, 1.0, np.nan).astype(np.float32)
    arrays = {"expert_ids": ids, "weights": weights, "seq_id": np.zeros(num_tokens, np.int32),
              "pos": np.arange(num_tokens, dtype=np.int32), "phase": np.zeros(num_tokens, np.uint8),
              "layers": np.arange(num_layers, dtype=np.int32)}
    return routing_from_arrays(arrays, num_experts, source)


def _meta_num_experts(meta_path: Path, where: str) -> int | None:
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(where, f"meta file {meta_path} is not readable JSON ({exc})") from None
    if not isinstance(meta, dict) or "num_experts" not in meta:
        return None
    value = meta["num_experts"]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(where, f"meta file {meta_path}: 'num_experts' must be an int >= 1, got {value!r}")
    return value


def load_routing_npz(path: str | Path) -> RoutingNpz:
    """Read and validate `path`; raises RoutingTraceError (a ValueError) naming what is wrong."""
    path = Path(path)
    where = str(path)
    if not path.exists():
        raise _fail(where, "file not found; expected a normalized .npz routing trace (data/README.md)")
    if not path.is_file():
        raise _fail(where, "not a regular file; expected a normalized .npz routing trace")
    if path.stat().st_size == 0:
        raise _fail(where, "file is empty (0 bytes); expected a normalized .npz routing trace")
    with path.open("rb") as fh:
        head = fh.read(len(_NPY_MAGIC))
    if head.startswith(_NPY_MAGIC):
        raise _fail(where, "is a single-array .npy file; expected an .npz archive holding expert_ids, weights, "
                           "seq_id, pos, phase, layers")
    if not head.startswith(_ZIP_MAGIC):
        raise _fail(where, "is not an .npz archive (no zip header); expected a normalized .npz routing trace")
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise _fail(where, f"not a readable .npz archive ({exc})") from None
    num_experts = _meta_num_experts(path.with_suffix(".meta.json"), where)
    return routing_from_arrays(arrays, num_experts, where)
