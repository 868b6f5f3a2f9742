"""A phase-diagram row from one run's measurements, and the cost model's prediction of its step time.

Runs in the bench process; pure Python + numpy over the runner's records (no torch). Every figure is over the
measured steps (those after warm-up):
- `decode_tok_s`: output tokens of the measured steps over their wall time, from the end of the last warm-up
  step to the end of the last step: every step's cycle (the forward, and everything between two steps:
  preemption spills, the planner's solve, prefetch issue, the agent's hooks). `measured_step_ms` is that wall
  time over the measured steps; `ms_per_token` its inverse per output token: the figure to compare policies
  by (runs of one point differ in how many sequences share a step). `decode_step_ms`: the mean cycle of the
  `decode_steps` measured steps with no prefill (`prefill_step_ms`: of those with one); `engine_step_ms`: the
  forward alone; `mean_running_batch`: sequences per measured step. `decode_step_ms_p50` / `_max`: the median and the
  slowest of those decode cycles, and `gc_ms` the collector's pauses in the measured steps: whether a gap
  between two runs that did the same work (phase_spread.py) is a few slow steps or every step a little slower.
- `steady_tok_s`: `decode_tok_s` with the measured steps charged for the prefills their output implies (output
  tokens over the point's mean output per request), at this run's own prefill cost per request, as a long
  stream of these requests would charge them. A run stopped early (`Sizes.stop_decode_steps`) under a small KV
  share ran few sequences, and its prefills fell mostly before its measured steps or never ran: H200 phase run
  26, qwen3 b128 1K 40 GiB, resident served 6 of 160 requests at 470 tok/s, 357 steady; tierplan all 160 at
  325, 300 steady (its first prefills fell in the warm-up). Where the measured steps hold the prefills of what
  they output, the two agree.
- TPOT p50/p99 and TTFT p50 over the run's finished requests (wall time, from the `Runner`; `requests` counts
  them and `requests_unfinished`, those left when the run stopped: `Sizes.stop_decode_steps`), expert hit
  rate, stall ms per measured step by cause (a step that waited on both expert loads and KV fetches counts all
  of its stall as "both", as the agent's telemetry does), KV hits per tier, bytes per link, plan changes.
- `predicted_step_ms`: the cost model's step time for what the policy planned, never for what it measured:
  the cost model (`tierplan.controller.costmodel`, calibrated step by step on the earlier runs of the model in
  this process, the point's discarded warm-up run and this run's warm-up steps: `Predictor.calibrate`) over
  each measured step's tokens, context and KV fetches with the expert misses the routing trace's LRU
  miss-ratio curve predicts at the slots per layer of the plan the step ran under
  (`controller.predictors.miss_ratio`, the decode walk of `ForcedRouter` at the step's batch), the share of
  them the step's loads show issued ahead of their layer
  (`StepRecord.expert_prefetch_hits`) priced as streamed. One rule for every policy: a live one's steps are
  priced at each split it applied, from the step it took effect; that step also pays the GPU KV blocks its
  plan's share evicts, at the time a block took at the plan changes measured before
  (`Predictor.evict_ms_per_block`: 0.17-0.50 ms a block on the H100/H200, against ~5 us of link; such steps
  held 6-26 % of some live runs' measured time in phase runs 29-45).
  `controller_step_ms`: a live policy's own figure, the controller's `Decision.step_ms` of the split in force.
  It is a typical step at the batch the controller saw, not the run's mix of decodes and prefills: on the H200
  it was 0.1-8.6x the measured step (phase runs 17-25, bench/results/phase_h200.md).
  `predicted_step_ms_measured_misses` prices the measured misses instead (time per byte, no miss prediction);
  `predicted_decode_step_ms_measured_misses` / `predicted_prefill_step_ms_measured_misses` the same over the
  steps without / with a prefill (against `decode_step_ms` / `prefill_step_ms`).
It never asserts on a figure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tierplan.controller.costmodel import CostModel, HardwareSpec, StepLoad
from tierplan.controller.model_shape import ModelShape
from tierplan.controller.predictors.miss_ratio import MissRatioCurves
from tierplan.controller.protocol import AckStatus, Link

# The row, in its order: every row carries these (the rest are extra columns).
ROW_FIELDS = ("model", "layers", "batch", "context", "hbm_budget_gib", "policy", "decode_tok_s", "tpot_p50_ms",
              "tpot_p99_ms", "ttft_p50_ms", "expert_hit_rate", "stall_ms_expert", "stall_ms_kv", "stall_ms_both",
              "predicted_step_ms", "measured_step_ms", "device")
TRANSFER_OVERHEAD_PRIOR_S = 1e-4  # per record, before calibration (the cost model fits it from the steps)
CURVE_MAX_BATCH = 256  # the miss-ratio curves' largest tracked batch (a larger step uses this one)
CURVE_ACCESSES = 16384  # expert accesses per layer a curve is built from (steps = this / the batch's union)
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


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _mean_ms(seconds: list[float]) -> float | None:
    return None if not seconds else sum(seconds) / len(seconds) * 1e3


def timing(steps: list[Any]) -> dict[str, float | None]:
    """The measured steps' wall-time figures (module docstring); zeros / None without steps."""
    wall_s = sum(s.cycle_s for s in steps)
    tokens = sum(s.tokens_out for s in steps)
    decode = [s.cycle_s for s in steps if s.num_prefills == 0]
    prefill = [s.cycle_s for s in steps if s.num_prefills > 0]
    n = len(steps)
    return {"decode_tok_s": tokens / wall_s if wall_s else 0.0,
            "measured_step_ms": wall_s / n * 1e3 if n else 0.0,
            "ms_per_token": wall_s / tokens * 1e3 if tokens else None,
            "decode_step_ms": _mean_ms(decode),
            "prefill_step_ms": _mean_ms(prefill),
            "engine_step_ms": sum(s.step_s for s in steps) / n * 1e3 if n else None,
            "mean_running_batch": sum(s.num_prefills + s.num_decodes for s in steps) / n if n else None,
            "measured_wall_s": wall_s,
            "decode_steps": len(decode),
            "decode_step_ms_p50": float(np.median(decode)) * 1e3 if decode else None,
            "decode_step_ms_max": max(decode) * 1e3 if decode else None,
            "gc_ms": sum(s.gc_ms for s in steps),
            # CUDA-graph captures of new buckets, left out of the wall time above (phase_run.server_clock)
            "graph_capture_ms": sum(getattr(s, "capture_ms", 0.0) for s in steps)}


# Why a prefill's steps have their own fit (`Predictor.prefill`): one fit over both kinds, with ~100 steps of
# memory, saw a point's few large eager steps beside its many small graph replays, gave the per-token and
# per-expert terms what the decode steps' fixed cost is (its fixed terms clamped at zero), and priced a b1 decode
# step of 3.3 ms at 1.4. Replayed over the H100/H200 phase steps of runs 01-73 (session 38): 669 of 948 runs within
# 15 % with two fits, 644 with one (tierplan, each point's first policy: 73 of 137 against 63); the decode steps
# alone 474 of 869 runs against 452. A fit over those steps of one code on one H100 (runs 69-73) prices 85 of 94
# runs' decode steps within 15 % with the same four terms: what is left is the online fit's, not the terms'.
@dataclass
class Predictor:
    """The cost model per model in this process, calibrated as the runs go, and the routing trace's LRU
    miss-ratio curves per tracked batch (built on first use). The model is fitted twice, on the decode steps
    (`cost`: CUDA graph replays, or chunked off them) and on the steps that hold a prefill (`prefill`: run eagerly),
    and each step is priced by its own kind's fit (`model_for`): one fit over both explained a prefill's thousands
    of tokens and a decode step's fixed cost with the same coefficients, and its fixed terms went to zero
    (the comment above)."""

    cost: CostModel  # the decode steps' fit (and the link, shape and priors every price reads)
    kv_block_bytes: int
    ids_host: np.ndarray | None = None  # the forced router's table [T, L_moe, k]
    prefill: CostModel | None = None  # the fit of steps holding a prefill (None: `cost` prices them too)
    _curves: dict[int, MissRatioCurves] = field(default_factory=dict)
    _evict_sum: float = 0.0  # ms outside the forward at plan changes that evicted KV blocks, forgetting older ones
    _evict_blocks: float = 0.0  # the blocks they evicted, forgotten alike

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

    def calibrate(self, steps: list[Any], before: Any = None) -> None:
        """Fold measured steps (StepRecords) into the cost model, one observation each: the cycle less its
        stalls against its tokens, context, distinct experts (hits + misses over the MoE layers) and whether it
        ran chunked, and the stalls against its demand loads (expert misses, KV blocks fetched back) and their
        bytes. A step a new plan took effect at whose plan moved GPU KV blocks to the host (`plan_evictions`;
        `before`: the step before the first, of the same run) spent its cycle outside the forward on them: that
        time goes to the price of a block a plan evicts (`evict_ms_per_block`), not to compute."""
        eb = self.cost.shape.expert_bytes
        for s in steps:
            kv = sum(s.kv_fetch.values())
            stall = s.expert_stall_ms + s.kv_stall_ms
            applied_ms = 0.0
            if (evicted := plan_evictions(s, before, self.kv_block_bytes)) > 0:
                applied_ms = max(0.0, (s.cycle_s - s.step_s) * 1e3)
                self._evict_sum = EVICT_FORGETTING * self._evict_sum + applied_ms
                self._evict_blocks = EVICT_FORGETTING * self._evict_blocks + evicted
            self.model_for(s).observe(s.batch_tokens, s.context_tokens, s.expert_hits + s.expert_misses,
                              s.cycle_s * 1e3 - stall - applied_ms, s.expert_misses + kv,
                              s.expert_misses * eb + kv * self.kv_block_bytes, stall, expert_misses=s.expert_misses,
                              chunked=float(ran_chunked(s)))
            before = s

    @property
    def evict_ms_per_block(self) -> float:
        """The time a plan's application spends a GPU KV block it moves to the host: measured at the plan changes
        calibrated so far (forgetting older ones), else the host link's per-record prior and its bytes."""
        if self._evict_blocks > 0:
            return self._evict_sum / self._evict_blocks
        return self.cost.transfer_ms(Link.D2H, self.kv_block_bytes, 1)

    def curve(self, batch: int) -> MissRatioCurves:
        """The trace's LRU curves at `batch` (a power of two, <= CURVE_MAX_BATCH): `batch` sequences walking the
        table as `ForcedRouter` has decodes do (sequence s at step t reads row (s * 997 + t) % T)."""
        if batch not in self._curves:
            if self.ids_host is None:
                raise ValueError("Predictor: no routing table to build miss-ratio curves from")
            ids = self.ids_host
            t_rows, num_moe = ids.shape[0], ids.shape[1]
            curves = MissRatioCurves(num_moe, self.cost.shape.num_experts, (batch,))
            seqs = np.arange(batch, dtype=np.int64) * 997
            union = min(self.cost.shape.num_experts, batch * self.cost.shape.top_k)
            for t in range(max(32, CURVE_ACCESSES // union)):
                rows = ids[(seqs + t) % t_rows]  # [B, L, k]
                for m in range(num_moe):
                    curves.observe_step(m, rows[:, m].reshape(-1), batch)
            self._curves[batch] = curves
        return self._curves[batch]

    def predicted_misses(self, slots: tuple[int, ...], tokens: int) -> tuple[float, ...]:
        """Per MoE layer: the misses per step an LRU cache of `slots[m]` slots makes at a step of `tokens`."""
        b = curve_batch(tokens)
        c = self.curve(b)
        # Every expert resident: no miss (the curve's cold misses belong to the warm-up, which fills the slots).
        return tuple(0.0 if s >= c.num_experts else float(c.expected_misses_per_step(m, b)[s])
                     for m, s in enumerate(slots))

    def over_slots(self, slots: tuple[int, ...], tokens: int) -> bool:
        """Whether a decode step of `tokens` at `slots` per MoE layer runs chunked, as the engine decides it (some
        layer's experts over its slots), judged by each layer's mean union on the trace's curve at that batch."""
        b = curve_batch(tokens)
        c = self.curve(b)
        return any(s < c.num_experts and c.mean_union_size(m, b) > s for m, s in enumerate(slots))

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

    def step_prices(self, steps: list[Any], before: Any = None) -> list[float]:
        """Each of `steps` (StepRecords) priced at its measured misses and executor, and a step a new plan took
        effect at also at the KV blocks that plan moved to the host (`plan_evictions`; `before` as `calibrate`'s):
        its predicted step ms."""
        out = []
        for s in steps:
            load = self._load(s, self._spread(s.expert_misses), chunked=ran_chunked(s))
            out.append(self.model_for(s).step_time_ms(load).total_ms
                       + plan_evictions(s, before, self.kv_block_bytes) * self.evict_ms_per_block)
            before = s
        return out

    def step_ms(self, steps: list[Any], before: Any = None) -> float:
        """Mean predicted step time over `steps`, each priced at its measured misses (0.0 without steps)."""
        return _mean(self.step_prices(steps, before)) or 0.0

    def split_step_ms(self, steps: list[Any], slots: tuple[int, ...]) -> float:
        """Mean predicted step time over `steps` at a static split of `slots` per MoE layer: each step's
        tokens, context and KV fetches, the misses the miss-ratio curve predicts. The curve's misses are an LRU
        cache's; the share of them the step's own loads show issued ahead of their layer (prefetched, streamed)
        is priced as streamed loads, the part behind a layer's compute free, as the controller prices its
        prefetch recall. Charged whole as demand loads, they put tierplan's prediction a median 37 % over its
        measured step on the H200 (qwen3 rows to session 21; fluxmoe's +13 %, resident's +9 %)."""
        total = 0.0
        for s in steps:
            misses = self.predicted_misses(slots, s.batch_tokens)
            ahead = s.expert_prefetch_hits
            share = ahead / (ahead + s.expert_misses) if ahead else 0.0
            chunked = s.num_prefills == 0 and self.over_slots(slots, s.batch_tokens)
            total += self.model_for(s).step_time_ms(self._load(s, tuple(m * (1 - share) for m in misses),
                                                       tuple(m * share for m in misses), chunked)).total_ms
        return total / len(steps) if steps else 0.0


def curve_batch(tokens: int) -> int:
    """The tracked curve a step of `tokens` is priced on: the power of two at or below it, within CURVE_MAX_BATCH."""
    return 1 << (max(1, min(tokens, CURVE_MAX_BATCH)).bit_length() - 1)


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


def predict(predictor: Predictor, outcome: Any, timed: list[Any], before: Any = None) -> tuple[float, str]:
    """`predicted_step_ms` of the run (module docstring) and where it came from: `predict_at_plans` over the
    run's applied plans (`before`: the step before the first timed one)."""
    return predict_at_plans(predictor, outcome.extra.get("plans_applied") or {}, outcome.initial_plan, timed,
                            before)


def predict_at_plans(predictor: Predictor, plans: Mapping[int, Any], initial_plan: Any, timed: list[Any],
                     before: Any = None) -> tuple[float, str]:
    """Each measured step priced at the split of the plan it ran under (`StepRecord.plan_version`; a version not
    in `plans`, e.g. a step before the first: `initial_plan`'s), and where the figure came from. A step a new
    plan took effect at also pays, at `Predictor.evict_ms_per_block`, the GPU KV blocks the plan's share leaves
    no room for: those the step before held (its context in whole blocks) beyond the share. Plans need only
    `expert_bytes_per_layer` and their GPU KV blocks (a saved steps line's plans serve:
    bench/phase_cost_replay.py)."""
    shape = predictor.cost.shape
    slots = {v: plan_slots(p, shape) for v, p in plans.items()}
    initial = plan_slots(initial_plan, shape)
    prices = [predictor.split_step_ms([s], slots.get(s.plan_version, initial)) for s in timed]
    evicted = 0
    for i, s in enumerate(timed):
        prev = timed[i - 1] if i else before
        if prev is None or s.plan_version == prev.plan_version:
            continue
        share = plan_kv_blocks(plans.get(s.plan_version, initial_plan))
        if share is not None:
            n = max(0, -(-prev.context_tokens // shape.block_tokens) - share)
            prices[i] += n * predictor.evict_ms_per_block
            evicted += n
    under = {s.plan_version for s in timed}
    return (_mean(prices) or 0.0,
            "split: cost model over the trace's LRU miss curve" + (
                f", each step at the split of the plan it ran under ({len(under)} plans)" if len(under) > 1 else "")
            + (f", {evicted} KV blocks the plans evicted" if evicted else ""))


def _pct_ms(seconds: list[float] | None, q: float) -> float | None:
    """The q-quantile of `seconds`, in ms (q = 1: the most); None without any."""
    if not seconds:
        return None
    xs = sorted(seconds)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3


def controller_step_ms(outcome: Any, warm: int, num_timed: int) -> float | None:
    """A live policy's own prediction: the controller's `Decision.step_ms` of the split in force, averaged over
    the measured steps (steps before its first decision left out; None: no decision). It prices one typical step
    at the batch the controller saw, not the measured mix of decodes and prefills, so it is no estimate of
    `measured_step_ms` where prefills are in the mix (H200 phase rows: 0.1-8.6x it); the row carries it beside
    `predicted_step_ms` to show what the controller believed."""
    decisions = sorted(outcome.extra.get("decisions") or [])
    ws = max(1, outcome.window_steps)
    in_force = [active[-1] for i in range(warm, warm + num_timed)
                if (active := [ms for w, ms in decisions if w * ws <= i])]
    return _mean(in_force)


def _stalls(steps: list[Any]) -> dict[str, float]:
    out = {"expert": 0.0, "kv": 0.0, "both": 0.0}
    for s in steps:
        if s.expert_stall_ms > 0 and s.kv_stall_ms > 0:
            out["both"] += s.expert_stall_ms + s.kv_stall_ms
        elif s.expert_stall_ms > 0:
            out["expert"] += s.expert_stall_ms
        elif s.kv_stall_ms > 0:
            out["kv"] += s.kv_stall_ms
    n = max(1, len(steps))
    return {k: v / n for k, v in out.items()}


def _sum(steps: list[Any], attr: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in steps:
        for k, v in getattr(s, attr).items():
            out[k] = out.get(k, 0) + v
    return out


def prefill_ms_per_request(steps: list[Any]) -> float:
    """A prefill's cycle time over `steps` (a run's, warm-up included): each step with prefills less its
    decodes at the decode-only steps' median time per sequence, over the prefills (0.0 without one)."""
    per_seq = [s.cycle_s / s.num_decodes for s in steps if s.num_prefills == 0 and s.num_decodes]
    d = float(np.median(per_seq)) if per_seq else 0.0
    pre = [s for s in steps if s.num_prefills]
    n = sum(s.num_prefills for s in pre)
    return max(0.0, sum(s.cycle_s - s.num_decodes * d for s in pre)) / n * 1e3 if n else 0.0


def steady_tok_s(steps: list[Any], timed: list[Any], tokens_per_request: float) -> float | None:
    """`steady_tok_s` (module docstring): the measured steps' output over their wall time plus the prefills
    that output implies beyond (or short of) those they hold, each at `prefill_ms_per_request(steps)`."""
    tokens, wall_s = sum(s.tokens_out for s in timed), sum(s.cycle_s for s in timed)
    if not tokens or not wall_s or tokens_per_request <= 0:
        return None
    implied = tokens / tokens_per_request - sum(s.num_prefills for s in timed)
    charged = wall_s + implied * prefill_ms_per_request(steps) / 1e3
    return tokens / charged if charged > 0 else tokens / wall_s


def measured_row(base: dict[str, Any], outcome: Any, warm_steps: int, predictor: Predictor,
                 tokens_per_request: float = 0.0) -> dict[str, Any]:
    """The row of a run that ran: `base` (model, layers, ... policy, device) plus its figures. Folds the run's
    windows into `predictor` (warm-up ones before predicting, the rest after). `tokens_per_request`: the
    point's mean output per request (`steady_tok_s`; 0: none)."""
    steps = outcome.steps
    warm = min(warm_steps, max(0, len(steps) - 1))  # a run shorter than the warm-up still measures its last step
    timed = steps[warm:]
    hits, misses = sum(s.expert_hits for s in timed), sum(s.expert_misses for s in timed)
    predictor.calibrate(steps[:warm])
    before = steps[warm - 1] if warm else None
    predicted, source = predict(predictor, outcome, timed, before)
    prices = predictor.step_prices(timed, before)
    priced = _mean(prices) or 0.0
    # The same pricing over decode and prefill steps apart (a prefill needs every expert: where the cost model
    # errs is told apart by step kind; compare with decode_step_ms / prefill_step_ms).
    priced_decode = _mean([p for p, s in zip(prices, timed, strict=True) if s.num_prefills == 0])
    priced_prefill = _mean([p for p, s in zip(prices, timed, strict=True) if s.num_prefills > 0])
    predictor.calibrate(timed, before)
    rep = outcome.report
    stalls = _stalls(timed)
    applied = sum(a.status is AckStatus.APPLIED for a in outcome.acks)
    fetch = _sum(timed, "kv_fetch")
    plan = outcome.initial_plan
    tm = timing(timed)
    measured = tm["measured_step_ms"]
    notes, status = outcome.notes, "ok"
    errors = outcome.extra.get("planner_errors") or []
    if errors:  # the live planner failed some windows: the plan held there, so this is not the policy's result
        status = "degraded"
        notes = f"{len(errors)} window(s) the planner failed, first: {errors[0]}" + (f" | {notes}" if notes else "")
    diverged = outcome.extra.get("diverged_steps")
    if diverged is not None:
        notes += f" | diverged_steps {diverged} (steps whose experts differed from the recording)"
    return {
        **base,
        **tm,
        "steady_tok_s": steady_tok_s(steps, timed, tokens_per_request),
        "tpot_p50_ms": rep.pct("tpot_s", 0.5) * 1e3, "tpot_p99_ms": rep.pct("tpot_s", 0.99) * 1e3,
        "ttft_p50_ms": rep.pct("ttft_s", 0.5) * 1e3,
        "expert_hit_rate": hits / (hits + misses) if hits + misses else 1.0,
        "stall_ms_expert": stalls["expert"], "stall_ms_kv": stalls["kv"], "stall_ms_both": stalls["both"],
        "predicted_step_ms": predicted, "predicted_from": source,
        "controller_step_ms": controller_step_ms(outcome, warm, len(timed)),
        "predicted_step_ms_measured_misses": priced,
        "predicted_decode_step_ms_measured_misses": priced_decode,
        "predicted_prefill_step_ms_measured_misses": priced_prefill,
        "predicted_over_measured": predicted / measured if measured else None,
        "status": status, "measured_steps": len(timed), "warm_steps": warm,
        "requests": len(rep.requests) + rep.unfinished, "requests_unfinished": rep.unfinished,
        "output_tokens": sum(s.tokens_out for s in timed),
        "kv_hits": {"gpu": sum(s.kv_gpu_hits for s in timed), **fetch},
        "link_bytes": _sum(timed, "link_bytes"),
        "executor_steps": _sum(timed, "executors"),  # "executor/reason": measured steps (graph, piecewise, eager)
        "plan_changes": max(0, applied - 1), "plans_rejected": len(outcome.acks) - applied,
        "planner_errors": outcome.loop_stats.get("planner_errors", 0),
        # How far the live planner ran behind decode (closed_loop.InProcessLoop): its time a window, the windows
        # queued behind the one it took, and each applied plan's steps from its window's end.
        "planner_ms_p50": _pct_ms(outcome.loop_stats.get("planner_s"), 0.5),
        "planner_ms_max": _pct_ms(outcome.loop_stats.get("planner_s"), 1.0),
        "windows_queued_max": max(outcome.loop_stats.get("windows_queued") or [0]),
        "windows_unplanned": outcome.loop_stats.get("windows_unplanned", 0),
        "plan_lag_steps": list(outcome.loop_stats.get("plan_lag_steps") or []),
        "peak_hbm_bytes": outcome.extra.get("peak_hbm_bytes"),
        "over_budget_steps": outcome.extra.get("over_budget_steps"),
        "diverged_steps": diverged, "local_predictor": outcome.extra.get("local_predictor"),
        "initial_expert_bytes": sum(plan.expert_bytes_per_layer),
        "initial_kv_gpu_blocks": int(plan.kv_blocks_per_tier.get("gpu", 0)),
        "preemptions": sum(r.preemptions for r in rep.requests),
        "plans_issued": outcome.extra.get("plans_issued") or [],  # a live controller's: when, split, batch, why
        "plans_held": outcome.extra.get("plans_held"),  # a live controller's kept splits: how often, the last why
        "notes": notes.lstrip(" |"),
    }


def refused_row(base: dict[str, Any], reason: str) -> dict[str, Any]:
    """A run that could not run (its plan refused, a missing solver, a point its split cannot serve): every
    field present, the figures None, the reason in `notes` (never dropped from the table)."""
    figures = {k: None for k in ROW_FIELDS if k not in base}
    return {**base, **figures, "status": "refused", "notes": reason}
