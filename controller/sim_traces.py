"""The simulator's inputs: a routing trace (npz) fitted to a model's experts, and a request trace (Mooncake
jsonl or synthetic).

Runs in `tierplan sim` (and tests). Pure numpy + stdlib. The npz layout is data/README.md's: `expert_ids`
int16 [T, L, K] (-1 missing) and `weights` [T, L, K]; fitting to (top_k, num_experts) follows the reference
engine's replay (runtime/engine/routing_trace.py): each row keeps its first top_k present ids, taken modulo
num_experts, a repeat moving to the next unused id, missing ones filled after the last id. Token `pos` of
sequence `seq` reads trace row (seq * 997 + pos) % 4096 % T, as the engine's ForcedRouter does. Every refusal is a
`TraceError` naming the file, the field and what was expected; nothing here keeps global state.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

ROW_STRIDE = 997  # the engine's ForcedRouter: a sequence walks the trace in order from its own offset
ROUTER_HORIZON_TOKENS = 4096  # ForcedRouter's default horizon: rows wrap at it, then at the trace's length
_FILL_STRIDE_TOKEN, _FILL_STRIDE_LAYER = 7919, 104729  # as the engine: spread fills of all-missing rows


class TraceError(ValueError):
    """A trace file cannot be used (the message says which, where and why)."""


def _fit_row(ids: list[int], top_k: int, num_experts: int, fill_start: int) -> list[int]:
    used: set[int] = set()

    def take(start: int) -> int:
        c = start % num_experts
        while c in used:
            c = (c + 1) % num_experts
        used.add(c)
        return c

    out = [take(e) for e in [e for e in ids if e >= 0][:top_k]]
    nxt = out[-1] + 1 if out else fill_start
    while len(out) < top_k:
        out.append(take(nxt))
        nxt = out[-1] + 1
    return out


@dataclass(frozen=True)
class RoutingTrace:
    ids: np.ndarray  # [T, M, k] int64: fitted expert ids per trace token and model MoE layer
    source: str

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    def rows(self, seq_pos: list[tuple[int, int]]) -> np.ndarray:
        """Fitted ids [N, M, k] of the tokens at these (sequence, position) pairs."""
        pairs = np.asarray(seq_pos, dtype=np.int64).reshape(-1, 2)  # [N, 2]
        return self.ids[(pairs[:, 0] * ROW_STRIDE + pairs[:, 1]) % ROUTER_HORIZON_TOKENS % self.num_tokens]

    def span_row_index(self, spans: list[tuple[int, int, int]]) -> np.ndarray:
        """Trace rows [N] of every token of (sequence, first position, num tokens) spans, in order."""
        if not spans:
            return np.zeros(0, np.int64)
        sp = np.asarray(spans, dtype=np.int64)  # [S, 3]
        seq = np.repeat(sp[:, 0], sp[:, 2])  # [N]
        first = np.repeat(sp[:, 1] - np.cumsum(sp[:, 2]) + sp[:, 2], sp[:, 2])  # [N]: span start minus its offset
        pos = first + np.arange(seq.size)  # [N]
        return (seq * ROW_STRIDE + pos) % ROUTER_HORIZON_TOKENS % self.num_tokens


def load_routing(path: str | Path, num_moe_layers: int, top_k: int, num_experts: int) -> RoutingTrace:
    """The npz at `path`, fitted to a model's MoE layers (model layer m reads trace layer m % L)."""
    p = Path(path)
    try:
        with np.load(p, allow_pickle=False) as z:
            if "expert_ids" not in z.files:
                raise TraceError(f"routing trace {p}: missing array 'expert_ids' (found {sorted(z.files)})")
            raw = np.asarray(z["expert_ids"])
    except FileNotFoundError:
        raise TraceError(f"routing trace {p}: no such file") from None
    except (OSError, ValueError) as e:
        if isinstance(e, TraceError):
            raise
        raise TraceError(f"routing trace {p}: not a readable npz ({e})") from None
    if raw.ndim != 3 or raw.shape[0] == 0 or not np.issubdtype(raw.dtype, np.integer):
        raise TraceError(f"routing trace {p}: 'expert_ids' must be an integer array [T, L, K] with T >= 1, got "
                         f"{raw.dtype} {raw.shape}")
    raw = raw.astype(np.int64)
    t, num_layers, k_raw = raw.shape
    layer_idx = np.arange(num_moe_layers) % num_layers  # [M]
    k_kept = min(top_k, k_raw)
    head = raw[..., :k_kept]  # [T, L, k']
    fitted = np.zeros((t, num_layers, top_k), np.int64)  # [T, L, k]
    mod = head % num_experts
    srt = np.sort(mod, axis=-1)
    clean = (head >= 0).all(-1) & ~(np.diff(srt, axis=-1) == 0).any(-1) & (k_kept == top_k)  # [T, L]
    if k_kept == top_k:
        fitted[clean] = mod[clean]
    for ti, li in np.argwhere(~clean).tolist():
        fill = ti * _FILL_STRIDE_TOKEN + li * _FILL_STRIDE_LAYER
        fitted[ti, li] = _fit_row(raw[ti, li].tolist(), top_k, num_experts, fill)
    ids = fitted[:, layer_idx]  # [T, M, k]
    ids.flags.writeable = False
    return RoutingTrace(ids, str(p))


@dataclass(frozen=True)
class SimRequest:
    request_id: int
    arrival_s: float
    prompt_len: int
    output_len: int


def load_mooncake(path: str | Path, limit: int | None = None, time_scale: float = 1.0) -> list[SimRequest]:
    """Mooncake jsonl (`timestamp` ms, `input_length`, `output_length`), arrivals times `time_scale`."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise TraceError(f"request trace {p}: no such file") from None
    except UnicodeDecodeError:
        raise TraceError(f"request trace {p}: not UTF-8 text (expected Mooncake jsonl)") from None
    out: list[SimRequest] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if limit is not None and len(out) >= limit:
            break
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"request trace {p}: line {n} is not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise TraceError(f"request trace {p}: line {n} must be a JSON object, got {type(row).__name__}")
        vals = []
        for key, low in (("timestamp", 0), ("input_length", 1), ("output_length", 1)):
            v = row.get(key)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < low:
                raise TraceError(f"request trace {p}: line {n} field '{key}' must be a number >= {low}, got {v!r}")
            vals.append(v)
        out.append(SimRequest(len(out), vals[0] / 1e3 * time_scale, int(vals[1]), int(vals[2])))
    if not out:
        raise TraceError(f"request trace {p}: no requests")
    return out


def scale_requests(reqs: list[SimRequest], max_prompt_len: int, max_output_len: int) -> list[SimRequest]:
    """Lengths scaled by one factor per kind so the longest fits (the engine's workloads.scale_requests)."""
    pf = min(1.0, max_prompt_len / max(r.prompt_len for r in reqs))
    of = min(1.0, max_output_len / max(r.output_len for r in reqs))
    return [replace(r, prompt_len=min(max_prompt_len, max(1, round(r.prompt_len * pf))),
                    output_len=min(max_output_len, max(1, round(r.output_len * of)))) for r in reqs]


def synthetic_requests(num: int, rate_per_s: float, prompt_len: int, output_len: int, seed: int = 0
                       ) -> list[SimRequest]:
    """Poisson arrivals, lengths drawn around the given means (geometric-like spread, at least 1)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate_per_s, num))
    prompts = np.maximum(1, rng.exponential(prompt_len, num).round()).astype(int)
    outputs = np.maximum(1, rng.exponential(output_len, num).round()).astype(int)
    return [SimRequest(i, float(a), int(p), int(o)) for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs,
                                                                                        strict=True))]
