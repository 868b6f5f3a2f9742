"""Signal taps of the in-engine agent (inference process): what the controller learns from.

`RouterTap` is the model's route hook: it adds each layer's top-k choices into preallocated device
counters (expert activations, top-k co-occurrence, router entropy) in place, so the hot path never syncs
with the host. `TelemetryWindow` closes a window between steps: it copies the counters out, resets them,
and builds a `controller.protocol.Telemetry` together with step timings, stalls by cause (expert miss, KV
miss, both in one step), KV tier usage and hits, link statistics and fallback counters. Taps observe only;
they never move anything.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tierplan.agent.router_counts import RouterCounts
from tierplan.controller.protocol import (
    MAX_UNION_STEPS,
    BlockMass,
    KVStats,
    LayerStats,
    Link,
    LinkStats,
    ReuseEvent,
    Stall,
    StallCause,
    StepTimings,
    Telemetry,
    Tier,
)

MAX_COOCCURRENCE_EXPERTS = 256  # dense E x E counters above this would cost too much memory per layer
TOP_PAIRS = 64


class RouterTap:
    """The model's route hook: `__call__(layer, ids [N, k], weights [N, k])` only copies the rows into a
    preallocated device ring buffer (two copy kernels per MoE layer, no host sync). Every `capacity_rows`
    rows, and at `drain()`, all layers are folded at once into activation counts, top-k co-occurrence and
    router entropy (a handful of kernels for the whole model)."""

    def __init__(self, moe_layers: tuple[int, ...], num_experts: int, device: torch.device,
                 capacity_rows: int = 4096) -> None:
        self.index = {layer: i for i, layer in enumerate(moe_layers)}
        self.moe_layers, self.num_experts, self.device = moe_layers, num_experts, device
        self.capacity_rows = capacity_rows
        n = len(moe_layers)
        self.counts = torch.zeros(n, num_experts, dtype=torch.int64, device=device)  # [L, E]
        self.track_pairs = num_experts <= MAX_COOCCURRENCE_EXPERTS
        self.pairs = torch.zeros(n, num_experts * num_experts if self.track_pairs else 1, dtype=torch.int64,
                                 device=device)  # [L, E*E]
        self.entropy_sum = torch.zeros(n, dtype=torch.float64, device=device)  # [L]
        self.tokens = [0] * n  # host ints: row counts are known on the host, no sync needed
        self._ids: torch.Tensor | None = None  # [L, C, k] made on first use, when k is known
        self._w: torch.Tensor | None = None  # [L, C, k]
        self._fill = [0] * n

    def __call__(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        m = self.index[layer]
        n, k = ids.shape
        if self._ids is None or self._ids.shape[2] != k:
            self._fold()
            shape = (len(self.moe_layers), max(self.capacity_rows, n), k)
            with torch.inference_mode(False):  # a normal tensor: drain() folds it outside inference mode
                self._ids = torch.zeros(shape, dtype=torch.int64, device=ids.device)
                self._w = torch.zeros(shape, dtype=torch.float32, device=ids.device)
        if n > self._ids.shape[1]:  # a batch larger than the ring: fold it directly
            self._fold()
            self._accumulate(m, ids[None], weights.float()[None])
            self.tokens[m] += n
            return
        if self._fill[m] + n > self._ids.shape[1]:
            self._fold()
        f = self._fill[m]
        self._ids[m, f : f + n] = ids
        self._w[m, f : f + n] = weights
        self._fill[m] = f + n
        self.tokens[m] += n

    def add_all(self, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Every MoE layer's rows at once, ids/weights [L, n, k] (a CUDA-graph step's static router buffers,
        raw top-k probabilities): two copy kernels per step instead of two per layer."""
        n_layers, n, k = ids.shape
        if n_layers != len(self.moe_layers):
            raise ValueError(f"RouterTap.add_all: {n_layers} layers of routes, the model has {len(self.moe_layers)}")
        if self._ids is None or self._ids.shape[2] != k or n > self._ids.shape[1]:
            for m, layer in enumerate(self.moe_layers):  # first use, or a batch beyond the ring: per layer
                self(layer, ids[m], weights[m])
            return
        if len(set(self._fill)) != 1 or self._fill[0] + n > self._ids.shape[1]:
            self._fold()  # uneven (eager steps since) or full: empty the ring first
        f = self._fill[0]
        self._ids[:, f : f + n] = ids  # type: ignore[index]
        self._w[:, f : f + n] = weights  # type: ignore[index]
        self._fill = [f + n] * len(self._fill)
        self.tokens = [t + n for t in self.tokens]

    def _accumulate(self, m: int | slice, ids: torch.Tensor, w: torch.Tensor) -> None:
        """Fold rows ids/w [L', R, k] (padding rows carry weight 0 and are masked) into layer(s) m."""
        e = self.num_experts
        live = w.sum(-1) > 0  # [L', R] rows actually written
        flat = torch.where(live[..., None], ids, 0)  # [L', R, k]
        one = live[..., None].expand_as(ids).to(torch.int64)
        self.counts[m].view(-1, e).scatter_add_(1, flat.flatten(1), one.flatten(1))
        k = ids.shape[-1]
        if self.track_pairs and k > 1:
            i, j = torch.triu_indices(k, k, 1, device=ids.device)  # [2, P]
            a, b = torch.minimum(flat[..., i], flat[..., j]), torch.maximum(flat[..., i], flat[..., j])
            pone = live[..., None].expand_as(a).to(torch.int64)
            self.pairs[m].view(-1, self.pairs.shape[-1]).scatter_add_(1, (a * e + b).flatten(1), pone.flatten(1))
        p = w / w.sum(-1, keepdim=True).clamp_min(1e-12)  # [L', R, k]
        ent = -(p * p.clamp_min(1e-12).log()).sum(-1)  # [L', R]
        self.entropy_sum[m] += torch.where(live, ent, 0.0).sum(-1).to(torch.float64).view(self.entropy_sum[m].shape)

    def _fold(self) -> None:
        """Aggregate everything in the ring for all layers at once, then empty it."""
        if self._ids is None or not any(self._fill):
            return
        r = max(self._fill)
        self._accumulate(slice(None), self._ids[:, :r], self._w[:, :r])
        self._w[:, :r].zero_()  # zero weight marks a row as empty for the next fold
        self._fill = [0] * len(self._fill)

    def snapshot(self) -> RouterCounts:
        """Engine thread, between steps: fold the ring, pick each layer's top pairs on the device, copy the
        counters to the host as numpy arrays and reset them (the window's only host sync). Building the
        messages from them (`RouterCounts.layer_stats`) is left to whoever sends them."""
        self._fold()
        n_pairs = min(TOP_PAIRS, self.pairs.shape[1]) if self.track_pairs else 0
        top_c, top_f = torch.topk(self.pairs, n_pairs, dim=1) if n_pairs else (self.pairs[:, :0], self.pairs[:, :0])
        n_l, e = self.counts.shape
        # One packed copy to the host (one sync, not four); float64 holds these counts exactly. A new tensor,
        # so on the CPU twin nothing aliases the counters zeroed below.
        packed = torch.cat([self.counts.flatten().double(), top_c.flatten().double(), top_f.flatten().double(),
                            self.entropy_sum.double()]).cpu().numpy()  # [L*E + 2*L*P + L]
        cut = (n_l * e, n_l * e + n_l * n_pairs, n_l * e + 2 * n_l * n_pairs)
        counts, tc, tf, ent = (packed[:cut[0]], packed[cut[0]:cut[1]], packed[cut[1]:cut[2]], packed[cut[2]:])
        snap = RouterCounts(self.moe_layers, self.num_experts, counts.astype("int64").reshape(n_l, e),
                            tc.astype("int64").reshape(n_l, n_pairs), tf.astype("int64").reshape(n_l, n_pairs),
                            ent.copy(), list(self.tokens))
        for t in (self.counts, self.pairs, self.entropy_sum):
            t.zero_()
        self.tokens = [0] * len(self.tokens)
        return snap

    def drain(self) -> list[LayerStats]:
        """`snapshot()` and build the per-layer messages at once (validated)."""
        return self.snapshot().layer_stats()


class AttentionMassTap:
    """Samples attention mass per KV block: on every `every_steps`-th step, the first sequence seen in each
    watched layer gets its last query's attention summed per block (computed beside the kernel, rarely).
    Results stay on the device until `drain()` at the window's end."""

    def __init__(self, layers: tuple[int, ...], every_steps: int = 8) -> None:
        self.layers, self.every_steps = set(layers), max(1, every_steps)
        self._sampling = False
        self._taken: set[int] = set()
        self._pending: list[tuple[list[int], torch.Tensor]] = []

    def begin_step(self, step: int) -> None:
        self._sampling = step % self.every_steps == 0
        self._taken.clear()

    def wants(self, layer: int, seq_id: int) -> bool:
        if not self._sampling or layer not in self.layers or layer in self._taken:
            return False
        self._taken.add(layer)
        return True

    def record(self, layer: int, block_ids: list[int], mass: torch.Tensor) -> None:
        self._pending.append((list(block_ids), mass.detach()))

    def snapshot(self) -> dict[int, list[float]]:
        """Engine thread: the window's samples on the host, block id -> masses (clamped to [0, 1])."""
        acc: dict[int, list[float]] = {}
        for ids, mass in self._pending:
            for b, m in zip(ids, mass.tolist(), strict=True):
                acc.setdefault(b, []).append(min(1.0, max(0.0, m)))
        self._pending.clear()
        return acc

    @staticmethod
    def block_mass(acc: dict[int, list[float]]) -> tuple[BlockMass, ...]:
        return tuple(BlockMass(block=b, mass=math.fsum(v) / len(v), samples=len(v)) for b, v in sorted(acc.items()))

    def drain(self) -> tuple[BlockMass, ...]:
        return self.block_mass(self.snapshot())


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


class TelemetryWindow:
    """Accumulates one window of step observations; `close()` returns the Telemetry and starts the next."""

    def __init__(self, agent_id: str, rank: int, model: str, num_layers: int, num_experts: int, tap: RouterTap,
                 clock: Callable[[], float], mass_tap: AttentionMassTap | None = None) -> None:
        self.agent_id, self.rank, self.model = agent_id, rank, model
        self.num_layers, self.num_experts, self.tap, self.clock = num_layers, num_experts, tap, clock
        self.mass_tap = mass_tap
        self.seq = 0
        # Steps whose decode tokens were not within their tokens (their window sent no split): a running total,
        # as the hub reads every fallback count.
        self.decode_split_refused = 0
        self._reset()

    def restart(self) -> None:
        """Forget everything observed and start again at window 0 (after a warm-up window)."""
        self.seq = 0
        self._reset()

    def _reset(self) -> None:
        self.start_s = self.clock()
        self.step_ms: list[float] = []
        self.step_tokens: list[int | None] = []
        self.step_decode_tokens: list[int | None] = []
        self.chunked_steps = 0
        self.stalls = {c: [0, 0.0] for c in StallCause}

    def observe_step(self, step_s: float, expert_stall_s: float, kv_stall_s: float,
                     tokens: int | None = None, decode_tokens: int | None = None, chunked: bool = False) -> None:
        """Record one step: its duration, how long it waited on expert loads and on KV fetches, its tokens and of
        them those of decoding sequences (None where the adapter cannot tell: then the window reports none), and
        whether it ran chunked off its graphs because a layer's experts did not fit its slots at once."""
        self.step_ms.append(step_s * 1e3)
        self.chunked_steps += int(chunked)
        self.step_tokens.append(tokens)
        bad = tokens is not None and decode_tokens is not None and not 0 <= decode_tokens <= tokens
        self.decode_split_refused += int(bad)  # the adapter's count cannot be a share of the step's: not sent
        self.step_decode_tokens.append(None if tokens is None or bad else decode_tokens)
        if expert_stall_s > 0 and kv_stall_s > 0:
            cause, ms = StallCause.BOTH, (expert_stall_s + kv_stall_s) * 1e3
        elif expert_stall_s > 0:
            cause, ms = StallCause.EXPERT_MISS, expert_stall_s * 1e3
        elif kv_stall_s > 0:
            cause, ms = StallCause.KV_MISS, kv_stall_s * 1e3
        else:
            return
        self.stalls[cause][0] += 1
        self.stalls[cause][1] += ms

    def close(self, kv_blocks: dict[str, int], kv_hits: dict[str, int], kv_misses: dict[str, int],
              links: dict[str, dict[str, float]], expert_hits: int, expert_misses: int, plan_version: int,
              fallbacks: dict[str, int]) -> Telemetry:
        """Close the window and build its message here (see `close_draft` for the split)."""
        return self.close_draft(kv_blocks, kv_hits, kv_misses, links, expert_hits, expert_misses, plan_version,
                                fallbacks).build()

    def close_draft(self, kv_blocks: dict[str, int], kv_hits: dict[str, int], kv_misses: dict[str, int],
                    links: dict[str, dict[str, float]], expert_hits: int, expert_misses: int, plan_version: int,
                    fallbacks: dict[str, int]) -> WindowDraft:
        """Engine thread: snapshot the taps and start the next window; `WindowDraft.build()` makes the
        Telemetry (pydantic validation: ~10 ms for a 48-layer model, so the adapter does it off this thread)."""
        now = self.clock()
        steps = self.step_ms
        known = [t for t in self.step_tokens[-MAX_UNION_STEPS:] if t is not None]
        decodes = [t for t in self.step_decode_tokens[-MAX_UNION_STEPS:] if t is not None]
        every = min(len(steps), MAX_UNION_STEPS)
        draft = WindowDraft(
            fields=dict(agent_id=self.agent_id, rank=self.rank, window_seq=self.seq, window_start_s=self.start_s,
                        window_end_s=max(now, self.start_s), model=self.model, num_layers=self.num_layers,
                        num_experts=self.num_experts, expert_hits=expert_hits, expert_misses=expert_misses,
                        applied_plan_version=plan_version, fallbacks=dict(fallbacks) | (
                            {"decode_split_refused": self.decode_split_refused} if self.decode_split_refused else {})),
            router=self.tap.snapshot(), mass=self.mass_tap.snapshot() if self.mass_tap is not None else {},
            kv=(dict(kv_blocks), dict(kv_hits), dict(kv_misses)), links={k: dict(v) for k, v in links.items()},
            stalls={c: tuple(v) for c, v in self.stalls.items() if v[0]},
            steps_ms=(len(steps), math.fsum(steps) / len(steps) if steps else 0.0, _pct(steps, 0.5),
                      _pct(steps, 0.99)),
            step_tokens=tuple(known) if len(known) == every else (),
            step_decode_tokens=tuple(decodes) if len(known) == every and len(decodes) == every else (),
            chunked_steps=self.chunked_steps)
        self.seq += 1
        self._reset()
        return draft


@dataclass(frozen=True)
class WindowDraft:
    """A closed window as plain host values; `build()` validates it into a `Telemetry` (any thread)."""

    fields: dict[str, Any]
    router: RouterCounts
    mass: dict[int, list[float]]
    kv: tuple[dict[str, int], dict[str, int], dict[str, int]]  # blocks, hits, misses per tier
    links: dict[str, dict[str, float]]
    stalls: dict[StallCause, tuple[int, float]]
    steps_ms: tuple[int, float, float, float]  # count, mean, p50, p99
    step_tokens: tuple[int, ...] = ()  # each step's tokens (the newest MAX_UNION_STEPS), or none
    step_decode_tokens: tuple[int, ...] = ()  # of them, each step's decoding sequences' tokens, or none
    chunked_steps: int = 0  # steps run chunked off their graphs (a layer's experts over its slots)
    reuse: tuple[tuple[str, float, str], ...] = ()  # KV reuse events: prefix hash, age in seconds, tier name
    deferred: tuple[Callable[[], dict[str, Any]], ...] = ()  # more fields, made at build (off the engine thread)

    def build(self, between_layers: Callable[[], None] | None = None) -> Telemetry:
        """The Telemetry of this window (any thread). The per-layer parts are checked on the arrays at once
        and built without re-validation (`RouterCounts.layer_stats(trusted=True)`: about half the host time of
        validating them, bench/results/design_notes.md); the message around them is validated. `between_layers` runs
        after each layer (the outbox yields the GIL there)."""
        layers = self.router.layer_stats(trusted=True, between_layers=between_layers)
        fields = dict(self.fields)
        for more in self.deferred:
            fields.update(more())
            if between_layers is not None:
                between_layers()
        blocks, hits, misses = self.kv
        n, mean, p50, p99 = self.steps_ms
        return Telemetry(
            **fields, layers=tuple(layers),
            kv=KVStats(blocks_per_tier={Tier(k): v for k, v in blocks.items()},
                       hits_per_tier={Tier(k): v for k, v in hits.items()},
                       misses_per_tier={Tier(k): v for k, v in misses.items()},
                       attention_mass=AttentionMassTap.block_mass(self.mass),
                       reuse_events=tuple(ReuseEvent(prefix_hash=h, age_s=a, tier=Tier(t)) for h, a, t in self.reuse)),
            links=tuple(LinkStats(link=Link(k), bytes=int(v["bytes"]), queue_delay_ms_mean=v["queue_delay_ms_mean"],
                                  queue_delay_ms_max=max(v["queue_delay_ms_max"], v["queue_delay_ms_mean"]))
                        for k, v in self.links.items()),
            stalls=tuple(Stall(cause=c, count=cnt, total_ms=ms) for c, (cnt, ms) in self.stalls.items()),
            step_timings_ms=StepTimings(num_steps=n, mean=mean, p50=p50, p99=p99), step_tokens=self.step_tokens,
            step_decode_tokens=self.step_decode_tokens, chunked_steps=self.chunked_steps,
            # v3 only where a v3 field is sent: an agent that reports neither still talks to an older controller
            schema_version=3 if self.step_decode_tokens or self.chunked_steps or fields.get("expert_slots") else 2,
        )
