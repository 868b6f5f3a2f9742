"""`tierplan check exact`: moving experts and KV blocks between tiers must not change one bit of output.

Runs the same prompts twice with the same weights (one process, CPU twin or one GPU): first with every
expert resident and all KV on the GPU, then with only `resident_frac` of the experts holding a slot
(loaded on demand from the NVMe store) and every KV block spilled to CPU or NVMe after each step and
fetched back before the next. Compares every step's logits and the generated tokens. It must never
loosen the comparison: any difference, however small, fails. Nor can it pass by accident: it also fails,
saying why, unless the second run really missed experts (more than the first run's cold loads), spilled
KV blocks and fetched them back (e.g. `resident_frac=1.0` offloads no expert: nothing was compared).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

from runtime.device import Device
from runtime.engine.config import ModelSpec
from runtime.engine.engine import EngineConfig, ReferenceEngine
from runtime.engine.kv_cache import block_shape
from runtime.nvme import DIRECT_ALIGN_BYTES
from runtime.selfcheck.common import workdir_for
from runtime.weights.format import dtype_from_name
from runtime.weights.loader import MapIn, Publish, StoreKind


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
        return out

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self) -> str:
        verdict = "ok" if self.ok else "FAILED: " + "; ".join(self.problems)
        return f"exact: max_abs_diff={self.max_abs_diff} tokens_equal={self.tokens_equal} {verdict}"


def auto_block_tokens(spec: ModelSpec, at_least: int = 16) -> int:
    """Smallest block of >= `at_least` tokens whose bytes are a multiple of the O_DIRECT alignment."""
    per_token = math.prod(block_shape(spec, 1)) * dtype_from_name(spec.dtype).itemsize
    step = DIRECT_ALIGN_BYTES // math.gcd(per_token, DIRECT_ALIGN_BYTES)
    return -(-at_least // step) * step


def run_exact_check(spec: ModelSpec, resident_frac: float, device: str = "cpu", num_prompts: int = 3,
                    max_prompt_len: int = 40, new_tokens: int = 8, seed: int = 0,
                    workdir: str | Path | None = None, decode_kernel: bool | None = None,
                    decode_graphs: bool | None = None, expert_map_in: MapIn = "link",
                    expert_poison: bool = False, expert_publish: Publish = "issued") -> ExactResult:
    rng = random.Random(seed)
    prompts = [[rng.randrange(spec.vocab_size) for _ in range(rng.randint(1, max_prompt_len))]
               for _ in range(num_prompts)]
    bt = auto_block_tokens(spec)
    per_seq = -(-(max_prompt_len + new_tokens) // bt)
    dev = Device(device)
    t0 = time.perf_counter()
    with workdir_for(workdir) as wd:
        full_cfg = EngineConfig(block_tokens=bt, kv_gpu_blocks=per_seq * num_prompts, seed=seed,
                                decode_kernel=decode_kernel, decode_graphs=decode_graphs, workdir=wd / "full")
        tight_cfg = EngineConfig(resident_frac=resident_frac, expert_store=StoreKind.NVME, block_tokens=bt,
                                 kv_gpu_blocks=per_seq * num_prompts, kv_cpu_blocks=max(1, per_seq * num_prompts // 2),
                                 kv_nvme_blocks=per_seq * num_prompts, spill_kv_every_step=True, seed=seed,
                                 decode_kernel=decode_kernel, decode_graphs=decode_graphs, workdir=wd / "tight",
                                 expert_map_in=expert_map_in, expert_poison=expert_poison,
                                 expert_publish=expert_publish)
        runs = []
        for cfg in (full_cfg, tight_cfg):
            eng = ReferenceEngine(spec, dev, cfg)
            try:
                runs.append(eng.generate(prompts, new_tokens))
            finally:
                eng.close()
    a, b = runs
    return ExactResult(
        max_abs_diff=float((a.logits - b.logits).abs().max()), tokens_equal=a.tokens == b.tokens,
        steps=a.logits.shape[0], expert_misses_full=a.expert_misses, expert_misses_tight=b.expert_misses,
        kv_fetches=b.kv_fetches, kv_spills=b.kv_spills, seconds=time.perf_counter() - t0,
    )
