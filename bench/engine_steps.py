"""Step-level instruments of `tierplan bench engine` (bench process): GC pauses per agent block, the outbox
join, a per-step time profile of the agent off/on blocks, and a torch.profiler table of eager decode steps."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

from tierplan.runtime.device import Device


class GcWatch:
    """Times the cyclic garbage collector's pauses (they stop every thread that needs the GIL) and files
    them under the block running when they happened: agent off (False), on (True), or untimed (None)."""

    def __init__(self) -> None:
        self.block: bool | None = None
        self.reset()
        self._t0 = 0.0
        gc.callbacks.append(self._cb)

    def reset(self) -> None:
        self.ms = {False: 0.0, True: 0.0}
        self.full = {False: 0, True: 0}

    def _cb(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self.block is not None:
            self.ms[self.block] += (time.perf_counter() - self._t0) * 1e3
            self.full[self.block] += info.get("generation") == 2

    def close(self) -> None:
        gc.callbacks.remove(self._cb)


def outbox_join_s(adapter: Any, join_ms: list[float]) -> float:
    """Wait for the outbox to build every closed window; returns (and records, in ms) how long that took."""
    t0 = time.perf_counter()
    adapter.outbox.join()
    dt = time.perf_counter() - t0
    join_ms.append(dt * 1e3)
    return dt


def last_n(xs: Any, n: int) -> list[float]:
    """The last n entries of a bounded deque (all it still holds if fewer)."""
    return list(xs)[-n:] if n > 0 else []


def step_profile(log: list[tuple[bool, int, int, int, float, float, int]], top: int = 12) -> dict[str, Any]:
    """Per-step wall times (decode + the agent's hook) off and on: medians, the time above the median in each
    set, and the slowest steps with where they sat (round, block, step in block, steps since the last window
    closed; -1 when the agent was off), so a gap concentrated in a few steps can be told from a spread one."""
    ms = {on: [row[4] for row in log if row[0] is on] for on in (False, True)}
    med = {on: median_or_zero(ms[on]) for on in (False, True)}
    slow = sorted(log, key=lambda row: row[4], reverse=True)[:top]
    return {"step_ms_median_off": med[False], "step_ms_median_on": med[True],
            "step_ms_excess_off": sum(max(0.0, x - med[False]) for x in ms[False]),
            "step_ms_excess_on": sum(max(0.0, x - med[True]) for x in ms[True]),
            "slowest_steps": [{"agent_on": on, "round": r, "block": k, "step": i, "ms": round(t, 3),
                               "on_step_ms": round(h, 3), "window_pos": w} for on, r, k, i, t, h, w in slow]}


def median_or_zero(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def profile_eager_step(dev: Device, preset_name: str, batch: int = 1) -> str:
    """torch.profiler tables (by CPU and by CUDA time) of 3 eager decode steps: where an eager step goes."""
    from torch.profiler import ProfilerActivity, profile

    from tierplan.runtime.engine.engine import EngineConfig, ReferenceEngine
    from tierplan.runtime.engine.presets import preset
    from tierplan.runtime.selfcheck.exact import auto_block_tokens

    spec = preset(preset_name)
    eng = ReferenceEngine(spec, dev, EngineConfig(experts_on_device=True, block_tokens=auto_block_tokens(spec),
                                                  decode_graphs=False, kv_gpu_blocks=8 * batch))
    try:
        seqs = list(range(batch))
        last = eng.step(seqs, [[1, 2, 3, 4] for _ in seqs], [0] * batch).argmax(-1).tolist()
        for i in range(2):
            last = eng.step(seqs, [[t] for t in last], [4 + i] * batch).argmax(-1).tolist()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(3):
                last = eng.step(seqs, [[t] for t in last], [6 + i] * batch).argmax(-1).tolist()
        ka = prof.key_averages()
        return (ka.table(sort_by="cpu_time_total", row_limit=25) + "\n\n"
                + ka.table(sort_by="self_cpu_time_total", row_limit=25) + "\n\n"
                + ka.table(sort_by="cuda_time_total", row_limit=20))
    finally:
        eng.close()
