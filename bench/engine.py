"""`tierplan bench engine`: the reference engine's kernels against bare baselines, measured in one run.

Runs in one process on one CUDA GPU (`--quick` on the CPU is a smoke run of the same code, not a figure).
  * MoE layer (router top-k, grouped GEMMs through the slot pool's strided views, fixed-order combine) vs a
    bare `torch._grouped_mm` pair on contiguous weights with the same routing, at Qwen3-30B-A3B shapes;
  * paged decode attention (Triton, block tables) vs SDPA on contiguous KV of the same lengths;
  * decode throughput of a whole preset, every expert resident (generated on the device), with the agent's
    taps and enforcement on and off (the agent's overhead is the ratio).
Writes engine_<device>.json and .md; every ratio is against a baseline timed in the same run. It must never
assert on a time (tests assert behaviour) or hard-code a figure.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tierplan.bench.engine_prefill import prefill_markdown
from tierplan.bench.engine_steps import GcWatch, last_n, median_or_zero, outbox_join_s, profile_eager_step, step_profile
from tierplan.bench.substrate import timed
from tierplan.runtime.device import Device
from tierplan.runtime.engine.moe import ExpertViews, moe_forward
from tierplan.runtime.memory.backend import make_backend
from tierplan.runtime.memory.slots import ExpertSlotPool
from tierplan.runtime.weights.format import ExpertFormat


def timed_gpu(dev: Device, fn: Callable[[], Any], reps: int) -> float:
    """Seconds per call of fn as the engine runs it in a decode step: on a GPU captured in a CUDA graph and
    replayed `reps` times back to back (device time, no host launch cost); on a CPU the plain median."""
    if not dev.is_cuda:
        return timed(dev, fn, reps)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    dev.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    dev.synchronize()
    return (time.perf_counter() - t0) / reps


class _AllResident:
    capacity = 1 << 30

    def all_resident(self, layer: int) -> bool:
        return True

    def chunks(self, layer: int, needed: list[int]) -> list[list[int]]:  # pragma: no cover - never called
        return [needed]

    def ensure(self, layer: int, experts: list[int]) -> None:  # pragma: no cover - never called
        raise AssertionError("all resident")

    def done_reading(self, layer: int, experts: list[int]) -> None:  # pragma: no cover - never called
        raise AssertionError("all resident")


def moe_vs_grouped(dev: Device, hidden: int, inter: int, experts: int, top_k: int, batch: int, reps: int) -> dict:
    fmt = ExpertFormat.swiglu(hidden, inter)
    pool = ExpertSlotPool(make_backend(dev), dev, 1, experts, fmt.num_bytes, experts)
    g = torch.Generator().manual_seed(0)
    for e in range(experts):
        dst = pool.prepare_load(0, e)
        dst.copy_((torch.randn(fmt.num_bytes // 2, generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8))
        pool.complete_load(0, e, True)
    views = ExpertViews(pool, fmt, 0)
    w_gu = views.gate_up.contiguous()  # [E, 2I, H] the bare baseline's own contiguous copy
    w_dn = views.down.contiguous()  # [E, H, I]
    x = (torch.randn(batch, hidden, generator=g) * 0.1).to(torch.bfloat16).to(dev.torch_device)  # [B, H]
    router = (torch.randn(experts, hidden, generator=g) * 0.02).to(torch.bfloat16).to(dev.torch_device)
    probs = F.softmax((x @ router.t()).float(), -1)
    wts, ids = probs.topk(top_k, -1)
    provider = _AllResident()

    def ours() -> None:
        moe_forward(x, ids, wts, views, 0, provider)

    def bare() -> None:
        flat = ids.reshape(-1)
        order = torch.argsort(flat)
        counts = torch.zeros(experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat,
                                                                                         torch.ones_like(flat))
        offs = torch.cumsum(counts, 0).to(torch.int32)  # (bincount would sync with the host: no graph)
        xs = x[order // top_k]
        gu = torch._grouped_mm(xs, w_gu.transpose(-2, -1), offs=offs)
        a, b = gu.split(inter, -1)
        torch._grouped_mm(F.silu(a) * b, w_dn.transpose(-2, -1), offs=offs)

    t_ours, t_bare = timed_gpu(dev, ours, reps), timed_gpu(dev, bare, reps)
    pool.close()
    return {"hidden": hidden, "inter": inter, "experts": experts, "top_k": top_k, "batch": batch,
            "moe_layer_ms": t_ours * 1e3, "grouped_gemm_ms": t_bare * 1e3, "ratio": t_ours / t_bare}


def paged_vs_sdpa(dev: Device, batch: int, ctx: int, hq: int, hkv: int, d: int, block: int, reps: int,
                  padded_to: int = 0) -> dict:
    """`padded_to`: the batch's rows are padded to this CUDA-graph bucket as the engine pads a decode step
    (padding rows read one token of a block no sequence owns). The kernel runs with the engine's split sizing
    (by the fewest sequences the rows can hold) and, beside it in the same run, with its splits sized by the
    rows themselves (the sizing before phase run 61)."""
    from tierplan.runtime.engine.graphs import fewest_rows
    from tierplan.runtime.engine.kernels.paged_attention import interpreted, num_splits, paged_decode_attention

    g = torch.Generator().manual_seed(1)
    nb = ctx // block
    rows = max(batch, padded_to)
    tdev = dev.torch_device
    k = torch.randn(batch * nb + 1, block, hkv, d, generator=g).to(torch.bfloat16).to(tdev)  # [N, T, Hkv, D]
    v = torch.randn(batch * nb + 1, block, hkv, d, generator=g).to(torch.bfloat16).to(tdev)
    table = torch.full((rows, nb), batch * nb, dtype=torch.int32)  # padding rows: the last block only
    table[:batch] = torch.randperm(batch * nb, generator=g).view(batch, nb)  # scattered blocks
    table = table.to(tdev)
    lens = torch.tensor([ctx] * batch + [1] * (rows - batch), dtype=torch.int32, device=tdev)
    q = torch.randn(rows, hq, d, generator=g).to(torch.bfloat16).to(tdev)
    real_rows = fewest_rows(rows)  # as the engine sizes the splits (attention.gqa_decode_paged)
    real_table = table[:batch].long()
    kc = k[real_table].reshape(batch, ctx, hkv, d).transpose(1, 2).contiguous()  # [B, Hkv, C, D] contiguous
    vc = v[real_table].reshape(batch, ctx, hkv, d).transpose(1, 2).contiguous()
    qs = q[:batch].view(batch, hq, 1, d)

    kernel = dev.is_cuda or interpreted()  # on a plain CPU the engine reads paged KV with torch instead

    def ours(splits_rows: int | None = real_rows) -> None:
        if kernel:
            paged_decode_attention(q, k, v, table, lens, real_rows=splits_rows)
            return
        kk = k[real_table].reshape(batch, ctx, hkv, d).transpose(1, 2)  # [B, Hkv, C, D] gathered by table
        vv = v[real_table].reshape(batch, ctx, hkv, d).transpose(1, 2)
        F.scaled_dot_product_attention(qs, kk, vv, enable_gqa=True)

    def sdpa() -> None:
        F.scaled_dot_product_attention(qs, kc, vc, enable_gqa=True)

    t_ours, t_sdpa = timed_gpu(dev, ours, reps), timed_gpu(dev, sdpa, reps)
    t_rows = timed_gpu(dev, lambda: ours(None), reps) if kernel else None
    return {"batch": batch, "ctx": ctx, "hq": hq, "hkv": hkv, "d": d, "block": block, "padded_to": rows,
            "splits": num_splits(rows, hkv, real_rows), "splits_by_padded_rows": num_splits(rows, hkv),
            "paged_ms": t_ours * 1e3, "sdpa_ms": t_sdpa * 1e3, "ratio": t_ours / t_sdpa,
            "paged_ms_splits_by_padded_rows": None if t_rows is None else t_rows * 1e3,
            "paged_kernel": "triton" if kernel else "torch gather + SDPA (CPU reference)"}


def decode_throughput(dev: Device, preset_name: str, num_layers: int | None, batches: list[int], steps: int,
                      rounds: int = 3, graphs: bool = True, window_steps: int = 128,
                      block_steps: int = 16) -> list[dict]:
    """tok/s of decode with the agent off and on, interleaved: each of `rounds` fresh batches (16-token
    prefill) decodes `steps` steps in blocks of `block_steps`, the agent switched per block in ABBA order
    (off on on off, next quad on off off on). Adjacent blocks see the same batch at nearly the same context
    length, so each quad gives a paired overhead estimate that cancels the context's linear growth; the
    median over quads is reported beside the all-blocks ratio. Decode steps are CUDA-graph replays
    (`graphs`) or eager. Telemetry windows close mid-block and are built on the outbox thread beside decode,
    as in serving; any build still running when an off-block starts is waited for and charged to the
    on-block before it. The table beside it says what a window costs if nothing overlaps it."""
    from tierplan.agent.adapters.reference import ReferenceAdapter
    from tierplan.runtime.engine.engine import EngineConfig, ReferenceEngine
    from tierplan.runtime.engine.presets import preset
    from tierplan.runtime.selfcheck.exact import auto_block_tokens

    if block_steps < 1 or steps % (4 * block_steps):
        raise ValueError(f"steps={steps} must be a multiple of 4 x block_steps={block_steps} (ABBA quads)")
    if window_steps % block_steps:
        raise ValueError(f"window_steps={window_steps} must be a multiple of block_steps={block_steps} "
                         "(windows then close mid-block)")
    spec = preset(preset_name) if num_layers is None else preset(preset_name).truncated(num_layers)
    bt, prompt, warm = auto_block_tokens(spec), 16, 2 + block_steps
    per_seq = -(-(prompt + warm + steps + 1) // bt)
    eng = ReferenceEngine(spec, dev, EngineConfig(experts_on_device=True, block_tokens=bt, decode_graphs=graphs,
                                                  kv_gpu_blocks=per_seq * max(batches)))
    out, next_id = [], 0
    adapter = ReferenceAdapter(eng, window_steps=window_steps)
    gc_watch = GcWatch()  # collector pauses (any thread) by the block they fell in
    try:
        taps = (eng.model.route_tap, eng.model.mass_observer)

        def switch(agent_on: bool) -> None:
            tap, mass = taps if agent_on else (None, None)
            eng.set_hooks(route_tap=tap, mass_observer=mass)

        def decode(seqs: list[int], last: list[int], pos: int) -> list[int]:
            """One greedy decode step; the host needs the tokens (as a server does)."""
            return eng.step(seqs, [[t] for t in last], [pos] * len(seqs)).argmax(-1).tolist()

        for b in batches:
            blocks: dict[bool, list[float]] = {False: [], True: []}
            quads: list[float] = []
            hook_ms: dict[bool, list[float]] = {False: [], True: []}  # on_step calls: plain / closing a window
            join_ms: list[float] = []
            step_log: list[tuple[bool, int, int, int, float, float, int]] = []
            sent_before = adapter.outbox.sent
            gc_watch.reset()
            for r in range(rounds):
                seqs = list(range(next_id, next_id + b))
                next_id += b
                switch(False)
                logits = eng.step(seqs, [[1 + (s * 7 + j) % 100 for j in range(prompt)] for s in seqs], [0] * b)
                last, pos = logits.argmax(-1).tolist(), prompt
                for agent_on in (False, True):  # untimed: both graphs (with and without saved queries) exist
                    switch(agent_on)
                    last = decode(seqs, last, pos)
                    pos += 1
                    if agent_on:
                        adapter.on_step(None, 0.0)
                # Untimed agent-on steps until the adapter's step count is half a block past a block boundary:
                # on-blocks advance it in whole blocks, so every window then closes mid-block, as it would at
                # any step of a serving loop, and its message is built beside the rest of that block.
                while adapter.steps % block_steps != block_steps // 2:
                    last = decode(seqs, last, pos)
                    pos += 1
                    adapter.on_step(None, 0.0)
                adapter.outbox.join()
                order = (False, True, True, False) if r % 2 == 0 else (True, False, False, True)
                timed: list[list[Any]] = []  # [agent_on, seconds] per block of this round
                for k in range(steps // block_steps):
                    agent_on = order[k % 4]
                    if not agent_on and timed and timed[-1][0]:
                        # Telemetry is built on the outbox thread while decode goes on; what is still unbuilt
                        # when an off-block starts is charged to the on-block before it (never to an off-block).
                        timed[-1][1] += outbox_join_s(adapter, join_ms)
                    switch(agent_on)
                    dev.synchronize()
                    gc_watch.block = agent_on
                    t0 = time.perf_counter()
                    for i in range(block_steps):
                        ts = time.perf_counter()
                        last = decode(seqs, last, pos)
                        pos += 1
                        hook = 0.0
                        if agent_on:
                            t1 = time.perf_counter()
                            adapter.on_step(None, 0.0)
                            hook = (time.perf_counter() - t1) * 1e3
                            hook_ms[adapter.steps % window_steps == 0].append(hook)
                        # one row per timed step: where a slow on-step sits relative to window closes
                        step_log.append((agent_on, r, k, i, (time.perf_counter() - ts) * 1e3, hook,
                                         adapter.steps % window_steps if agent_on else -1))
                    dev.synchronize()
                    timed.append([agent_on, time.perf_counter() - t0])
                    gc_watch.block = None
                if timed[-1][0]:
                    timed[-1][1] += outbox_join_s(adapter, join_ms)
                for k in range(0, len(timed), 4):
                    quad = {on: sum(dt for o, dt in timed[k : k + 4] if o is on) for on in (False, True)}
                    quads.append(quad[True] / quad[False] - 1.0)
                for agent_on, dt in timed:
                    blocks[agent_on].append(dt)
                for s in seqs:
                    eng.cache.free(s)
            off_s, on_s = sum(blocks[False]), sum(blocks[True])
            n_steps = len(blocks[False]) * block_steps  # as many on-steps as off-steps
            quads.sort()
            out.append({"preset": spec.name, "batch": b, "steps": steps, "graphs": graphs,
                        "window_steps": window_steps, "block_steps": block_steps,
                        "fallbacks": eng.executors.as_dict()["reasons"],
                        "tok_s_agent_off": b * n_steps / off_s, "tok_s_agent_on": b * n_steps / on_s,
                        "step_ms_agent_off": off_s / n_steps * 1e3, "agent_overhead": on_s / off_s - 1.0,
                        "rounds": rounds, "quads": len(quads),
                        "agent_overhead_paired_median": quads[len(quads) // 2],
                        "agent_overhead_quad_p25": quads[len(quads) // 4],
                        "agent_overhead_quad_p75": quads[(3 * len(quads)) // 4],
                        # where the agent's host time goes (engine thread unless said)
                        "agent_on_step_ms_median": median_or_zero(hook_ms[False]),
                        "window_close_ms_median": median_or_zero(hook_ms[True]), "windows": len(hook_ms[True]),
                        "window_build_ms_median": median_or_zero(last_n(adapter.outbox.build_ms,
                                                                adapter.outbox.sent - sent_before)),  # outbox
                        "block_join_ms_max": max(join_ms, default=0.0),
                        "gc_ms_agent_off": gc_watch.ms[False], "gc_ms_agent_on": gc_watch.ms[True],
                        "gc_full_collections_off": gc_watch.full[False], "gc_full_collections_on": gc_watch.full[True],
                        "agent_host_share": (sum(hook_ms[False]) + sum(hook_ms[True]) + sum(join_ms)) / 1e3 / on_s,
                        **step_profile(step_log)})
    finally:
        gc_watch.close()
        adapter.close()
        eng.close()
    return out


SECTIONS = ("moe", "attention", "decode", "eager", "prefill")


def run_engine_bench(out_dir: Path, device: str = "cuda", quick: bool = False, console: Any = None,
                     profile: bool = False, sections: tuple[str, ...] = SECTIONS, rounds: int = 3) -> dict:
    dev = Device(device)
    say = console.print if console is not None else print
    reps = 3 if quick else 50
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if dev.is_cuda else platform.processor() or "cpu",
                           "torch": torch.__version__, "quick": quick, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    shapes = [(64, 32, 8, 2, b) for b in (1, 4)] if quick else [(2048, 768, 128, 8, b) for b in (1, 64)]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown bench sections {sorted(unknown)}; expected some of {SECTIONS}")
    res["moe"] = [moe_vs_grouped(dev, *s, reps) for s in shapes] if "moe" in sections else []
    say(f"moe: {res['moe']}")
    # (batch, padded to): full buckets, and the decode steps of phase run 61 (8 and 9 sequences of 16K context)
    att = [((2, 64, 4, 2, 16, 16), 0), ((3, 64, 4, 2, 16, 16), 4)] if quick else \
        [((b, c, 32, 4, 128, 16), 0) for b in (32, 128) for c in (4096, 16384)] + \
        [((b, 16384, 32, 4, 128, 16), p) for b, p in ((8, 0), (9, 16), (12, 16), (16, 0), (17, 24))]
    res["attention"] = [paged_vs_sdpa(dev, *a, reps, padded_to=p) for a, p in att] if "attention" in sections else []
    say(f"attention: {res['attention']}")
    res["decode"] = []
    modes = [g for g, name in ((True, "decode"), (False, "eager")) if name in sections and (dev.is_cuda or not g)]
    for graphs in modes:
        # A Telemetry window every 128 steps (~1.2 s at B=1); two windows are built inside each timed span.
        # Eager rows are the slow reference: fewer steps.
        res["decode"] += (decode_throughput(dev, "tiny", None, [1, 4], 4, rounds=1, graphs=graphs, window_steps=2,
                                            block_steps=1)
                          if quick else
                          decode_throughput(dev, "qwen3-30b-a3b", None, [1, 64], 256 if graphs else 32,
                                            rounds=rounds if graphs else 2, graphs=graphs,
                                            window_steps=128 if graphs else 16, block_steps=16 if graphs else 8))
        say(f"decode: {res['decode'][-2:]}")
    res["prefill"] = []
    if "prefill" in sections:
        from tierplan.bench.engine_prefill import prefill_steps
        from tierplan.runtime.engine.kernels.paged_attention import HAS_TRITON, interpreted

        # qwen3 cut to the phase sweep's 8 layers: 48 decodes at 1K beside a 1K prefill (phase run 28's b128 steps)
        name, layers, decodes, ctx, long, reps = ("tiny", None, 4, 32, 64, 1) if quick else \
            ("qwen3-30b-a3b", 8, 48, 1024, 16384, 3)
        # The paged kernel on a GPU, or on the CPU in Triton's interpreter (TRITON_INTERPRET=1, as the tests run)
        for kernel in (False, True) if HAS_TRITON and (dev.is_cuda or interpreted()) else (False,):
            row = prefill_steps(dev, name, layers, decodes, ctx, long, reps, kernel, profile=profile and kernel)
            if text := row.pop("profile_long"):
                out_dir.mkdir(parents=True, exist_ok=True)
                (out_dir / "profile_prefill_long.txt").write_text(
                    f"# {row['preset']}, {row['layers']} layers: one prefill of {row['long_tokens']} tokens\n\n{text}")
            res["prefill"].append(row)
            say(f"prefill: {row}")
    if profile and dev.is_cuda:
        (out_dir / "profile_eager_step.txt").parent.mkdir(parents=True, exist_ok=True)
        (out_dir / "profile_eager_step.txt").write_text(profile_eager_step(dev, "tiny" if quick else "qwen3-30b-a3b"))
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"engine_{device}"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=2))
    md = [f"# Engine kernels ({res['device']}, torch {res['torch']}, {res['when']})", "",
          "| MoE layer | batch | ours ms | bare grouped GEMM ms | ratio |", "|---|---|---|---|---|"]
    md += [f"| h{m['hidden']} i{m['inter']} E{m['experts']} k{m['top_k']} | {m['batch']} | {m['moe_layer_ms']:.3f} | "
           f"{m['grouped_gemm_ms']:.3f} | {m['ratio']:.2f} |" for m in res["moe"]]
    md += ["", "| decode attention | batch | padded to | ctx | splits | paged ms | SDPA contiguous ms | ratio "
           "| splits by padded rows | paged ms with those |", "|---|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {a['hq']}q/{a['hkv']}kv d{a['d']} | {a['batch']} | {a['padded_to']} | {a['ctx']} | {a['splits']} | "
           f"{a['paged_ms']:.3f} | {a['sdpa_ms']:.3f} | {a['ratio']:.2f} | {a['splits_by_padded_rows']} | "
           + ("—" if a["paged_ms_splits_by_padded_rows"] is None else f"{a['paged_ms_splits_by_padded_rows']:.3f}")
           + " |" for a in res["attention"]]
    md += ["", "Decode: agent off and on interleaved in blocks of steps, ABBA order, over fresh batches (rounds); "
           "overhead = on time / off time - 1 over all blocks, and the median (p25..p75) of the per-quad ratios.", "",
           "| decode, all experts resident | step | batch | steps × rounds | block | telemetry window (steps) "
           "| tok/s agent off | tok/s agent on | step ms | agent overhead (all blocks) "
           "| per-quad median, typical step (p25..p75) | eager fallbacks |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {x['preset']} | {'CUDA graph' if x['graphs'] else 'eager'} | {x['batch']} | "
           f"{x['steps']} × {x['rounds']} | {x['block_steps']} | {x['window_steps']} | "
           f"{x['tok_s_agent_off']:.1f} | "
           f"{x['tok_s_agent_on']:.1f} | {x['step_ms_agent_off']:.2f} | {x['agent_overhead'] * 100:+.2f} % | "
           f"{x['agent_overhead_paired_median'] * 100:+.2f} % ({x['agent_overhead_quad_p25'] * 100:+.2f} .. "
           f"{x['agent_overhead_quad_p75'] * 100:+.2f}) | "
           f"{x['fallbacks'] or '-'} |" for x in res["decode"]]
    md += ["", "Where the agent's host time went in the on-blocks (engine thread unless said):", "",
           "| step | batch | on_step median ms | window close median ms (windows) | window build median ms "
           "(outbox thread) | longest wait for the outbox ms | agent host time / on-block time "
           "| GC pauses ms off / on (full collections) |",
           "|---|---|---|---|---|---|---|---|"]
    md += [f"| {'CUDA graph' if x['graphs'] else 'eager'} | {x['batch']} | {x['agent_on_step_ms_median']:.3f} | "
           f"{x['window_close_ms_median']:.2f} ({x['windows']}) | {x['window_build_ms_median']:.2f} | "
           f"{x['block_join_ms_max']:.2f} | {x['agent_host_share'] * 100:.2f} % | "
           f"{x['gc_ms_agent_off']:.1f} / {x['gc_ms_agent_on']:.1f} ({x['gc_full_collections_off']} / "
           f"{x['gc_full_collections_on']}) |" for x in res["decode"]]
    md += ["", "Per-step wall time (decode + agent hook): medians, time above the median summed over each set, and "
           "the five slowest steps (on/off, round.block.step, ms, window position: steps since a window closed).",
           "", "| step | batch | median ms off / on | above-median ms off / on | slowest steps |",
           "|---|---|---|---|---|"]
    md += [f"| {'CUDA graph' if x['graphs'] else 'eager'} | {x['batch']} | {x['step_ms_median_off']:.2f} / "
           f"{x['step_ms_median_on']:.2f} | {x['step_ms_excess_off']:.1f} / {x['step_ms_excess_on']:.1f} | "
           + ", ".join(f"{'on' if s['agent_on'] else 'off'} {s['round']}.{s['block']}.{s['step']} {s['ms']:.1f}"
                       f"{'' if s['window_pos'] < 0 else ' w' + str(s['window_pos'])}" for s in x["slowest_steps"][:5])
           + " |" for x in res["decode"]]
    md += prefill_markdown(res["prefill"])
    stem.with_suffix(".md").write_text("\n".join(md) + "\n")
    return res
