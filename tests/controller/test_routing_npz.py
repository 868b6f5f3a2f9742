"""controller.routing_npz: the bundled sample loads; every kind of bad trace is refused with what and where."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tierplan.controller.routing_npz import RoutingTraceError, load_routing_npz, routing_from_arrays, synthetic_routing

SAMPLE = Path(__file__).parents[2] / "data" / "routing" / "flame_moe_290m_sample.npz"


def _arrays(num_tokens: int = 6, num_layers: int = 2, top_k: int = 2) -> dict[str, np.ndarray]:
    ids = np.stack([np.arange(top_k) + t % 3 for t in range(num_tokens)])  # [T, K]
    ids = np.repeat(ids[:, None, :], num_layers, axis=1).astype(np.int16)  # [T, L, K]
    return {"expert_ids": ids, "weights": np.full(ids.shape, 0.5, np.float32),
            "seq_id": np.zeros(num_tokens, np.int32), "pos": np.arange(num_tokens, dtype=np.int32),
            "phase": np.ones(num_tokens, np.uint8), "layers": np.arange(num_layers, dtype=np.int32)}


def test_bundled_sample_loads_with_meta_num_experts() -> None:
    trace = load_routing_npz(SAMPLE)
    assert (trace.num_tokens, trace.num_layers, trace.top_k, trace.num_experts) == (2048, 8, 6, 64)
    assert trace.row(0, 0).shape == (6,)
    assert not trace.expert_ids.flags.writeable


def test_num_experts_defaults_to_max_id_plus_one(tmp_path: Path) -> None:
    path = tmp_path / "t.npz"
    np.savez(path, **_arrays())
    assert load_routing_npz(path).num_experts == 4


def test_meta_num_experts_below_an_id_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.npz"
    np.savez(path, **_arrays())
    (tmp_path / "t.meta.json").write_text(json.dumps({"num_experts": 3}))
    with pytest.raises(RoutingTraceError, match=r"expert_ids\[2, 0, 1\] = 3; expected < num_experts 3"):
        load_routing_npz(path)


@pytest.mark.parametrize("make, message", [
    (lambda p: None, "file not found"),
    (lambda p: p.write_bytes(b""), "empty \\(0 bytes\\)"),
    (lambda p: np.save(p.open("wb"), np.zeros(3)), "single-array .npy"),
    (lambda p: p.write_text("hello"), "not an .npz archive"),
    (lambda p: p.write_bytes(b"PK\x03\x04garbage"), "not a readable .npz"),
])
def test_unreadable_files_are_refused(tmp_path: Path, make, message: str) -> None:
    path = tmp_path / "trace.npz"
    make(path)
    with pytest.raises(RoutingTraceError, match=message) as info:
        load_routing_npz(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)


def _broken(field: str, value) -> dict[str, np.ndarray]:
    a = _arrays()
    if value is None:
        del a[field]
    else:
        a[field] = value(a[field]) if callable(value) else value
    return a


def _set(index, value):
    def edit(arr: np.ndarray) -> np.ndarray:
        arr = arr.copy()
        arr[index] = value
        return arr
    return edit


@pytest.mark.parametrize("arrays, message", [
    (_broken("weights", None), "missing array 'weights'"),
    (_broken("expert_ids", lambda a: a[:, :, 0]), r"'expert_ids' must have shape \[T, L, K\]"),
    (_broken("pos", lambda a: a[:-1]), r"'pos' must have shape \(6,\)"),
    (_broken("layers", np.arange(3, dtype=np.int32)), r"'layers' must have shape \(2,\)"),
    (_broken("expert_ids", lambda a: a.astype(np.float32)), "'expert_ids' must be integers"),
    (_broken("weights", lambda a: a.astype(np.int32)), "'weights' must be floating point"),
    (_broken("expert_ids", _set((1, 1, 0), -2)), r"expert_ids\[1, 1, 0\] = -2"),
    (_broken("expert_ids", _set((1, 0, 0), 2)), r"expert_ids\[1, 0\] names expert 2 twice"),
    (_broken("expert_ids", np.full((6, 2, 2), -1, np.int16)), "no expert id"),
    (_broken("pos", _set(4, -1)), r"pos\[4\] = -1; expected >= 0"),
    (_broken("phase", _set(2, 7)), r"phase\[2\] = 7"),
    (_broken("weights", _set((0, 0, 0), np.inf)), r"weights\[0, 0, 0\] = inf"),
])
def test_bad_arrays_are_refused(arrays: dict[str, np.ndarray], message: str) -> None:
    with pytest.raises(RoutingTraceError, match=message):
        routing_from_arrays(arrays, source="x.npz")


def test_id_at_or_above_num_experts_is_refused() -> None:
    with pytest.raises(RoutingTraceError, match=r"expert_ids\[1, 0, 1\] = 2; expected < num_experts 2"):
        routing_from_arrays(_arrays(), num_experts=2)


def test_missing_entries_are_kept_as_minus_one() -> None:
    ids = np.array([[[0, -1]], [[1, 0]]])
    trace = synthetic_routing(ids)
    assert trace.row(0, 0).tolist() == [0]
    assert trace.num_experts == 2
