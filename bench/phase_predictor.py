"""The phase rows' cost model: a step's price from the controller's cost model, fitted step by step on the runs.

Runs in the bench process (`tierplan bench phase`: each row's `predicted_step_ms`, bench/phase_metrics.py; the
oracle's candidate ranking, bench/oracle_estimate.py) and offline (the replay of saved steps,
bench/phase_cost_replay.py); pure Python + numpy over the runner's step records (no torch). `Predictor` holds one
model's fits (decode steps and prefill steps apart), the excess of a step that opens a telemetry window, the time a
plan's KV eviction costs a block, and the forced router's table; `plan_step_prices` prices steps at the split of
the plan each ran under, at the misses the engine's expert residency makes there (bench/phase_residency.py). How
far ahead a row prices: bench/phase_pricing.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tierplan.bench.phase_residency import StepLoads, replay_loads
from tierplan.controller.costmodel import CostModel, HardwareSpec, StepLoad
from tierplan.controller.model_shape import ModelShape
from tierplan.controller.protocol import Link

TRANSFER_OVERHEAD_PRIOR_S = 1e-4  # per record, before calibration (the cost model fits it from the steps)
# The fit is per step, over observations a window's means would blur (a window's mean step runs neither a
# prefill's active experts nor a decode's): replayed over one CPU quick sweep's steps, pricing the measured
# misses, 103 of 160 runs within 15 % fitted per step, 90 fitted per window (bench/results/phase_h200.md,
# "Session 18"). Its memory is ~100 steps, shorter than the controller's (0.98 a window of 8, 0.9975 a step): one
# process runs policy after policy, each its own mix of misses and active experts, and the next run is priced by
# the fit of the last ones. Replayed over the H100/H200 phase steps of runs 01-40 (session 24): 146 of 225 runs
# within 15 % at 0.99, 142 at 0.98, 138 at 0.995, 128 at 0.9975 (chosen on those steps: a later sweep says
# whether it holds).
STEP_FORGETTING = 0.99
# A step counts less once it falls this many median absolute residuals from the fit (the controller's windows:
# 1.5, controller/costmodel_fit.py). What a row predicts is its steps' mean, slow ones included: a window's first
# step building its telemetry (1.5-4 ms over the rest on the H100, session 38), a collection, a link that slowed;
# fitted at 1.5 they hardly counted and the prices ran low (at the measured misses, the median run 0.96 of its
# measured step, 197 of 948 runs under by > 15 %, 82 over). Replayed over runs 01-73 with the two fits: 695 runs
# within 15 % at 3 and at 4, 694 at 6, 685 at 2, 669 at 1.5; unweighted, 597 (286 over).
STEP_HUBER_K = 3.0
# A plan that evicts GPU KV blocks moves them to the host before the next step: each such plan change measured is
# an observation of the time a block costs (H100/H200 phase runs 29-45: 0.17-0.50 ms a block where over 1,000 moved,
# against ~5 us of link bytes; a change moving a few blocks also pays its expert remaps, up to ~100 ms);
# the newer ones weigh more, as the fit's steps do.
EVICT_FORGETTING = 0.9
# A decode step that opens a telemetry window pays for the window that closed before it (the adapter snapshots the
# taps between the steps, the outbox thread builds the message beside the forward): on the H100 (runs 69-73) such
# steps took 2-9 ms over their window's other steps, the static policies' most (kv_tiering at b1 16K 56 GiB: 12.0 ms
# against 3.6), none of it in a term the fit has, so its outlier cut left it out and the prices ran low. Those steps
# are priced at the fit plus this excess, learned apart (the newer windows weigh more), and kept out of the fit.
# Replayed window by window over runs 01-73 (session 39): 871 of 948 runs within 15 % at the measured misses with
# the term at 0.2, 811 without it.
WINDOW_OPEN_RATE = 0.2


@dataclass(frozen=True)
class WindowPlaces:
    """Where a list of one run's steps lies in its telemetry windows: `start`, the run's index of the list's first
    step; `window_steps`, the run's window (0: none). The adapter closes a window after each `window_steps`-th step,
    so a step at a multiple of it (the first excepted) is the first after a close."""

    start: int
    window_steps: int

    def opens(self, j: int) -> bool:
        """Whether the list's step `j` is the first step after a window closed."""
        i = self.start + j
        return self.window_steps > 1 and i > 0 and i % self.window_steps == 0



def mean_of(xs: list[float]) -> float | None:
    """The mean of `xs` (None where empty)."""
    return sum(xs) / len(xs) if xs else None


# Why a prefill's steps have their own fit (`Predictor.prefill`): one fit over both kinds, with ~100 steps of
# memory, saw a point's few large eager steps beside its many small graph replays, gave the per-token and
# per-expert terms what the decode steps' fixed cost is (its fixed terms clamped at zero), and priced a b1 decode
# step of 3.3 ms at 1.4. Replayed over the H100/H200 phase steps of runs 01-73 (session 38): 669 of 948 runs within
# 15 % with two fits, 644 with one (tierplan, each point's first policy: 73 of 137 against 63); the decode steps
# alone 474 of 869 runs against 452. A fit over those steps of one code on one H100 (runs 69-73) prices 85 of 94
# runs' decode steps within 15 % with the same four terms: what is left is the online fit's, not the terms'.
@dataclass
class Predictor:
    """The cost model per model in this process, calibrated as the runs go, and the forced router's table the
    engine's expert residency is replayed over (`loads_at`). The model is fitted twice, on the decode steps
    (`cost`: CUDA graph replays, or chunked off them) and on the steps that hold a prefill (`prefill`: run eagerly),
    and each step is priced by its own kind's fit (`model_for`): one fit over both explained a prefill's thousands
    of tokens and a decode step's fixed cost with the same coefficients, and its fixed terms went to zero
    (the comment above)."""

    cost: CostModel  # the decode steps' fit (and the link, shape and priors every price reads)
    kv_block_bytes: int
    ids_host: np.ndarray | None = None  # the forced router's table [T, L_moe, k]
    prefill: CostModel | None = None  # the fit of steps holding a prefill (None: `cost` prices them too)
    _evict_sum: float = 0.0  # ms outside the forward at plan changes that evicted KV blocks, forgetting older ones
    _evict_blocks: float = 0.0  # the blocks they evicted, forgotten alike
    _window_open_ms: float | None = None  # a window-opening decode step's cycle over its price (None: none seen)

    @classmethod
    def for_model(cls, h: Any) -> Predictor:
        spec = h.spec
        shape = ModelShape(name=spec.name, num_layers=spec.num_layers, moe_layers=tuple(spec.moe_layers),
                           num_experts=spec.num_experts, top_k=spec.top_k, expert_bytes=h.stride_bytes, dense_bytes=0,
                           kv_bytes_per_token=max(1, h.kv_block_bytes // h.block_tokens), block_tokens=h.block_tokens)
        # The measured memory bandwidth gives each active expert's compute its prior, as for the live controllers
        # (tierplan_live.active_expert_prior_ms): a term no window can move where the active experts never vary.
        return cls.for_shape(shape, h.kv_block_bytes, h.link_bytes_per_s, getattr(h, "memory_bytes_per_s", 0.0),
                             getattr(h.router, "ids_host", None), name=str(h.dev.torch_device))

    @classmethod
    def for_shape(cls, shape: ModelShape, kv_block_bytes: int, link_bytes_per_s: float,
                  memory_bytes_per_s: float = 0.0, ids_host: np.ndarray | None = None, name: str = "") -> Predictor:
        """A fresh predictor with the rows' priors: every link at `link_bytes_per_s`, the per-record prior, the
        step-by-step forgetting (a saved process replayed offline builds it from its steps: phase_cost_replay)."""
        hw = HardwareSpec(link_bytes_per_s=dict.fromkeys(Link, link_bytes_per_s),
                          transfer_overhead_s=TRANSFER_OVERHEAD_PRIOR_S, hbm_bytes=0, name=name,
                          hbm_bytes_per_s=memory_bytes_per_s)
        return cls(CostModel(shape, hw, forgetting=STEP_FORGETTING, huber_k=STEP_HUBER_K), kv_block_bytes, ids_host,
                   prefill=CostModel(shape, hw, forgetting=STEP_FORGETTING, huber_k=STEP_HUBER_K))

    def model_for(self, step: Any) -> CostModel:
        """The fit that prices (and learns from) `step`: `prefill` for a step holding a prefill, else `cost`."""
        return self.prefill if self.prefill is not None and getattr(step, "num_prefills", 0) else self.cost

    def calibrate(self, steps: list[Any], before: Any = None, places: WindowPlaces | None = None) -> None:
        """Fold measured steps (StepRecords) into the cost model, one observation each: the cycle less its
        stalls against its tokens, context, distinct experts (hits + misses over the MoE layers) and whether it
        ran chunked, and the stalls against its demand loads (expert misses, KV blocks fetched back) and their
        bytes. A step a new plan took effect at whose plan moved GPU KV blocks to the host (`plan_evictions`;
        `before`: the step before the first, of the same run) spent its cycle outside the forward on them: that
        time goes to the price of a block a plan evicts (`evict_ms_per_block`), not to compute. A decode step
        that opens a telemetry window (`places`) teaches the window's excess over the fit's price
        (`WINDOW_OPEN_RATE`), not the fit."""
        eb = self.cost.shape.expert_bytes
        for j, s in enumerate(steps):
            kv = sum(s.kv_fetch.values())
            stall = s.expert_stall_ms + s.kv_stall_ms
            applied_ms = 0.0
            if (evicted := plan_evictions(s, before, self.kv_block_bytes)) > 0:
                applied_ms = max(0.0, (s.cycle_s - s.step_s) * 1e3)
                self._evict_sum = EVICT_FORGETTING * self._evict_sum + applied_ms
                self._evict_blocks = EVICT_FORGETTING * self._evict_blocks + evicted
            elif self.opens(s, j, places):
                excess = s.cycle_s * 1e3 - self._fit_price(s)
                last = self._window_open_ms
                self._window_open_ms = excess if last is None else last + WINDOW_OPEN_RATE * (excess - last)
                before = s
                continue
            self.model_for(s).observe(s.batch_tokens, s.context_tokens, s.expert_hits + s.expert_misses,
                              s.cycle_s * 1e3 - stall - applied_ms, s.expert_misses + kv,
                              s.expert_misses * eb + kv * self.kv_block_bytes, stall, expert_misses=s.expert_misses,
                              chunked=float(ran_chunked(s)))
            before = s

    @staticmethod
    def opens(step: Any, j: int, places: WindowPlaces | None) -> bool:
        """Whether `step`, the `j`-th of a list at `places`, is a decode step opening a telemetry window."""
        return places is not None and places.opens(j) and getattr(step, "num_prefills", 0) == 0

    def window_open_ms(self) -> float:
        """What a decode step opening a telemetry window costs over the fit's price (0.0 before one was seen)."""
        return max(0.0, self._window_open_ms or 0.0)

    def _fit_price(self, s: Any) -> float:
        """The fit's price of a measured step at its measured misses and executor (no plan's evictions)."""
        return self.model_for(s).step_time_ms(self._load(s, self._spread(s.expert_misses),
                                                         chunked=ran_chunked(s))).total_ms

    @property
    def evict_ms_per_block(self) -> float:
        """The time a plan's application spends a GPU KV block it moves to the host: measured at the plan changes
        calibrated so far (forgetting older ones), else the host link's per-record prior and its bytes."""
        if self._evict_blocks > 0:
            return self._evict_sum / self._evict_blocks
        return self.cost.transfer_ms(Link.D2H, self.kv_block_bytes, 1)

    def loads_at(self, steps: list[Any], slots: list[tuple[int, ...]]) -> list[StepLoads]:
        """The misses each of `steps` (StepRecords) makes at `slots[i]` per MoE layer, and whether it outruns a
        layer's slots: the engine's residency replayed over the routing table at the steps' own shapes, in order,
        from its steady state (bench/phase_residency.py)."""
        if self.ids_host is None:
            raise ValueError("Predictor: no routing table to replay the expert residency over")
        shapes = [_shape(s) for s in steps]
        return replay_loads(self.ids_host, self.cost.shape.num_experts, shapes, slots)

    def _spread(self, total: int) -> tuple[int, ...]:
        """A step's count over all MoE layers as per-layer counts (the remainder to the first layers)."""
        m = self.cost.shape.num_moe_layers
        per, extra = divmod(total, m)
        return tuple(per + (1 if j < extra else 0) for j in range(m))

    def _load(self, s: Any, misses: tuple[float, ...], streamed: tuple[float, ...] = (), chunked: bool = False
              ) -> StepLoad:
        """The step's load as measured: its distinct experts (hits + misses, what `calibrate` fits the active
        experts' cost on; a uniform-routing estimate in their place priced a B=4 step's 4 distinct experts as 11),
        its KV fetches, and the given misses and executor."""
        cpu, nvme = s.kv_fetch.get("cpu", 0), s.kv_fetch.get("nvme", 0)
        return StepLoad(batch_tokens=max(1, s.batch_tokens), context_tokens=s.context_tokens, miss_count=misses,
                        prefetch_count=streamed, active_experts=self._spread(s.expert_hits + s.expert_misses),
                        kv_fetch_bytes=cpu * self.kv_block_bytes, kv_fetch_count=cpu,
                        kv_disk_read_bytes=nvme * self.kv_block_bytes, kv_disk_read_count=nvme, chunked=chunked)

    def step_prices(self, steps: list[Any], before: Any = None, places: WindowPlaces | None = None) -> list[float]:
        """Each of `steps` (StepRecords) priced at its measured misses and executor, and a step a new plan took
        effect at also at the KV blocks that plan moved to the host (`plan_evictions`; `before` as `calibrate`'s),
        a decode step opening a telemetry window (`places`) at the window's excess: its predicted step ms."""
        out = []
        for j, s in enumerate(steps):
            evicted = plan_evictions(s, before, self.kv_block_bytes)
            out.append(self._fit_price(s) + evicted * self.evict_ms_per_block
                       + (self.window_open_ms() if not evicted and self.opens(s, j, places) else 0.0))
            before = s
        return out

    def step_ms(self, steps: list[Any], before: Any = None, places: WindowPlaces | None = None) -> float:
        """Mean predicted step time over `steps`, each priced at its measured misses (0.0 without steps)."""
        return mean_of(self.step_prices(steps, before, places)) or 0.0

    def split_step_ms(self, steps: list[Any], slots: tuple[int, ...]) -> float:
        """Mean predicted step time over `steps` at a static split of `slots` per MoE layer (`loads_step_prices`
        at the misses `loads_at` replays there; 0.0 without steps)."""
        return mean_of(self.loads_step_prices(steps, self.loads_at(steps, [slots] * len(steps)))) or 0.0

    def loads_step_prices(self, steps: list[Any], loads: list[StepLoads]) -> list[float]:
        """Each of `steps` priced at its tokens, context and KV fetches and at the replayed `loads` in place of its
        measured misses: a decode step over some layer's slots runs chunked. The share of the misses the step's own
        loads show issued ahead of their layer (prefetched, streamed) is priced as streamed loads, the part behind
        a layer's compute free, as the controller prices its prefetch recall. Charged whole as demand loads, they
        put tierplan's prediction a median 37 % over its measured step on the H200 (qwen3 rows to session 21;
        fluxmoe's +13 %, resident's +9 %)."""
        if len(steps) != len(loads):
            raise ValueError(f"loads_step_prices: {len(steps)} steps, {len(loads)} replayed loads")
        out = []
        for s, load in zip(steps, loads, strict=True):
            ahead = s.expert_prefetch_hits
            share = ahead / (ahead + s.expert_misses) if ahead else 0.0
            chunked = s.num_prefills == 0 and load.over_slots
            out.append(self.model_for(s).step_time_ms(self._load(s, tuple(m * (1 - share) for m in load.misses),
                                                                 tuple(m * share for m in load.misses),
                                                                 chunked)).total_ms)
        return out


def _shape(step: Any) -> tuple[int, int]:
    """A step's decode tokens and prompt tokens (a record without `num_decodes`: a decode step's tokens are all
    decodes, a prefill step's all prompt)."""
    prompt = step.batch_tokens if step.num_prefills else 0
    decodes = getattr(step, "num_decodes", step.batch_tokens - prompt)
    return decodes, max(0, step.batch_tokens - decodes) if step.num_prefills else 0


def ran_chunked(step: Any) -> bool:
    """Whether a measured step (StepRecord) ran chunked off its graphs: the engine's `layer_over_slots` reason."""
    return any(k.endswith("/layer_over_slots") for k in (getattr(step, "executors", None) or {}))


def plan_evictions(step: Any, before: Any, kv_block_bytes: int) -> int:
    """The GPU KV blocks the plan that took effect at `step` moved to the host (0 where `step` runs the plan
    `before` ran, or either is unknown). The runner's hook applies a plan after the step before it ended and
    before that step's record is taken (bench/phase_run.py `measure`): its spill is in that record's d2h bytes,
    its time in `step`'s cycle, outside the forward."""
    if before is None or getattr(step, "plan_version", None) == getattr(before, "plan_version", None):
        return 0
    return (getattr(before, "link_bytes", None) or {}).get("d2h", 0) // max(1, kv_block_bytes)


def plan_kv_blocks(plan: Any) -> int | None:
    """A plan's GPU KV blocks: a `Plan`'s tier caps, or a saved steps line's `kv_gpu_blocks` (None: neither)."""
    tiers = getattr(plan, "kv_blocks_per_tier", None)
    if tiers is not None:  # keyed by the protocol's Tier, a str enum: "gpu" finds it
        gpu = tiers.get("gpu")
        return None if gpu is None else int(gpu)
    n = getattr(plan, "kv_gpu_blocks", None)
    return None if n is None else int(n)


def plan_slots(plan: Any, shape: ModelShape) -> tuple[int, ...]:
    """Expert slots per MoE layer that a plan's caps allow."""
    return tuple(plan.expert_bytes_per_layer[layer] // shape.expert_bytes for layer in shape.moe_layers)


def predict_at_plans(predictor: Predictor, plans: Mapping[int, Any], initial_plan: Any, timed: list[Any],
                     before: Any = None) -> tuple[float, str]:
    """The mean of `plan_step_prices` over `timed` (the fit as it stands, for every step) and where the figure
    came from (`plan_source`)."""
    prices, evicted = plan_step_prices(predictor, plans, initial_plan, timed, before)
    return mean_of(prices) or 0.0, plan_source(timed, evicted)


def plan_split(plans: Mapping[int, Any], initial_plan: Any, step: Any, shape: ModelShape) -> tuple[int, ...]:
    """The slots per MoE layer of the plan `step` ran under (`StepRecord.plan_version`; a version not in `plans`,
    e.g. a step before the first: `initial_plan`'s)."""
    return plan_slots(plans.get(getattr(step, "plan_version", None), initial_plan), shape)


def plan_loads(predictor: Predictor, plans: Mapping[int, Any], initial_plan: Any, steps: list[Any]
               ) -> list[StepLoads]:
    """The misses each of a run's `steps` makes at the split of the plan it ran under (`Predictor.loads_at`)."""
    shape = predictor.cost.shape
    return predictor.loads_at(steps, [plan_split(plans, initial_plan, s, shape) for s in steps])


def plan_step_prices(predictor: Predictor, plans: Mapping[int, Any], initial_plan: Any, timed: list[Any],
                     before: Any = None, places: WindowPlaces | None = None,
                     loads: list[StepLoads] | None = None) -> tuple[list[float], int]:
    """Each measured step priced at the split of the plan it ran under (`StepRecord.plan_version`; a version not
    in `plans`, e.g. a step before the first: `initial_plan`'s), and the KV blocks the plans evicted. A step a new
    plan took effect at also pays, at `Predictor.evict_ms_per_block`, the GPU KV blocks the plan's share leaves
    no room for: those the step before held (its context in whole blocks) beyond the share; a decode step opening a
    telemetry window (`places`), the window's excess (`Predictor.window_open_ms`). `loads`: each step's replayed
    misses (`plan_loads` over the whole run, so the residency carries from step to step; None: replayed over
    `timed` alone). Plans need only `expert_bytes_per_layer` and their GPU KV blocks (a saved steps line's plans
    serve: bench/phase_cost_replay.py)."""
    shape = predictor.cost.shape
    if loads is None:
        loads = plan_loads(predictor, plans, initial_plan, timed)
    prices = predictor.loads_step_prices(timed, loads)
    evicted = 0
    for i, s in enumerate(timed):
        prev = timed[i - 1] if i else before
        share = None
        if prev is not None and s.plan_version != prev.plan_version:
            share = plan_kv_blocks(plans.get(s.plan_version, initial_plan))
        if share is not None:
            n = max(0, -(-prev.context_tokens // shape.block_tokens) - share)
            prices[i] += n * predictor.evict_ms_per_block
            evicted += n
        elif predictor.opens(s, i, places):
            prices[i] += predictor.window_open_ms()
    return prices, evicted


def plan_source(timed: list[Any], evicted: int) -> str:
    """Where `predicted_step_ms` came from: the rule, the plans the steps ran under, the KV blocks they evicted."""
    under = {s.plan_version for s in timed}
    return ("split: cost model over the engine's LRU residency replayed on the trace" + (
        f", each step at the split of the plan it ran under ({len(under)} plans)" if len(under) > 1 else "")
        + (f", {evicted} KV blocks the plans evicted" if evicted else ""))
