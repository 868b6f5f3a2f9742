"""`tierplan bench offload`: decode with part of the experts resident, forced real routing, one run.

Runs in one process on one CUDA GPU (`--quick` on the CPU is a smoke run of the same code, not a figure). For
each model (qwen3-30b-a3b cut to 8 layers, mixtral-8x7b cut to 4), resident fraction F and batch B: B
sequences prefilled, then decode steps routed by the bundled routing trace (ForcedRouter fits it to the
model), every step returning its tokens to the host. Per point: tok/s, step ms, expert hit rate, expert-stall
ms, miss bytes and the link floor (miss bytes / pinned host->device bandwidth measured in this process), the
all-resident graph step ms of the same (model, B) with forced routing, and the steps per executor. Extra rows:
unforced all-resident graph decode (live routing, an engine without the table: forced and live decodes are
interleaved `reps` times and each reports its median), the layer-ahead window at B=64, the B=1 and 16 points
with misses once more with the piecewise GEMMs reading the experts' ranges instead of the slot table (`reads`),
and the scan rule vs LRU at Mixtral B=16 F=0.5. Writes offload_<device>.json/.md/.png; `--model DIR` runs one
local checkpoint whole instead (its real weights, experts streamed once into the pinned store) into
offload_<device>_<name>.*.
Bars are ratios within this run. It must never assert on a time or hard-code a figure.
"""

from __future__ import annotations

import json
import platform
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tierplan.bench.offload_report import write_report
from tierplan.runtime.device import Device
from tierplan.runtime.engine.engine import EngineConfig, ReferenceEngine
from tierplan.runtime.engine.executor import Executor
from tierplan.runtime.engine.hooks import ModelHooks
from tierplan.runtime.engine.presets import preset
from tierplan.runtime.engine.pretrained import (
    CheckpointExpertSource,
    PretrainedModel,
    engine_config_for,
    read_pretrained,
)
from tierplan.runtime.engine.routing_trace import RoutingTrace
from tierplan.runtime.engine.runner import ForcedRouter
from tierplan.runtime.engine.victims import ScanVictimOrder, lru_victim_order
from tierplan.runtime.engine.weights import expert_format
from tierplan.runtime.errors import ConfigError
from tierplan.runtime.selfcheck.exact import auto_block_tokens
from tierplan.runtime.weights.format import ExpertFormat, dtype_from_name
from tierplan.runtime.weights.stores import PinnedExpertStore

TRACE = Path(__file__).resolve().parents[1] / "data" / "routing" / "flame_moe_290m_sample.npz"


@dataclass(frozen=True)
class Sizes:
    models: tuple[tuple[str, int], ...]  # (preset, layers)
    fracs: tuple[float, ...]
    batches: tuple[int, ...]
    prompt_tokens: int
    warm_steps: int
    steps: int
    reps: int  # all-resident points: forced and live decodes interleaved this many times, medians reported


FULL = Sizes((("qwen3-30b-a3b", 8), ("mixtral-8x7b", 4)), (1.0, 0.5, 0.25), (1, 16, 64), 16, 4, 16, 5)
QUICK = Sizes((("tiny", 2),), (1.0, 0.5), (1, 2), 4, 1, 2, 2)


def _safe(name: str) -> str:
    """A file-name-safe form of a model name (a checkpoint folder's)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def _median_copy_s(dev: Device, dst: torch.Tensor, src: torch.Tensor, reps: int) -> float:
    """Seconds one `dst.copy_(src)` takes, the median of `reps` after one warm-up copy."""
    times = []
    for _ in range(reps + 1):
        dev.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        dev.synchronize()
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return times[len(times) // 2]


def link_gb_s(dev: Device, num_bytes: int, reps: int = 5) -> float:
    """Pinned host->device bandwidth (GB/s) of one `num_bytes` copy, median of `reps` (this process)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=dev.is_cuda)
    dst = torch.empty(num_bytes, dtype=torch.uint8, device=dev.torch_device)
    return num_bytes / _median_copy_s(dev, dst, src, reps) / 1e9


def memory_read_gb_s(dev: Device, num_bytes: int, reps: int = 5) -> float:
    """Device memory read bandwidth (GB/s): one device-to-device copy of `num_bytes` reads and writes them, so the
    reads alone run at about twice its byte rate; median of `reps` (this process; the host's memory on the CPU)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=dev.torch_device)
    return 2 * num_bytes / _median_copy_s(dev, torch.empty_like(src), src, reps) / 1e9


class DeviceRandomSource:
    """N(0, 0.02) experts drawn on the device and copied into the host record: a 10 GiB store in seconds
    rather than minutes of CPU randn (a bench's weights; exactness checks keep the seeded CPU source)."""

    def __init__(self, fmt: ExpertFormat, num_layers: int, num_experts: int, device: torch.device,
                 seed: int = 0) -> None:
        self.format, self.num_layers, self.num_experts, self.device = fmt, num_layers, num_experts, device
        self._gen = torch.Generator(device=device).manual_seed(seed)

    def fill(self, layer: int, expert: int, out: torch.Tensor) -> None:
        tensors = {t.name: (torch.randn(t.shape, generator=self._gen, device=self.device) * 0.02)
                   .to(dtype_from_name(t.dtype)).cpu() for t in self.format.tensors}
        self.format.pack(tensors, out)


def _counters(eng: ReferenceEngine) -> dict[str, float]:
    e, ex = eng.experts, eng.executors
    loads = eng.loader.stats() if eng.loader is not None else {"bytes": 0}
    return {"hits": e.hits, "misses": e.misses, "prefetch_hits": e.prefetch_hits, "stall_ms": e.stalls_ms,
            "bytes": loads["bytes"], "ready_waits": eng.pool.ready_waits, "guarded": loads.get("guarded", 0),
            "forced_unmaps": eng.pool.ranges.num_forced, "kept_maps": eng.pool.ranges.num_kept,
            **{f"steps_{x.value}": ex.steps[x] for x in Executor},
            **{f"phase_{k}": v for k, v in e.phase_ms.items()}}


def _decode(eng: ReferenceEngine, batch: int, sizes: Sizes, seq0: int) -> dict[str, Any]:
    """Prefill `batch` fresh sequences, warm up, then time `sizes.steps` decode steps one by one."""
    dev, vocab = eng.device, eng.spec.vocab_size
    seqs = list(range(seq0, seq0 + batch))
    prompts = [[(s * 131 + j * 7) % vocab for j in range(sizes.prompt_tokens)] for s in seqs]
    last = eng.step(seqs, prompts, [0] * batch).argmax(-1).tolist()
    pos = sizes.prompt_tokens
    times: list[float] = []
    c0: dict[str, float] = {}
    for i in range(sizes.warm_steps + sizes.steps):
        if i == sizes.warm_steps:
            c0 = _counters(eng)
        dev.synchronize()
        t0 = time.perf_counter()
        last = eng.step(seqs, [[t] for t in last], [pos] * batch).argmax(-1).tolist()
        times.append(time.perf_counter() - t0)
        pos += 1
    c1 = _counters(eng)
    for s in seqs:
        eng.cache.free(s)
    d = {k: c1[k] - c0[k] for k in c1}
    timed = sorted(times[sizes.warm_steps:])
    n = sizes.steps
    lookups = d["hits"] + d["misses"]
    return {"batch": batch, "step_ms": sum(timed) / n * 1e3, "step_ms_p50": timed[n // 2] * 1e3,
            "tok_s": batch * n / sum(timed), "hit_rate": d["hits"] / lookups if lookups else 1.0,
            "prefetch_hits": d["prefetch_hits"], "stall_ms_per_step": d["stall_ms"] / n,
            "miss_bytes_per_step": d["bytes"] / n, "misses_per_step": d["misses"] / n,
            "ready_waits_per_step": d["ready_waits"] / n, "forced_unmaps": int(d["forced_unmaps"]),
            "kept_maps_per_step": d["kept_maps"] / n,
            "guarded_loads_per_step": d["guarded"] / n,
            "executors": {x.value: int(d[f"steps_{x.value}"]) for x in Executor},
            "reasons": {k.value: v for k, v in eng.executors.reasons.items()},
            "phase_ms_per_step": {k[6:]: round(v / n, 3) for k, v in d.items() if k.startswith("phase_")},
            "capture_error": eng.graphs.last_capture_error if eng.graphs is not None else None}


def _median_rep(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """The repetition with the median step time, with every repetition's step ms (`step_ms_reps`, in run order)
    and the executors summed over all of them."""
    mid = sorted(reps, key=lambda r: r["step_ms"])[len(reps) // 2]
    return {**mid, "step_ms_reps": [round(r["step_ms"], 4) for r in reps], "reps": len(reps),
            "executors": {x: sum(r["executors"][x] for r in reps) for x in mid["executors"]}}


def _resident_pair(eng: ReferenceEngine, live: ReferenceEngine, b: int, sizes: Sizes,
                   seq0: int) -> tuple[dict[str, Any], dict[str, Any], int]:
    """All-resident decode at batch b with forced routes (`eng`) and live routing (`live`, no table: the
    unforced graph), interleaved `sizes.reps` times, the order swapped every repetition; the median of each."""
    forced: list[dict[str, Any]] = []
    unforced: list[dict[str, Any]] = []
    for i in range(sizes.reps):
        for e, out in ((eng, forced), (live, unforced))[:: 1 if i % 2 == 0 else -1]:
            out.append(_decode(e, b, sizes, seq0))
            seq0 += b
    return _median_rep(forced), _median_rep(unforced), seq0


def _engine(spec: Any, dev: Device, frac: float, sizes: Sizes, router: ForcedRouter | None,
            graphs: bool | None, store: PinnedExpertStore, reads: str | None = None) -> ReferenceEngine:
    bt = auto_block_tokens(spec)
    per_seq = -(-(sizes.prompt_tokens + sizes.warm_steps + sizes.steps + 2) // bt)
    cfg = EngineConfig(resident_frac=frac, block_tokens=bt, kv_gpu_blocks=per_seq * max(sizes.batches) + 1,
                       decode_graphs=graphs, decode_kernel=True if graphs else None,
                       expert_reads=reads)  # type: ignore[arg-type]
    cfg = engine_config_for(spec, cfg)  # a checkpoint's sliding window: no paged kernel, no graphs
    return ReferenceEngine(spec, dev, cfg, hooks=ModelHooks(forced_routes=router), pinned_store=store)


def _range_point(spec: Any, dev: Device, frac: float, b: int, sizes: Sizes, router: ForcedRouter,
                 graphs: bool | None, store: PinnedExpertStore, seq0: int, say: Any) -> dict[str, Any]:
    """Batch b at `frac` with expert_reads="range" (each miss waits for its map calls): the slot table's effect."""
    eng = _engine(spec, dev, frac, sizes, router, graphs, store, reads="range")
    try:
        r = _decode(eng, b, sizes, seq0)
    finally:
        eng.close()
    r.update(model=spec.name, frac=frac, victims="lru", lookahead=0, forced=True, reads="range")
    say(f"{spec.name} F={frac} B={b} reads=range: {r['step_ms']:.2f} ms/step phases={r['phase_ms_per_step']} "
        f"executors={r['executors']}")
    return r


def _preload(eng: ReferenceEngine) -> None:
    """Every expert resident (F = 1): one list per layer."""
    assert eng.loader is not None
    for layer in range(eng.pool.layout.num_layers):
        absent = [e for e in range(eng.pool.layout.num_experts) if not eng.pool.is_resident(layer, e)]
        for f in eng.loader.load_many(layer, absent):
            f.wait()
    eng.device.synchronize()


def run_model(name: str, layers: int, dev: Device, sizes: Sizes, bw_gb_s: float, trace: RoutingTrace,
              graphs: bool | None, say: Any, model: PretrainedModel | None = None) -> list[dict[str, Any]]:
    """model: a checked checkpoint run whole (name and layers are then unused), else the preset `name`."""
    spec = model.spec if model is not None else preset(name).truncated(layers)
    router = ForcedRouter(trace, spec=spec, device=dev.torch_device)
    rows: list[dict[str, Any]] = []
    resident_ms: dict[int, float] = {}
    seq0 = 0
    t0 = time.perf_counter()
    src = (CheckpointExpertSource(model, expert_format(spec)) if model is not None else
           DeviceRandomSource(expert_format(spec), len(spec.moe_layers), spec.num_experts, dev.torch_device))
    store = PinnedExpertStore(dev, src)
    say(f"{spec.name}: pinned store of {store.records.total_bytes / 2**30:.1f} GiB in "
        f"{time.perf_counter() - t0:.1f} s")
    for frac in sizes.fracs:
        eng = _engine(spec, dev, frac, sizes, router, graphs, store)
        live = _engine(spec, dev, frac, sizes, None, graphs, store) if frac >= 1.0 else None
        try:
            if live is not None:
                _preload(eng)
                _preload(live)
            for b in sizes.batches:
                if live is not None:  # forced vs unforced graph decode, interleaved (medians of sizes.reps)
                    r, u, seq0 = _resident_pair(eng, live, b, sizes, seq0)
                    r.update(model=spec.name, frac=frac, victims="lru", lookahead=0, forced=True)
                    u.update(model=spec.name, frac=frac, victims="lru", lookahead=0, forced=False)
                    resident_ms[b] = r["step_ms"]
                    rows += [r, u]
                    say(f"{spec.name} F={frac} B={b} forced {r['step_ms']:.3f} ms (reps {r['step_ms_reps']}) vs "
                        f"live {u['step_ms']:.3f} ms (reps {u['step_ms_reps']}): "
                        f"{r['step_ms'] / u['step_ms'] - 1:+.1%} executors={r['executors']}/{u['executors']}")
                    continue
                variants = [("lru", 0)]
                if frac < 1.0 and b == max(sizes.batches):
                    variants.append(("lru", 2))
                if frac == 0.5 and b == 16 and name.startswith("mixtral"):
                    variants.append(("scan", 0))
                for victims, lookahead in variants:
                    eng.experts.set_victim_order(ScanVictimOrder(eng.experts) if victims == "scan"
                                                 else lru_victim_order)
                    eng.residency.lookahead = lookahead
                    r = _decode(eng, b, sizes, seq0)
                    seq0 += b
                    r.update(model=spec.name, frac=frac, victims=victims, lookahead=lookahead, forced=True,
                             reads="table" if eng.model.table_reads else "range")
                    rows.append(r)
                    say(f"{spec.name} F={frac} B={b} {victims} lookahead={lookahead}: {r['step_ms']:.2f} ms/step "
                        f"hit={r['hit_rate']:.3f} executors={r['executors']} phases={r['phase_ms_per_step']} "
                        f"ready_waits={r['ready_waits_per_step']:.1f} guarded={r['guarded_loads_per_step']:.1f} "
                        f"kept={r['kept_maps_per_step']:.1f} misses={r['misses_per_step']:.1f} "
                        f"reasons(total)={r['reasons']} "
                        f"capture_error={r['capture_error']}")
            if frac < 1.0:  # the same points with the GEMMs reading the experts' ranges (B=1 and 16)
                for b in [b for b in sizes.batches if b in (1, 16)]:
                    rows.append(_range_point(spec, dev, frac, b, sizes, router, graphs, store, seq0, say))
                    seq0 += b
        finally:
            eng.close()
            if live is not None:
                live.close()
    store.close()
    for r in rows:
        base = resident_ms.get(r["batch"])
        floor = r["miss_bytes_per_step"] / (bw_gb_s * 1e9) * 1e3
        r["link_floor_ms"] = floor
        r["resident_graph_step_ms"] = base
        if base is not None:
            r["bar_ms"] = 1.15 * (base + floor)
            r["vs_bar"] = r["step_ms"] / r["bar_ms"]
            r["vs_max_compute_link"] = r["step_ms"] / max(base, floor)
    return rows


def run_offload_bench(out_dir: Path, device: str = "cuda", quick: bool = False, console: Any = None,
                      models: tuple[str, ...] = (), model_dir: Path | None = None) -> dict:
    """models: only these presets (all of the sizes' models when empty); model_dir: one checkpoint instead."""
    if model_dir is not None and models:
        raise ConfigError(f"models {list(models)} and model_dir {str(model_dir)!r} both given; expected one")
    checkpoint = read_pretrained(model_dir) if model_dir is not None else None  # refused before any work
    dev = Device(device)
    sizes = QUICK if quick else FULL
    say = console.print if console is not None else print
    bw = link_gb_s(dev, (8 << 20) if quick else (256 << 20))
    meta = {"device": torch.cuda.get_device_name() if dev.is_cuda else platform.processor() or "cpu",
            "torch": torch.__version__, "quick": quick, "when": time.strftime("%Y-%m-%d %H:%M:%S"),
            "h2d_gb_s": bw, "sizes": sizes.__dict__}
    trace = RoutingTrace.load(TRACE)
    rows = []
    from tierplan.runtime.engine.kernels.paged_attention import interpreted

    graphs = None if dev.is_cuda else interpreted()  # the CPU twin's graph executors need Triton's interpreter
    for name, layers in sizes.models if checkpoint is None else ():
        if models and name not in models:
            continue
        rows += run_model(name, layers, dev, sizes, bw, trace, graphs, say)
    if checkpoint is not None:
        meta["model_dir"] = str(checkpoint.folder.resolve())
        rows += run_model(checkpoint.spec.name, checkpoint.spec.num_layers, dev, sizes, bw, trace, graphs, say,
                          model=checkpoint)
    out = {"meta": meta, "rows": rows}
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"offload_{dev.torch_device.type}" + ("" if checkpoint is None else f"_{_safe(checkpoint.spec.name)}")
    (out_dir / f"{stem}.json").write_text(json.dumps(out, indent=1))
    write_report(out, out_dir / stem)
    return out
