"""The oracle's candidate splits priced before any is measured: which of them the device runs.

Bench driver code (the `tierplan bench phase` process); pure Python over a dry replay (no engine, no clock, no
torch). The oracle is the best static split in hindsight; measuring every candidate costs a run each, and the
candidates far from the best cost the most: on the H100 (phase run 43, qwen3 b256 4K 40 GiB) the split giving KV
the batch's whole demand, one expert slot a layer, ran 134 s of the oracle's 198 s for 159 tok/s, against 450 for
the best candidate. So the search prices a wider pool of splits first and measures only the best few by that
price. Each candidate's schedule and access stream come from its dry replay (dry_record.py: the scheduler over its
KV share, the forced routes); each MoE layer's slots are run under Belady's rule over that stream at step
granularity (the experts a step needs stay, then those used soonest after: the oracle's own victim order,
oracle.py), giving each step's hits, misses and whether a decode step outruns a layer's slots (the engine then
runs it chunked off its graphs); the process's cost model (phase_predictor.Predictor, fitted on this process's runs)
prices each step from those and its tokens, context and the KV blocks its swaps move. The figure ranks splits; it
is never reported as a throughput. Replayed over the saved candidates of H100/H200 phase runs 26-45 (each file's
steps through a fresh cost model, the search's pool at three splits: the runs' own), the best priced was the best
measured at 29 of 31 points, the two best priced held it at 30 and one within 12 % at the 31st (b128 1K 24 GiB,
run 38); the one-slot splits were priced last at all four 4K points that ran them (measured 132-159 tok/s).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierplan.bench.baselines.base import ExpertFuture, Split


# A layer run in groups (its experts outnumber its slots) pays each group past the first a host round trip and
# its own GEMM launches, outside every term the cost model fits: on the H100 (phase run 44, qwen3 b256 4K 24
# GiB, one slot a layer) such decode steps took 369 ms with 123 ms of load stalls and ~520 groups, ~0.45 ms a
# group, which the fitted model priced at 140 ms. A bench constant for ranking candidates, not a measurement.
CHUNK_MS = 0.45


@dataclass(frozen=True)
class DryStep:
    """One step of a dry replay, as the runner would record it (bench/phase_run.py `StepRecord`)."""

    num_prefills: int
    num_decodes: int
    batch_tokens: int  # tokens computed: whole prompts plus one a decode
    context_tokens: int  # tokens attention reads
    # Blocks the step's swaps move, back in and out (no StepRecord field counts them: a run's records hold the
    # blocks fetched back and the link's bytes), priced as fetches.
    kv_moved_blocks: int

    @property
    def tokens_out(self) -> int:
        return self.num_prefills + self.num_decodes


@dataclass(frozen=True)
class LayerCounts:
    """A step's expert accesses over the MoE layers under Belady eviction."""

    hits: int
    misses: int
    over_slots: bool  # some layer needed more experts than its slots
    extra_chunks: int = 0  # over the layers that needed more than their slots: the groups past each one's first


def belady_counts(future: ExpertFuture, slots_per_layer: tuple[int, ...]) -> list[LayerCounts]:
    """Each step of `future` with `slots_per_layer[m]` slots in MoE layer m, starting empty: a layer's needed
    experts hit where resident, else load; after the step it keeps, of what it held and loaded, the experts used
    soonest after (never used again: last). A layer that needs more than its slots loads every expert it lacks
    and runs in groups of its slots (`extra_chunks` counts the groups past each such layer's first; the groups'
    reloads are left out: the oracle's victim order keeps the step's experts last)."""
    layers = len(slots_per_layer)
    held: list[set[int]] = [set() for _ in range(layers)]
    out = []
    for t, step in enumerate(future.steps):
        if len(step) != layers:
            raise ValueError(f"belady_counts: step {t} has {len(step)} MoE layers, the split {layers}")
        hits = misses = extra = 0
        for m, need in enumerate(step):
            cap = slots_per_layer[m]
            h = len(need & held[m])
            hits += h
            misses += len(need) - h
            if len(need) > cap:  # run in groups of `cap` (runtime/engine/moe.py), one after another
                extra += -(-len(need) // cap) - 1
            pool = held[m] | need
            if len(pool) > cap:
                pool = set(sorted(pool, key=lambda e, m=m: (future.next_use(m, e, t + 1), e))[:cap])
            held[m] = pool
        out.append(LayerCounts(hits, misses, extra > 0, extra))
    return out


def priced_steps(steps: list[DryStep], counts: list[LayerCounts]) -> list[SimpleNamespace]:
    """The replayed steps as the cost model's `Predictor.step_prices` reads measured ones: tokens, context, the
    KV blocks moved (priced as fetches), hits and misses, and a decode step over a layer's slots run chunked."""
    if len(steps) != len(counts):
        raise ValueError(f"priced_steps: {len(steps)} replayed steps, {len(counts)} recorded")
    return [SimpleNamespace(batch_tokens=s.batch_tokens, context_tokens=s.context_tokens,
                            kv_fetch={"cpu": s.kv_moved_blocks, "nvme": 0}, expert_hits=c.hits,
                            expert_misses=c.misses, expert_prefetch_hits=0, num_prefills=s.num_prefills,
                            executors={"eager/layer_over_slots": 1} if c.over_slots and not s.num_prefills else {})
            for s, c in zip(steps, counts, strict=True)]


def estimate_tok_s(predictor: Any, split: Split, future: ExpertFuture, steps: list[DryStep],
                   warm_steps: int) -> float:
    """The split's output tokens over its priced step time, past the first `warm_steps` (as a row measures):
    what ranks the oracle's candidates (0.0 where nothing is priced). Each group of a layer run in groups
    past its first pays CHUNK_MS besides."""
    counts = belady_counts(future, split.expert_slots_per_layer)
    warm = min(warm_steps, max(0, len(steps) - 1))  # as a row: a run shorter than its warm-up measures its last step
    timed = priced_steps(steps, counts)[warm:]
    ms = sum(predictor.step_prices(timed)) + CHUNK_MS * sum(c.extra_chunks for c in counts[warm:])
    return sum(s.tokens_out for s in steps[warm:]) / ms * 1e3 if ms > 0 else 0.0


def measure_order(labels: list[str], estimates: dict[str, float], saved: set[str]) -> list[str]:
    """The order the oracle tries candidates in until it has measured as many as it may: every one measured
    already (`saved`: an earlier call of the same code, resumed) in pool order, then the priced rest, best price
    first; a label not priced (its dry replay refused the split) is never tried."""
    first = [lb for lb in labels if lb in saved]
    return first + sorted((lb for lb in labels if lb in estimates and lb not in saved), key=lambda lb: -estimates[lb])
