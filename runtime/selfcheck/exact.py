"""`tierplan check exact`: moving experts and KV blocks between tiers must not change one bit of output.

Runs the same prompts twice with the same weights (one process, CPU twin or one GPU): first with every
expert resident and all KV on the GPU, then with only `resident_frac` of the experts holding a slot
(loaded on demand from the NVMe store) and every KV block spilled to CPU or NVMe after each step and
fetched back before the next. Compares every step's logits and the generated tokens. It must never
loosen the comparison: any difference, however small, fails. Nor can it pass by accident: it also fails,
saying why, unless the second run really missed experts (more than the first run's cold loads), spilled
KV blocks and fetched them back (e.g. `resident_frac=1.0` offloads no expert: nothing was compared).
`mode` picks how the second run executes decode steps with experts missing (runtime/engine/executor.py):
piecewise graphs (GEMMs through the slot table), piecewise with the layer-ahead window, piecewise reading the
experts' ranges, or eager; the check fails when no decode step ran on that executor (the mode was not
exercised).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tierplan.runtime.device import Device
from tierplan.runtime.engine.config import ModelSpec
from tierplan.runtime.engine.engine import EngineConfig, ReferenceEngine
from tierplan.runtime.engine.executor import Executor, Reason
from tierplan.runtime.engine.kv_cache import block_shape
from tierplan.runtime.errors import ConfigError
from tierplan.runtime.nvme import DIRECT_ALIGN_BYTES
from tierplan.runtime.selfcheck.common import workdir_for
from tierplan.runtime.weights.format import dtype_from_name
from tierplan.runtime.weights.load_modes import WINDOWED
from tierplan.runtime.weights.loader import MapIn, Publish, StoreKind


@dataclass
class ExactResult:
    max_abs_diff: float
    tokens_equal: bool
    steps: int
    expert_misses_full: int
    expert_misses_tight: int
    kv_fetches: int
    kv_spills: int
    seconds: float
    mode: str = "piecewise"
    executors: dict[str, int] | None = None  # the second run's steps by executor
    mode_steps: int | None = None  # of which on the mode's executor (None: not asked)
    map_in: str = "beside_copy"  # the second run's expert_map_in (the mode's own where it needs one)

    @property
    def problems(self) -> list[str]:
        """Why the check fails: outputs differ, or the runs did not test what they claim (nothing offloaded)."""
        out = []
        if self.max_abs_diff != 0.0 or not self.tokens_equal:
            out.append(f"outputs differ (max_abs_diff={self.max_abs_diff}, tokens_equal={self.tokens_equal})")
        if self.expert_misses_tight <= self.expert_misses_full:  # the full run's misses are its cold first loads
            out.append(f"nothing was offloaded: the offloaded run missed {self.expert_misses_tight} experts, no more "
                       f"than the all-resident run's {self.expert_misses_full} first loads (resident_frac must "
                       "leave some experts without a slot, i.e. < 1.0)")
        if not self.kv_spills or not self.kv_fetches:
            out.append(f"no KV round trip: {self.kv_spills} blocks spilled, {self.kv_fetches} fetched back "
                       "(expected both > 0: at least 2 generated tokens)")
        if self.mode_steps == 0:
            out.append(f"mode {self.mode!r} was not exercised: no decode step ran on its executor")
        return out

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self) -> str:
        verdict = "ok" if self.ok else "FAILED: " + "; ".join(self.problems)
        return f"exact: max_abs_diff={self.max_abs_diff} tokens_equal={self.tokens_equal} {verdict}"


# mode -> (offload_exec, lookahead layers, expert_reads, the executor its decode steps must run on). Eager counts
# every eager decode step: a model whose attention has no paged decode kernel (MLA) runs its offloaded steps
# eagerly too. "range": piecewise, its GEMMs reading the experts' ranges instead of the slot table. "on_read":
# piecewise through the slot table with loads that map no range (expert_map_in="on_read"; eager prefills map what
# they read).
MODES = {"piecewise": ("piecewise", 0, None, Executor.PIECEWISE),
         "lookahead": ("piecewise", 2, None, Executor.PIECEWISE),
         "range": ("piecewise", 0, "range", Executor.PIECEWISE), "eager": ("eager", 0, None, Executor.EAGER),
         "on_read": ("piecewise", 0, "table", Executor.PIECEWISE)}


def mode_map_in(mode: str, map_in: MapIn, strict: bool = False) -> tuple[MapIn, str | None]:
    """The (expert_map_in, expert_reads) a mode's tight run uses, from the map-in asked for: "on_read" maps no
    range at load; reads through the ranges need them mapped beside the copies; "before_copy" builds no window.
    strict (one mode asked for by name): a map-in the mode cannot run with is refused instead of replaced."""
    reads = MODES[mode][2]
    if strict and ((mode == "on_read" and map_in == "before_copy") or (reads == "range" and map_in == "on_read")):
        raise ConfigError(f"mode {mode!r} cannot run with expert_map_in={map_in!r}: mode 'on_read' needs the slot "
                          "window ('beside_copy' or 'on_read'), mode 'range' needs ranges mapped at load "
                          "('beside_copy' or 'before_copy')")
    if mode == "on_read":
        return "on_read", "table"
    if map_in not in WINDOWED:
        return map_in, "range"
    if reads == "range" and map_in == "on_read":
        return "beside_copy", "range"
    return map_in, reads


def _decode_steps_on(executor: Executor, steps: Mapping[Executor, int], reasons: Mapping[Reason, int]) -> int:
    """Decode steps the second run made on `executor` (a prefill always runs eagerly)."""
    return steps[executor] - (reasons[Reason.PREFILL] if executor is Executor.EAGER else 0)


def auto_block_tokens(spec: ModelSpec, at_least: int = 16) -> int:
    """Smallest block of >= `at_least` tokens whose bytes are a multiple of the O_DIRECT alignment."""
    per_token = math.prod(block_shape(spec, 1)) * dtype_from_name(spec.dtype).itemsize
    step = DIRECT_ALIGN_BYTES // math.gcd(per_token, DIRECT_ALIGN_BYTES)
    return -(-at_least // step) * step


def run_exact_check(spec: ModelSpec, resident_frac: float, device: str = "cpu", num_prompts: int = 3,
                    max_prompt_len: int = 40, new_tokens: int = 8, seed: int = 0,
                    workdir: str | Path | None = None, decode_kernel: bool | None = None,
                    decode_graphs: bool | None = None, expert_map_in: MapIn = "beside_copy",
                    expert_poison: bool = False, expert_publish: Publish = "issued",
                    mode: str = "piecewise", expert_store: StoreKind = StoreKind.NVME) -> ExactResult:
    return run_exact_checks(spec, resident_frac, device, num_prompts, max_prompt_len, new_tokens, seed, workdir,
                            decode_kernel, decode_graphs, expert_map_in, expert_poison, expert_publish, (mode,),
                            expert_store)[0]


def run_exact_checks(spec: ModelSpec, resident_frac: float, device: str = "cpu", num_prompts: int = 3,
                     max_prompt_len: int = 40, new_tokens: int = 8, seed: int = 0,
                     workdir: str | Path | None = None, decode_kernel: bool | None = None,
                     decode_graphs: bool | None = None, expert_map_in: MapIn = "beside_copy",
                     expert_poison: bool = False, expert_publish: Publish = "issued",
                     modes: Sequence[str] = ("piecewise",), expert_store: StoreKind = StoreKind.NVME
                     ) -> list[ExactResult]:
    """One all-resident run, then one tight run per mode, each compared with it (its experts loaded from
    `expert_store`: NVMe by default, pinned host memory for the loads a slot-table read takes before mapping)."""
    for mode in modes:  # refused before anything is built
        mode_map_in(mode, expert_map_in, strict=len(modes) == 1)
    rng = random.Random(seed)
    prompts = [[rng.randrange(spec.vocab_size) for _ in range(rng.randint(1, max_prompt_len))]
               for _ in range(num_prompts)]
    bt = auto_block_tokens(spec)
    per_seq = -(-(max_prompt_len + new_tokens) // bt)
    dev = Device(device)
    graphs_on = dev.is_cuda if decode_graphs is None else decode_graphs
    out = []
    with workdir_for(workdir) as wd:
        t0 = time.perf_counter()
        full_cfg = EngineConfig(block_tokens=bt, kv_gpu_blocks=per_seq * num_prompts, seed=seed,
                                decode_kernel=decode_kernel, decode_graphs=decode_graphs, workdir=wd / "full")
        eng = ReferenceEngine(spec, dev, full_cfg)
        try:
            a = eng.generate(prompts, new_tokens)
        finally:
            eng.close()
        full_s = time.perf_counter() - t0
        for mode in modes:
            t0 = time.perf_counter()
            map_in, reads = mode_map_in(mode, expert_map_in)
            tight_cfg = EngineConfig(
                resident_frac=resident_frac, expert_store=expert_store, block_tokens=bt,
                kv_gpu_blocks=per_seq * num_prompts, kv_cpu_blocks=max(1, per_seq * num_prompts // 2),
                kv_nvme_blocks=per_seq * num_prompts, spill_kv_every_step=True, seed=seed,
                decode_kernel=decode_kernel, decode_graphs=decode_graphs, workdir=wd / f"tight-{mode}",
                expert_map_in=map_in, expert_poison=expert_poison, expert_publish=expert_publish,
                offload_exec=MODES[mode][0], expert_lookahead_layers=MODES[mode][1],  # type: ignore[arg-type]
                expert_reads=reads)  # type: ignore[arg-type]
            eng = ReferenceEngine(spec, dev, tight_cfg)
            try:
                b = eng.generate(prompts, new_tokens)
                steps, reasons, tight_map_in = eng.executors.steps, eng.executors.reasons, eng.map_in
            finally:
                eng.close()
            out.append(ExactResult(
                max_abs_diff=float((a.logits - b.logits).abs().max()), tokens_equal=a.tokens == b.tokens,
                steps=a.logits.shape[0], expert_misses_full=a.expert_misses, expert_misses_tight=b.expert_misses,
                kv_fetches=b.kv_fetches, kv_spills=b.kv_spills, seconds=full_s + time.perf_counter() - t0,
                mode=mode, executors={e.value: steps[e] for e in Executor}, map_in=tight_map_in,
                mode_steps=_decode_steps_on(MODES[mode][3], steps, reasons) if graphs_on and resident_frac < 1.0
                else None))
    return out
