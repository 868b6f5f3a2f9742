"""`tierplan bench engine --only prefill`: what a step with a prefill in it costs, and where it goes.

Runs in the bench process on one device (`--quick` on the CPU is a smoke run of the same code, not a figure).
Every expert resident on the device, so only the step's own work is timed (no expert moves), at the preset's
shapes cut to `num_layers` layers (the phase sweep's cut). Per decode path (the paged kernel on, and off: the
reference path, the baseline timed in the same run), the wall time of
  * a decode-only step of `decodes` sequences at `context` tokens each,
  * the same decodes beside one prefill of `context` tokens (a mixed step: the H200 phase runs' b128 steps held
    1-6 prefills beside ~50 decodes, and took 340-430 ms against 45 ms for a prefill alone: phase run 28),
  * that prefill alone, and one of `long_tokens` (a 16K point's prompt: 2.2-4.3 s a step in phase runs 27-28),
and, with `profile`, torch.profiler's table of the long prefill (by device time). It must never assert on a time.
"""

from __future__ import annotations

from typing import Any

from tierplan.bench.substrate import timed
from tierplan.runtime.device import Device


def _timed(dev: Device, fn: Any, reps: int) -> float:
    """Median wall ms of `fn()` over `reps` calls (`substrate.timed`; the caller warmed the engine up)."""
    return timed(dev, fn, reps, warmup=0) * 1e3


def prefill_steps(dev: Device, preset_name: str, num_layers: int | None, decodes: int, context: int,
                  long_tokens: int, reps: int, decode_kernel: bool, profile: bool = False) -> dict[str, Any]:
    """One row: the step times above on one decode path (module docstring); `profile_long` holds the profiler
    table where `profile` (else "")."""
    from tierplan.runtime.engine.engine import EngineConfig, ReferenceEngine
    from tierplan.runtime.engine.presets import preset
    from tierplan.runtime.selfcheck.exact import auto_block_tokens

    full = preset(preset_name)
    spec = full.truncated(num_layers) if num_layers and num_layers < full.num_layers else full
    bt = auto_block_tokens(spec)
    blocks = (decodes * (context + reps * 2 + 8) + (reps + 2) * (context + long_tokens)) // bt + 4 * (decodes + 4)
    eng = ReferenceEngine(spec, dev, EngineConfig(experts_on_device=True, block_tokens=bt, decode_graphs=False,
                                                  decode_kernel=decode_kernel, kv_gpu_blocks=blocks))
    vocab = spec.vocab_size

    def prompt(n: int, seed: int) -> list[int]:
        return [(seed * 7919 + 31 * i) % (vocab - 1) + 1 for i in range(n)]

    try:
        seqs = list(range(decodes))
        for lo in range(0, decodes, 8):  # the decoders' contexts, a few sequences a step
            part = seqs[lo:lo + 8]
            eng.step(part, [prompt(context, s) for s in part], [0] * len(part))
        pos = {"at": context}
        fresh = {"id": decodes}

        def decode_only() -> None:
            eng.step(seqs, [[1 + s % (vocab - 1)] for s in seqs], [pos["at"]] * decodes)
            pos["at"] += 1

        def with_prefill(tokens: int, beside: bool) -> Any:
            def run() -> None:
                new = fresh["id"]
                fresh["id"] += 1
                if beside:
                    eng.step([*seqs, new], [*([1 + s % (vocab - 1)] for s in seqs), prompt(tokens, new)],
                             [*([pos["at"]] * decodes), 0])
                    pos["at"] += 1
                else:
                    eng.step([new], [prompt(tokens, new)], [0])
                eng.cache.free(new)
            return run

        decode_only()  # warm-up: kernels compiled, allocator grown
        with_prefill(context, True)()
        row = {"preset": spec.name, "layers": spec.num_layers, "decode_kernel": decode_kernel, "decodes": decodes,
               "context": context, "long_tokens": long_tokens, "reps": reps,
               "decode_step_ms": _timed(dev, decode_only, reps),
               "mixed_step_ms": _timed(dev, with_prefill(context, True), reps),
               "prefill_step_ms": _timed(dev, with_prefill(context, False), reps),
               "long_prefill_step_ms": _timed(dev, with_prefill(long_tokens, False), max(1, reps - 1))}
        row["profile_long"] = _profiled(dev, with_prefill(long_tokens, False)) if profile else ""
        return row
    finally:
        eng.close()


def _profiled(dev: Device, fn: Any) -> str:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.is_cuda else [])
    with profile(activities=acts) as prof:
        fn()
        dev.synchronize()
    ka = prof.key_averages()
    return ka.table(sort_by="cuda_time_total" if dev.is_cuda else "cpu_time_total", row_limit=25)


def prefill_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The section's table: each step's ms per decode path, and the mixed step's paged / reference ratio."""
    if not rows:
        return []
    ref = {(r["decodes"], r["context"]): r for r in rows if not r["decode_kernel"]}
    md = ["", "Steps with a prefill, every expert resident (the step's own work): decode path, decode-only step, "
          "the same decodes beside one prefill of the context (mixed), that prefill alone, and a long prefill.", "",
          "| preset | layers | decode path | decodes x context | decode-only ms | mixed ms | prefill alone ms "
          "| long prefill ms (tokens) | mixed / reference path's |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = ref.get((r["decodes"], r["context"]))
        ratio = f"{r['mixed_step_ms'] / base['mixed_step_ms']:.2f}" if base and base["mixed_step_ms"] > 0 else "-"
        md.append(f"| {r['preset']} | {r['layers']} | {'paged kernel' if r['decode_kernel'] else 'reference'} | "
                  f"{r['decodes']} x {r['context']} | {r['decode_step_ms']:.1f} | {r['mixed_step_ms']:.1f} | "
                  f"{r['prefill_step_ms']:.1f} | {r['long_prefill_step_ms']:.1f} ({r['long_tokens']}) | {ratio} |")
    return md
