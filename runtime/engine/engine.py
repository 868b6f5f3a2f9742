"""The reference engine: builds weights, slot pool, stores, KV tiers and the model; runs generation.

Runs in the inference process (CPU twin or one GPU). `generate` prefills every prompt in one forward and
then decodes all sequences together, greedily. Placement knobs (`EngineConfig`): the fraction of experts
with a slot, where experts are loaded from, the KV capacity per tier, and `spill_kv_every_step`, which
moves every KV block off the GPU after each step (alternating CPU and NVMe) so the next step must fetch
them back: the exactness check runs the same prompts with and without these and compares bits.
It must never decide placement beyond its configuration (the agent does) nor touch the network.
"""

from __future__ import annotations

import gc
import math
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from runtime.device import Device
from runtime.engine.attention import Segment, build_block_table
from runtime.engine.config import ModelSpec
from runtime.engine.experts import OnDemandExperts
from runtime.engine.graphs import DecodeGraphs
from runtime.engine.kv_cache import PagedKVCache, block_shape
from runtime.engine.model import MoEModel
from runtime.engine.sizing import check_fits
from runtime.engine.weights import expert_format, synthetic_dense_weights
from runtime.errors import ConfigError
from runtime.kv import Tier
from runtime.memory.backend import make_backend
from runtime.memory.slots import ExpertSlotPool
from runtime.staging import StagingPool
from runtime.transfer import TransferEngine
from runtime.weights.format import dtype_from_name
from runtime.weights.loader import MAP_IN, PUBLISH, ExpertLoadHandler, MapIn, Publish, StoreKind
from runtime.weights.sources import SyntheticExpertSource
from runtime.weights.stores import NvmeExpertStore, PinnedExpertStore

# Decode steps that cannot replay for a reason that depends on placement or routing run eagerly over the
# bucket's padded rows (the same shapes as the graph): a replayed and an eager step then give the same bits.
PADDED_EAGER = frozenset({"experts_not_resident", "forced_routes"})


@dataclass(frozen=True)
class EngineConfig:
    resident_frac: float = 1.0
    expert_store: StoreKind = StoreKind.PINNED
    # Who maps a loading expert's range and when it is published (runtime/weights/loader.py): by default the copy
    # goes through the slot window at once, the link worker maps the range in its waits, and the expert is
    # published once its copy is issued, with the copy's event (readers order their stream on it: wait_ready,
    # wait_published), so no host wake-up waits for the bytes. With finished copies accounted on the worker both
    # modes publish there; 16 x 9 MiB lists on the H200 then read 0.944 / 0.959 published once issued against
    # 0.857 / 0.940 once done (runs 30, 31; see bench/results/substrate_h200.md).
    expert_map_in: MapIn = "link"
    expert_publish: Publish = "issued"
    # Absent experts' ranges (runtime/memory/slots.py I5): unmapped (False), so a stray read faults with an illegal
    # address and a load maps with two driver calls; or mapped to a read-only NaN poison page (True), so a stray
    # read shows NaN, at one more driver call (~30 µs while copies run) per load and per eviction. Loads of
    # 16 x 9 MiB on the H200 (run 28, 6 rounds in one process): 0.89-0.95 of raw unmapped, 0.68-0.94 poisoned.
    expert_poison: bool = False
    # The transfer engine accounts finished copies (and publishes loads) on each memory link's worker (False) or on
    # a retire thread beside it (True), which contends with the worker for the GIL: 0.84-0.93 in the same rounds.
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
    # process tracks ~270k) are never rescanned, so a full collection no longer pauses a decode step for
    # ~0.1 s (measured on the CPU box: 127-137 ms, 0 ms once frozen). None = on a GPU. close() unfreezes.
    freeze_gc: bool | None = None
    graph_max_batch: int = 128
    graph_max_blocks: int = 4096  # block-table width of the graphs (longer sequences decode eagerly)
    seed: int = 0
    workdir: Path | None = None

    def __post_init__(self) -> None:
        if self.expert_map_in not in MAP_IN:
            raise ConfigError(f"EngineConfig.expert_map_in must be one of {MAP_IN}, got {self.expert_map_in!r}")
        if self.expert_publish not in PUBLISH:
            raise ConfigError(f"EngineConfig.expert_publish must be one of {PUBLISH}, got {self.expert_publish!r}")
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
    def __init__(self, spec: ModelSpec, device: Device, cfg: EngineConfig) -> None:
        self.spec, self.device, self.cfg = spec, device, cfg
        check_fits(spec, device, cfg)  # refuse, naming each part, what would not fit before allocating any of it
        self._tmp = None if cfg.workdir else tempfile.TemporaryDirectory(prefix="tierplan-engine-")
        wd = Path(cfg.workdir or self._tmp.name)  # type: ignore[union-attr]
        wd.mkdir(parents=True, exist_ok=True)
        fmt = expert_format(spec)
        n_moe = len(spec.moe_layers)
        src = SyntheticExpertSource(fmt, n_moe, spec.num_experts, seed=cfg.seed)
        self.transfer = TransferEngine(device, retire_thread=cfg.transfer_retire_thread)
        host = not cfg.experts_on_device
        self.pinned = PinnedExpertStore(device, src) if host and cfg.expert_store is StoreKind.PINNED else None
        self.nvme = (NvmeExpertStore.build(wd / "experts.tpnvme", src, device)
                     if host and cfg.expert_store is StoreKind.NVME else None)
        num_slots = n_moe * spec.num_experts if cfg.resident_frac >= 1.0 else max(
            1, math.ceil(cfg.resident_frac * n_moe * spec.num_experts))
        self.pool = ExpertSlotPool(make_backend(device), device, n_moe, spec.num_experts, fmt.num_bytes, num_slots,
                                   poison_unmapped=cfg.expert_poison,
                                   slot_window=host and cfg.expert_map_in != "worker")
        # One staging pool serves the loader's NVMe reads and the KV handler's hops: buffers fit either.
        block_bytes = math.prod(block_shape(spec, cfg.block_tokens)) * dtype_from_name(spec.dtype).itemsize
        self.staging = StagingPool(device, max(block_bytes, self.nvme.records.record_bytes if self.nvme else 0), 8)
        self.loader = (ExpertLoadHandler(self.pool, self.transfer, self.pinned, self.nvme, map_in=cfg.expert_map_in,
                                         publish=cfg.expert_publish, staging=self.staging)
                       if host else None)
        if not host:
            self._fill_slots_on_device(cfg.seed)
        self.experts = OnDemandExperts(self.pool, self.loader, cfg.expert_store)  # type: ignore[arg-type]
        cap = {Tier.GPU: cfg.kv_gpu_blocks, Tier.CPU: cfg.kv_cpu_blocks, Tier.NVME: cfg.kv_nvme_blocks}
        self.cache = PagedKVCache(spec, device, self.transfer, cfg.block_tokens, cap,
                                  wd / "kv.tpnvme" if cfg.kv_nvme_blocks else None, staging=self.staging)
        weights = synthetic_dense_weights(spec, device.torch_device, seed=cfg.seed)
        self.model = MoEModel(spec, weights, self.pool, self.experts, self.cache)
        if cfg.decode_kernel is None:
            from runtime.engine.kernels.paged_attention import HAS_TRITON

            self.model.decode_kernel = device.is_cuda and HAS_TRITON
        else:
            self.model.decode_kernel = cfg.decode_kernel
        use_graphs = device.is_cuda if cfg.decode_graphs is None else cfg.decode_graphs
        self.graphs = DecodeGraphs(self.model, device, cfg.graph_max_batch,
                                   min(cfg.graph_max_blocks, cfg.kv_gpu_blocks), capture=device.is_cuda
                                   ) if use_graphs else None
        self.gc_frozen = device.is_cuda if cfg.freeze_gc is None else cfg.freeze_gc
        if self.gc_frozen:
            gc.collect()
            gc.freeze()

    def _fill_slots_on_device(self, seed: int) -> None:
        """N(0, 0.02) bf16 bytes for every expert, drawn on the device into its slot (padding included)."""
        gen = torch.Generator(device=self.device.torch_device).manual_seed(seed)
        dt = dtype_from_name(self.spec.dtype)
        for layer in range(self.pool.layout.num_layers):
            for e in range(self.pool.layout.num_experts):
                dst = self.pool.prepare_load(layer, e).view(dt)  # [expert_bytes / itemsize]
                dst.copy_(torch.randn(dst.numel(), generator=gen, device=self.device.torch_device).mul_(0.02))
                self.pool.complete_load(layer, e, True, self.device.record_event())

    def step(self, seqs: list[int], tokens: list[list[int]], starts: list[int]) -> torch.Tensor:
        """One forward: sequence i contributes tokens[i] at positions starts[i]...; returns logits [S, V]."""
        segs, row = [], 0
        protect = {b for q in seqs for b in self.cache.blocks_of(q)}  # this step's blocks: never spilled by grow
        for s, toks, p in zip(seqs, tokens, starts, strict=True):
            self.cache.grow(s, p + len(toks), protect=protect)
            protect.update(self.cache.blocks_of(s))
            segs.append(Segment(s, row, len(toks), p))
            row += len(toks)
        self.cache.ensure_on_gpu([b for s in seqs for b in self.cache.blocks_of(s)])
        rows: list[list[int]] | None = None
        if self.graphs is not None:
            rows = [self.cache.gpu_indices(s) for s in seqs]
            why = self.graphs.why_not(tokens, rows)
            if why is not None:
                self.graphs.fallbacks[why] += 1
            if why is None or why in PADDED_EAGER:
                try:
                    logits = self.graphs.run(seqs, tokens, starts, rows, replay=why is None)
                except BaseException:
                    self.pool.record_read_all(self.device.record_event())  # whatever was queued may read slots
                    raise
                self._after_step(segs, seqs)
                return logits
        table = build_block_table(segs, self.cache, rows)  # once per step: every layer reads it on the device
        segs = [replace(s, table=table, table_row=i) for i, s in enumerate(segs)]
        dev = self.device.torch_device
        flat = torch.tensor([t for toks in tokens for t in toks], dtype=torch.int64, device=dev)
        pos = torch.tensor([p + j for toks, p in zip(tokens, starts, strict=True) for j in range(len(toks))],
                           dtype=torch.int64, device=dev)
        with torch.inference_mode():
            logits = self.model.forward(flat, pos, segs)
        self._after_step(segs, seqs)
        return logits

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
            if store is not None:
                store.close()
        if self._tmp is not None:
            self._tmp.cleanup()
        if self.gc_frozen:  # process-wide: what any engine froze becomes collectable again
            gc.unfreeze()
            self.gc_frozen = False
