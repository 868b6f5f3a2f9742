"""Seeded, model-sized split problems for `tierplan plan bench` and the optimizer tests.

Runs in whatever process asks (the CLI, tests); pure numpy. Never imports torch, runtime or agent. It stands in
for what the loop builds from measured curves and the cost model, with the same shapes and units:
- per MoE layer, an LRU miss-ratio curve over resident slots 0..E at the predicted batch, made of a Zipf-like
  popularity part (concave) plus, on some layers, a cyclic working set that LRU misses entirely until it fits
  (a cliff: the non-concave case an equal-marginal greedy gets wrong);
- cost per layer = stall of streaming the non-resident part of the step's union, less the overlap with the
  previous layer's compute; link bytes = those misses times the expert record size;
- one KV group: GPU block counts in steps, cost = step time lost to a batch the blocks cannot admit plus KV
  fetches for the context kept off-GPU (which also cross the link);
- capacity = HBM budget - dense weights - activation workspace, in expert-slot units.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tierplan.controller.optimizer.problem import (
    Group,
    GroupKind,
    Option,
    SplitProblem,
    capacity_units_of,
    units_for_bytes,
)

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class BenchShape:
    """A Qwen3-30B-A3B-like deployment (defaults) on one GPU budget."""

    num_layers: int = 48
    num_experts: int = 128
    record_bytes: int = 9 * MIB  # one expert (gate/up/down, bf16) ~ 3 * 2048 * 768 * 2 bytes
    hbm_budget_bytes: int = 40 * GIB
    dense_bytes: int = 3 * GIB  # attention, norms, embeddings
    workspace_bytes: int = 2 * GIB
    batch: int = 16
    context_tokens: int = 4096
    kv_bytes_per_token: int = 48 * 4 * 128 * 2 * 2  # layers * kv heads * head dim * (K, V) * bf16
    block_tokens: int = 16
    kv_option_step_blocks: int = 128
    link_gb_per_s: float = 25.0
    layer_compute_ms: float = 0.35
    link_budget_bytes: int | None = 4_000_000_000  # per step: 25 GB/s over a 160 ms step


def _miss_ratio(rng: np.random.Generator, num_experts: int) -> np.ndarray:
    """[E + 1] miss ratio of the step's union with k = 0..E slots resident (non-increasing, maybe a cliff)."""
    k = np.arange(num_experts + 1)
    skew = rng.uniform(0.6, 1.3)
    pop = 1.0 / np.arange(1, num_experts + 1) ** skew
    pop /= pop.sum()
    zipf_miss = 1.0 - np.concatenate([[0.0], np.cumsum(pop)])
    if rng.random() < 0.4:  # a cyclic working set: LRU hits nothing of it until all of it fits
        width = int(rng.integers(num_experts // 8, num_experts * 3 // 4))
        share = rng.uniform(0.3, 0.8)
        cliff = np.where(k < width, 1.0, 0.05 * (1.0 - k / num_experts))
        miss = (1.0 - share) * zipf_miss + share * cliff
    else:
        miss = zipf_miss
    return np.clip(np.minimum.accumulate(miss), 0.0, 1.0)


def bench_problem(shape: BenchShape, seed: int = 0) -> SplitProblem:
    """One seeded problem of `shape` (see the module docstring)."""
    rng = np.random.default_rng(seed)
    E = shape.num_experts
    load_ms = shape.record_bytes / (shape.link_gb_per_s * 1e6)  # ms to stream one expert
    union_frac = 1.0 - (1.0 - 8.0 / E) ** shape.batch  # experts a step touches (top-8 routing, independent)
    groups = []
    for layer in range(shape.num_layers):
        union = E * union_frac * rng.uniform(0.8, 1.0)
        misses = union * _miss_ratio(rng, E)  # [E + 1]
        stall_ms = np.maximum(0.0, misses * load_ms - shape.layer_compute_ms)
        groups.append(Group.from_arrays(f"layer {layer}", np.arange(E + 1), stall_ms,
                                        (misses * shape.record_bytes).astype(np.int64),
                                        [f"{k} slots" for k in range(E + 1)]))
    groups.append(_kv_group(shape))
    capacity = capacity_units_of(shape.hbm_budget_bytes, shape.dense_bytes, shape.workspace_bytes,
                                 shape.record_bytes)
    return SplitProblem(tuple(groups), capacity, shape.record_bytes, shape.link_budget_bytes,
                        migration_ms_per_unit=0.0)


def _kv_group(shape: BenchShape) -> Group:
    block_bytes = shape.block_tokens * shape.kv_bytes_per_token
    blocks_per_seq = -(-shape.context_tokens // shape.block_tokens)
    need_blocks = shape.batch * blocks_per_seq
    step_ms = shape.num_layers * shape.layer_compute_ms
    options = []
    for blocks in range(blocks_per_seq, need_blocks + 1, shape.kv_option_step_blocks):
        admitted = blocks / blocks_per_seq  # sequences whose context fits on the GPU
        lost_ms = step_ms * (shape.batch / admitted - 1.0)  # the same tokens need more, smaller steps
        off_gpu_bytes = (need_blocks - blocks) * block_bytes
        fetch_bytes = int(0.02 * off_gpu_bytes)  # the share of off-GPU context re-read per step
        options.append(Option(units=units_for_bytes(blocks * block_bytes, shape.record_bytes),
                              cost_ms=float(lost_ms + fetch_bytes / (shape.link_gb_per_s * 1e6)),
                              link_bytes=fetch_bytes, label=f"{blocks} KV blocks"))
    group = Group("kv", tuple(options), kind=GroupKind.KV)
    group.arrays  # noqa: B018 - built here, as the loop would, not inside a timed solve
    return group
