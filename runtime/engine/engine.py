"""The reference engine: builds weights, slot pool, stores, KV tiers and the model; runs generation.

Runs in the inference process (CPU twin or one GPU). `generate` prefills every prompt in one forward and
then decodes all sequences together, greedily. Placement knobs (`EngineConfig`): the fraction of experts
with a slot, where experts are loaded from, the KV capacity per tier, and `spill_kv_every_step`, which
moves every KV block off the GPU after each step (alternating CPU and NVMe) so the next step must fetch
them back: the exactness check runs the same prompts with and without these and compares bits.
A step is prepare (KV blocks grown and fetched as one list) -> pick its executor (executor.py: whole-step
graph, piecewise graphs with each layer's misses loaded between pieces, or eager; the reason an Enum,
counted in `executors`) -> after_step. Model hooks (taps, forced routes) come in through the constructor or
`set_hooks`. It must never decide placement beyond its configuration (the agent does) nor touch the network.
"""

from __future__ import annotations

import gc
import math
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import torch

from tierplan.runtime.device import Device
from tierplan.runtime.engine.attention import Segment, build_block_table
from tierplan.runtime.engine.config import AttentionKind, ModelSpec
from tierplan.runtime.engine.executor import PADDED, Executor, ExecutorStats, PieceResidency, Reason, known_routes
from tierplan.runtime.engine.experts import OnDemandExperts
from tierplan.runtime.engine.graphs import DecodeGraphs
from tierplan.runtime.engine.hooks import ModelHooks, StepRouting
from tierplan.runtime.engine.kernels import moe_gemm
from tierplan.runtime.engine.kv_cache import PagedKVCache, block_shape
from tierplan.runtime.engine.model import MoEModel
from tierplan.runtime.engine.pretrained import checkpoint_weights
from tierplan.runtime.engine.sizing import check_fits
from tierplan.runtime.engine.victims import ScanVictimOrder
from tierplan.runtime.engine.weights import DenseWeights, dense_weights_for, expert_format
from tierplan.runtime.errors import ConfigError
from tierplan.runtime.kv import Tier
from tierplan.runtime.memory.backend import make_backend
from tierplan.runtime.memory.slots import ExpertSlotPool
from tierplan.runtime.staging import StagingPool
from tierplan.runtime.transfer import TransferEngine
from tierplan.runtime.weights.format import dtype_from_name
from tierplan.runtime.weights.load_modes import WINDOWED, pool_modes
from tierplan.runtime.weights.loader import PUBLISH, ExpertLoadHandler, MapIn, Publish, StoreKind, map_in_error
from tierplan.runtime.weights.sources import SyntheticExpertSource
from tierplan.runtime.weights.stores import NvmeExpertStore, PinnedExpertStore

OffloadExec = Literal["piecewise", "eager"]
OFFLOAD_EXEC: tuple[str, ...] = get_args(OffloadExec)
VictimRule = Literal["lru", "scan"]
VICTIM_RULES: tuple[str, ...] = get_args(VictimRule)
ExpertReads = Literal["table", "range"]
EXPERT_READS: tuple[str, ...] = get_args(ExpertReads)


@dataclass(frozen=True)
class EngineConfig:
    resident_frac: float = 1.0
    expert_store: StoreKind = StoreKind.PINNED
    # When a loading expert's range is mapped and when it is published (runtime/weights/loader.py). The copy goes
    # through the slot window at once and the expert is published once its copy is issued, with the copy's event
    # (readers order their stream on it: wait_ready, wait_published), so no host wake-up waits for the bytes. None
    # (`map_in_for`): where steps with misses run as piecewise graphs through the slot table, "on_read": no range is
    # mapped until a reader through the ranges needs it, so a published load is evictable at once; where they read
    # the ranges (range reads, eager execution, no graphs) "beside_copy": the link's worker maps the range in its
    # waits beside the copy. Figures: bench/results/offload_h200.md (runs 20-24) and design_notes.md.
    expert_map_in: MapIn | None = None
    expert_publish: Publish = "issued"
    # Absent experts' ranges (runtime/memory/slots.py I5): unmapped (False), so a stray read faults with an illegal
    # address and a load maps with two driver calls; or mapped to a read-only NaN poison page (True), so a stray
    # read shows NaN, at one more driver call per load and per eviction, which costs link throughput
    # (bench/results/design_notes.md, "Poisoned absent experts and the retire thread").
    expert_poison: bool = False
    # The transfer engine accounts finished copies (and publishes loads) on each memory link's worker (False) or on
    # a retire thread beside it (True), which contends with the worker for the GIL (same notes section).
    transfer_retire_thread: bool = False
    block_tokens: int = 16
    kv_gpu_blocks: int = 256
    kv_cpu_blocks: int = 0
    kv_nvme_blocks: int = 0
    spill_kv_every_step: bool = False
    decode_kernel: bool | None = None  # Triton paged decode attention; None = on a GPU when Triton is there
    # Every expert generated straight into its slot on the device (no host store, no loader): full-size
    # all-resident throughput runs, where a host copy of every expert would not fit. Needs resident_frac=1.
    experts_on_device: bool = False
    # Decode steps replayed from CUDA graphs (graphs.py) when nothing needs the host mid-step. None = on a GPU;
    # True on a CPU runs the same static-buffer step without capture (how CI checks it).
    decode_graphs: bool | None = None
    # gc.collect() + gc.freeze() once the engine is built: the objects made at load time (a 48-layer model
    # process tracks ~270k) are never rescanned, so a full collection no longer pauses a decode step
    # (bench/results/design_notes.md, "Frozen GC after load"). None = on a GPU. close() unfreezes.
    freeze_gc: bool | None = None
    # Decode steps with experts missing: piecewise graphs with each MoE layer's misses loaded between its pieces
    # (the default: graph speed plus the link), or eager over the padded rows (the slow reference).
    offload_exec: OffloadExec = "piecewise"
    # How piecewise steps' GEMMs find a layer's experts: through the pool's slot table into the slot window
    # ("table": a miss is ready once its copy is issued; its range is mapped beside, off the step's path), or
    # through the experts' ranges ("range": each miss waits for its map calls). "table" needs the slot window
    # (expert_map_in "on_read" or "beside_copy"); None = "table" where there is one. Eager steps and whole-step
    # graphs read the ranges either way (with "on_read" they map what they read first).
    expert_reads: ExpertReads | None = None
    # Piecewise steps: MoE layers ahead of the current one whose experts start loading while it computes (0: none;
    # 2: FluxMoE's two-layer window). Forced routes are known ahead; live ones are guessed from the last step.
    expert_lookahead_layers: int = 0
    # Eviction order until the agent plugs its policy in: least recently used, or the scan rule (most recently
    # used first while the last step asked for more experts than there are slots).
    expert_victims: VictimRule = "lru"
    graph_max_batch: int = 128
    graph_max_blocks: int = 4096  # block-table width of the graphs (longer sequences decode eagerly)
    seed: int = 0
    workdir: Path | None = None

    def map_in_for(self, graphs: bool) -> MapIn:
        """`expert_map_in`, or where None the default for how this engine reads missing experts (the field's
        comment); graphs: whether it decodes through CUDA graphs (`decode_graphs`, resolved for its device)."""
        if self.expert_map_in is not None:
            return self.expert_map_in
        table = graphs and self.offload_exec == "piecewise" and self.expert_reads != "range"
        return "on_read" if table and not self.experts_on_device else "beside_copy"

    def __post_init__(self) -> None:
        if self.expert_map_in is not None and (why := map_in_error("EngineConfig.expert_map_in",
                                                                    self.expert_map_in)) is not None:
            raise ConfigError(why)
        if self.expert_publish not in PUBLISH:
            raise ConfigError(f"EngineConfig.expert_publish must be one of {PUBLISH}, got {self.expert_publish!r}")
        if self.offload_exec not in OFFLOAD_EXEC:
            raise ConfigError(f"EngineConfig.offload_exec must be one of {OFFLOAD_EXEC}, got {self.offload_exec!r}")
        if self.expert_reads is not None and self.expert_reads not in EXPERT_READS:
            raise ConfigError(f"EngineConfig.expert_reads must be one of {EXPERT_READS}, got {self.expert_reads!r}")
        if self.expert_reads == "table" and self.expert_map_in is not None and self.expert_map_in not in WINDOWED:
            raise ConfigError(f"EngineConfig.expert_reads='table' reads the slot window, which "
                              f"expert_map_in={self.expert_map_in!r} does not build: use expert_map_in='beside_copy' "
                              "or 'on_read', or expert_reads='range'")
        if self.expert_map_in == "on_read" and self.experts_on_device:
            raise ConfigError("EngineConfig.expert_map_in='on_read' is a way to load experts; experts_on_device=True "
                              "generates every expert in its slot and loads none: drop one of them")
        if self.expert_map_in == "on_read" and self.expert_reads == "range":
            raise ConfigError("EngineConfig.expert_map_in='on_read' leaves loaded experts' ranges unmapped until a "
                              "range reader maps them, so the piecewise GEMMs must read the slot table: use "
                              "expert_reads='table' (or None), or expert_map_in='beside_copy' with 'range'")
        if self.expert_victims not in VICTIM_RULES:
            raise ConfigError(f"EngineConfig.expert_victims must be one of {VICTIM_RULES}, got {self.expert_victims!r}")
        if isinstance(self.expert_lookahead_layers, bool) or not isinstance(self.expert_lookahead_layers, int) \
                or self.expert_lookahead_layers < 0:
            raise ConfigError("EngineConfig.expert_lookahead_layers must be an int >= 0, got "
                              f"{self.expert_lookahead_layers!r}")
        if not 0.0 < self.resident_frac <= 1.0:
            raise ConfigError(f"EngineConfig.resident_frac must be in (0, 1], got {self.resident_frac}")
        if self.experts_on_device and self.resident_frac < 1.0:
            raise ConfigError("EngineConfig.experts_on_device needs resident_frac=1.0 (nothing to load them from)")
        if self.graph_max_batch < 1 or self.graph_max_blocks < 1:
            raise ConfigError(f"EngineConfig.graph_max_batch ({self.graph_max_batch}) and graph_max_blocks "
                              f"({self.graph_max_blocks}) must be >= 1")
        if self.spill_kv_every_step and not (self.kv_cpu_blocks and self.kv_nvme_blocks):
            raise ConfigError("EngineConfig.spill_kv_every_step needs kv_cpu_blocks > 0 and kv_nvme_blocks > 0")


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated tokens per prompt
    logits: torch.Tensor  # [steps, S, V] float32, CPU
    expert_hits: int = 0
    expert_misses: int = 0
    kv_fetches: int = 0
    kv_spills: int = 0
    kv_usage: dict[str, int] = field(default_factory=dict)


class ReferenceEngine:
    def __init__(self, spec: ModelSpec, device: Device, cfg: EngineConfig, hooks: ModelHooks | None = None,
                 pinned_store: PinnedExpertStore | None = None, dense_weights: DenseWeights | None = None) -> None:
        """hooks: the model's taps and forced routes (ModelHooks; replace later with set_hooks). pinned_store: a
        pinned expert store to borrow instead of building one (benches sharing one store across engines; it
        must hold this spec's experts; the engine never closes it). dense_weights: synthetic dense weights to
        borrow likewise (`weights.dense_weights_for`; a checkpoint brings its own)."""
        self.spec, self.device, self.cfg = spec, device, cfg
        check_fits(spec, device, cfg)  # refuse, naming each part, what would not fit before allocating any of it
        self._tmp = None if cfg.workdir else tempfile.TemporaryDirectory(prefix="tierplan-engine-")
        wd = Path(cfg.workdir or self._tmp.name)  # type: ignore[union-attr]
        wd.mkdir(parents=True, exist_ok=True)
        fmt = expert_format(spec)
        n_moe = len(spec.moe_layers)
        ckpt = checkpoint_weights(spec, device, cfg) if spec.checkpoint else None  # a checkpoint's, or synthetic
        src = ckpt.experts if ckpt is not None else SyntheticExpertSource(fmt, n_moe, spec.num_experts, seed=cfg.seed)
        self.transfer = TransferEngine(device, retire_thread=cfg.transfer_retire_thread)
        host = not cfg.experts_on_device
        if pinned_store is not None and (pinned_store.format.num_bytes != fmt.num_bytes
                                         or pinned_store.records.num_layers != n_moe
                                         or pinned_store.records.num_experts != spec.num_experts):
            raise ConfigError("ReferenceEngine: pinned_store does not hold this model's experts")
        self._borrowed = pinned_store
        self.pinned = pinned_store or (PinnedExpertStore(device, src) if host and cfg.expert_store is StoreKind.PINNED
                                       else None)
        self.nvme = (NvmeExpertStore.build(wd / "experts.tpnvme", src, device)
                     if host and cfg.expert_store is StoreKind.NVME else None)
        use_graphs = device.is_cuda if cfg.decode_graphs is None else cfg.decode_graphs
        self.map_in = cfg.map_in_for(use_graphs)  # when a loading expert's range is mapped (EngineConfig's comment)
        num_slots = n_moe * spec.num_experts if cfg.resident_frac >= 1.0 else max(
            1, math.ceil(cfg.resident_frac * n_moe * spec.num_experts))
        self.pool = ExpertSlotPool(make_backend(device), device, n_moe, spec.num_experts, fmt.num_bytes, num_slots,
                                   poison_unmapped=cfg.expert_poison,
                                   **(pool_modes(self.map_in) if host else {}))
        # One staging pool serves the loader's NVMe reads and the KV handler's hops: buffers fit either.
        block_bytes = math.prod(block_shape(spec, cfg.block_tokens)) * dtype_from_name(spec.dtype).itemsize
        self.staging = StagingPool(device, max(block_bytes, self.nvme.records.record_bytes if self.nvme else 0), 8)
        self.loader = (ExpertLoadHandler(self.pool, self.transfer, self.pinned, self.nvme, map_in=self.map_in,
                                         publish=cfg.expert_publish, staging=self.staging)
                       if host else None)
        if not host:
            self._fill_slots_on_device(cfg.seed)
        self.experts = OnDemandExperts(self.pool, self.loader, cfg.expert_store)  # type: ignore[arg-type]
        if cfg.expert_victims == "scan":
            self.experts.set_victim_order(ScanVictimOrder(self.experts))
        cap = {Tier.GPU: cfg.kv_gpu_blocks, Tier.CPU: cfg.kv_cpu_blocks, Tier.NVME: cfg.kv_nvme_blocks}
        self.cache = PagedKVCache(spec, device, self.transfer, cfg.block_tokens, cap,
                                  wd / "kv.tpnvme" if cfg.kv_nvme_blocks else None, staging=self.staging)
        weights = dense_weights_for(spec, device.torch_device, cfg.seed, dense_weights, ckpt.dense if ckpt else None)
        if cfg.decode_kernel is None:
            from tierplan.runtime.engine.kernels.paged_attention import HAS_TRITON

            decode_kernel = device.is_cuda and HAS_TRITON
        else:
            decode_kernel = cfg.decode_kernel
        self.model = MoEModel(spec, weights, self.pool, self.experts, self.cache,
                              replace(hooks or ModelHooks(), decode_kernel=decode_kernel),
                              table_reads=cfg.expert_reads != "range" and self.pool.reads.table is not None)
        self.graphs = DecodeGraphs(self.model, device, cfg.graph_max_batch,
                                   min(cfg.graph_max_blocks, cfg.kv_gpu_blocks), capture=device.is_cuda
                                   ) if use_graphs else None
        self.residency = PieceResidency(self.model, self.experts, cfg.expert_lookahead_layers)
        self.executors = ExecutorStats()
        self.gc_frozen = device.is_cuda if cfg.freeze_gc is None else cfg.freeze_gc
        if self.gc_frozen:
            gc.collect()
            gc.freeze()

    @classmethod
    def from_pretrained(cls, path: str | Path, device: Device, cfg: EngineConfig,
                        dtype: str | None = None) -> ReferenceEngine:
        """An engine over a local Hugging Face safetensors checkpoint folder (runtime/engine/pretrained.py)."""
        from tierplan.runtime.engine.pretrained import engine_config_for, read_pretrained

        spec = read_pretrained(path, dtype).spec
        return cls(spec, device, engine_config_for(spec, cfg))

    def _fill_slots_on_device(self, seed: int) -> None:
        """N(0, 0.02) bf16 bytes for every expert, drawn on the device into its slot (padding included)."""
        gen, dt = torch.Generator(device=self.device.torch_device).manual_seed(seed), dtype_from_name(self.spec.dtype)
        for layer in range(self.pool.layout.num_layers):
            for e in range(self.pool.layout.num_experts):
                dst = self.pool.prepare_load(layer, e).view(dt)  # [expert_bytes / itemsize]
                dst.copy_(torch.randn(dst.numel(), generator=gen, device=self.device.torch_device).mul_(0.02))
                self.pool.complete_load(layer, e, True, self.device.record_event())

    def set_hooks(self, **changes: Any) -> None:
        """Replace some of the model's hooks (the agent's taps at attach, a trace's forced routes); a new forced
        table drops the captured graphs (they gather from the old table's address)."""
        old = self.model.hooks
        new = replace(old, **changes)
        if new.forced_routes is not old.forced_routes and self.graphs is not None:
            self.graphs.reset()
        self.model.set_hooks(new)

    def step(self, seqs: list[int], tokens: list[list[int]], starts: list[int]) -> torch.Tensor:
        """One forward: sequence i contributes tokens[i] at positions starts[i]...; returns logits [S, V]."""
        segs = self._prepare(seqs, tokens, starts)
        table = self.model.forced_routes
        trace_rows = table.trace_rows(seqs, starts, [len(t) for t in tokens]) if table is not None else None
        rows = self.cache.gpu_rows(seqs) if self.graphs is not None else None
        executor, reason = self._pick(tokens, rows, trace_rows)
        try:
            logits = self._run(executor, reason, seqs, tokens, starts, segs, rows, trace_rows)
        except BaseException:
            self.pool.record_read_all(self.device.record_event())  # whatever was queued may read slots
            raise
        self._after_step(segs, seqs)
        return logits

    def _prepare(self, seqs: list[int], tokens: list[list[int]], starts: list[int]) -> list[Segment]:
        """KV blocks for the new tokens, then every block of the step on the GPU (fetched as one list)."""
        segs, row, growing = [], 0, []
        for s, toks, p in zip(seqs, tokens, starts, strict=True):
            segs.append(Segment(s, row, len(toks), p))
            row += len(toks)
            if self.cache.needs_blocks(s, p + len(toks)):
                growing.append((s, p + len(toks)))
        if growing:  # most decode steps grow none: no set of every block of the batch then
            protect = {b for q in seqs for b in self.cache.blocks_of(q)}  # this step's blocks: never spilled by grow
            for s, num_tokens in growing:
                self.cache.grow(s, num_tokens, protect=protect)
                protect.update(self.cache.blocks_of(s))
        self.cache.ensure_seqs_on_gpu(seqs)
        self.experts.begin_step()
        return segs

    def _pick(self, tokens: list[list[int]], rows: list[np.ndarray] | None,
              trace_rows: list[int] | None) -> tuple[Executor, Reason]:
        """The executor for this step and why. Shape reasons come first, so whether a step that fits the graph's
        buffers replays, runs piecewise or runs eagerly over the padded rows never depends on a shape."""
        g, m = self.graphs, self.model
        if any(len(t) != 1 for t in tokens):
            return Executor.EAGER, Reason.PREFILL
        if g is None:
            return Executor.EAGER, Reason.NO_GRAPHS
        if m.spec.attention is not AttentionKind.GQA or not m.decode_kernel:
            return Executor.EAGER, Reason.NO_PAGED_DECODE_KERNEL
        if len(tokens) > g.max_batch:
            return Executor.EAGER, Reason.BATCH_TOO_LARGE
        if rows is not None and any(len(r) > g.max_blocks for r in rows):
            return Executor.EAGER, Reason.CONTEXT_TOO_LONG
        pool = self.pool
        if all(pool.num_resident(i) == pool.layout.num_experts for i in m.pool_layer.values()):
            return Executor.GRAPH, Reason.ALL_RESIDENT
        if self.cfg.offload_exec == "eager":
            return Executor.EAGER, Reason.OFFLOAD_EAGER
        if not self.residency.fits(known_routes(m, trace_rows), len(tokens)):
            return Executor.EAGER, Reason.LAYER_OVER_SLOTS
        bb_rows = g.bucket(len(tokens)) * max(1, m.spec.top_k)
        if self.device.is_cuda and not moe_gemm.usable(m.w.embed, bb_rows):
            return Executor.EAGER, Reason.GEMM_READS_EVERY_EXPERT  # absent experts' ranges are unmapped
        return Executor.PIECEWISE, Reason.EXPERTS_MISSING

    def _run(self, executor: Executor, reason: Reason, seqs: list[int], tokens: list[list[int]], starts: list[int],
             segs: list[Segment], rows: list[np.ndarray] | None, trace_rows: list[int] | None) -> torch.Tensor:
        g = self.graphs
        if g is not None and (executor is not Executor.EAGER or reason in PADDED):
            assert rows is not None
            bb = g.stage(seqs, tokens, starts, rows, trace_rows)
            logits = None
            if executor is Executor.GRAPH:
                logits = g.replay(seqs, starts, bb)
            elif executor is Executor.PIECEWISE:
                res = self.residency
                res.begin(known_routes(self.model, trace_rows))
                logits = g.replay_pieces(seqs, starts, bb,
                                         lambda p: res.before_moe(p, g.step_routes(p, len(seqs))), res.after_moe)
            if logits is None and executor is not Executor.EAGER:
                executor, reason = Executor.EAGER, Reason.CAPTURE_FAILED
            if logits is None:
                logits = g.run_padded_eager(seqs, starts, bb)
            self.executors.count(executor, reason)
            return logits
        self.executors.count(executor, reason)
        table = build_block_table(segs, self.cache, rows)  # once per step: every layer reads it on the device
        segs = [replace(s, table=table, table_row=i) for i, s in enumerate(segs)]
        dev = self.device.torch_device
        flat = torch.tensor([t for toks in tokens for t in toks], dtype=torch.int64, device=dev)
        pos = torch.tensor([p + j for toks, p in zip(tokens, starts, strict=True) for j in range(len(toks))],
                           dtype=torch.int64, device=dev)
        routing = StepRouting(trace_rows=torch.tensor(trace_rows, dtype=torch.int64, device=dev), forced=True
                              ) if trace_rows is not None else None
        with torch.inference_mode():
            return self.model.forward(flat, pos, segs, routing=routing)

    def _after_step(self, segs: list[Segment], seqs: list[int]) -> None:
        # All-resident layers and graph replays record no per-expert reads: one fence covers the step (I4).
        self.pool.record_read_all(self.device.record_event())
        for sg in segs:  # the kernels wrote these rows in every layer: once per step, not per layer
            self.cache.mark_written(sg.seq_id, sg.first_pos, sg.context_len)
        if self.cfg.spill_kv_every_step:
            for s in seqs:
                self.cache.spill(self.cache.blocks_of(s), Tier.CPU if s % 2 == 0 else Tier.NVME)

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> GenerationResult:
        if not prompts or any(not p for p in prompts):
            raise ConfigError("generate: need at least one prompt, and every prompt needs >= 1 token")
        if max_new_tokens < 1:
            raise ConfigError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
        bad = [t for p in prompts for t in p if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise ConfigError(f"generate: token id {bad[0]} outside the vocabulary (0..{self.spec.vocab_size - 1})")
        seqs = list(range(len(prompts)))
        steps = [self.step(seqs, prompts, [0] * len(prompts))]
        out = [[int(t)] for t in steps[0].argmax(-1).tolist()]
        for _ in range(max_new_tokens - 1):
            ctx = [len(p) + len(o) - 1 for p, o in zip(prompts, out, strict=True)]
            steps.append(self.step(seqs, [[o[-1]] for o in out], ctx))
            for o, t in zip(out, steps[-1].argmax(-1).tolist(), strict=True):
                o.append(int(t))
        for s in seqs:
            self.cache.free(s)
        return GenerationResult(out, torch.stack(steps).cpu(), self.experts.hits, self.experts.misses,
                                self.cache.fetches, self.cache.spills, self.cache.tier_usage())

    def close(self) -> None:
        self.device.synchronize()
        if self.loader is not None:
            self.loader.close()
        self.cache.close()
        self.transfer.close()
        self.staging.close()
        self.pool.close()
        for store in (self.pinned, self.nvme):
            if store is not None and store is not self._borrowed:
                store.close()
        if self._tmp is not None:
            self._tmp.cleanup()
        if self.gc_frozen:  # process-wide: what any engine froze becomes collectable again
            gc.unfreeze()
            self.gc_frozen = False
