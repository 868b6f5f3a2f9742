"""A stand-in for vLLM's scheduler and model runner around the KV connector's two sides (test process).

Drives `ConnectorBooks` and `KvTierWorker` through the calls vLLM makes for one prefill step per request, on fake
requests (chained block hashes over token ids) and a fake paged cache whose block content is a pure function of
the block's prefix hash: a block loaded by the connector must hold exactly what computing it would write. No vLLM.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from tierplan.agent.adapters.vllm.connector_config import ConnectorSettings
from tierplan.agent.adapters.vllm.connector_scheduler import ConnectorBooks
from tierplan.agent.adapters.vllm.connector_worker import KvTierWorker
from tierplan.agent.adapters.vllm.kv_limits import KvLimits, prefix_hash
from tierplan.runtime.kv.spec import Tier

BLOCK_TOKENS = 32
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def block_hashes(tokens: list[int]) -> list[bytes]:
    out, prev = [], b"root"
    for j in range(len(tokens) // BLOCK_TOKENS):
        prev = hashlib.sha256(prev + repr(tokens[j * BLOCK_TOKENS:(j + 1) * BLOCK_TOKENS]).encode()).digest()
        out.append(prev)
    return out


def computed_block(h: bytes) -> torch.Tensor:
    """What 'computing' the block with prefix hash `h` writes, per layer: [L, 2, 32, 64] bf16."""
    g = torch.Generator().manual_seed(int.from_bytes(h[:8], "little"))
    return torch.randn(len(LAYERS), 2, BLOCK_TOKENS, 64, generator=g).to(torch.bfloat16)


@dataclass
class RecordingSource:
    """A KvLimitsSource whose limits follow `schedule` (call index -> KvLimits) and which keeps every report."""

    schedule: dict[int, KvLimits]
    calls: int = 0
    reports: list[tuple[dict[str, int], dict[str, int], dict[str, int]]] = field(default_factory=list)
    current: KvLimits | None = None
    limits_at_report: list[KvLimits | None] = field(default_factory=list)
    reuse: list[tuple[str, float, str]] = field(default_factory=list)

    def kv_limits(self) -> KvLimits | None:
        self.current = self.schedule.get(self.calls, self.current)
        self.calls += 1
        return self.current

    def report_kv(self, hits: dict[str, int], misses: dict[str, int], blocks: dict[str, int]) -> None:
        self.reports.append((dict(hits), dict(misses), dict(blocks)))
        self.limits_at_report.append(self.current)

    def report_reuse(self, events: list[tuple[str, float, str]]) -> None:
        self.reuse.extend(events)


class FakeEngine:
    """One prefill step per request, as vLLM's scheduler and runner would make the connector calls."""

    def __init__(self, settings: ConnectorSettings, nvme_path, source=None, num_blocks: int = 64,
                 clock=None) -> None:
        self.now_s = 0.0
        clock = clock or (lambda: self.now_s)  # the test moves time by setting now_s
        self.books = ConnectorBooks(settings, BLOCK_TOKENS, source=(lambda: source), clock=clock)
        self.worker = KvTierWorker({Tier.CPU: settings.cpu_blocks, Tier.NVME: settings.nvme_blocks}, nvme_path)
        self.caches = {n: torch.zeros(num_blocks, 2, BLOCK_TOKENS, 64, dtype=torch.bfloat16) for n in LAYERS}
        self.worker.register(self.caches)
        self.num_blocks = num_blocks
        self._next_block = 0
        self._ids: dict[str, list[int]] = {}
        self.books.kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: (self._ids[rid],))
        self.external_blocks: list[int] = []  # per request
        self.footprints: list[dict[str, int]] = []

    def _alloc(self, n: int) -> list[int]:
        ids = [(self._next_block + i) % self.num_blocks for i in range(n)]  # reuse blocks round-robin
        self._next_block += n
        return ids

    def run(self, req_id: str, tokens: list[int]) -> None:
        hashes = block_hashes(tokens)
        req = SimpleNamespace(request_id=req_id, block_hashes=hashes, num_tokens=len(tokens))
        self.books.new_request(req)
        ext = self.books.num_new_matched_tokens(req, 0)
        ids = self._alloc(-(-len(tokens) // BLOCK_TOKENS))
        self._ids[req_id] = ids
        self.books.after_alloc(req, ids, ext)
        out = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=req_id, num_computed_tokens=ext)],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
            num_scheduled_tokens={req_id: len(tokens) - ext}, scheduled_spec_decode_tokens={})
        step = self.books.build_step(out)
        for ld in step.loads:  # the scheduler names each load by its prefix hash
            assert ld.key in {prefix_hash(h) for h in hashes}
        self.worker.load(step.loads)
        n_ext = ext // BLOCK_TOKENS
        for j, h in enumerate(hashes):  # the forward: computes every block the connector did not load
            if j >= n_ext:
                for i, name in enumerate(LAYERS):
                    self.caches[name][ids[j]] = computed_block(h)[i]
        for j, h in enumerate(hashes[:n_ext]):  # exactness: a loaded block holds what computing it writes
            for i, name in enumerate(LAYERS):
                assert torch.equal(self.caches[name][ids[j]].view(torch.uint8), computed_block(h)[i].view(torch.uint8))
        self.worker.apply(step)
        self.footprints.append(self.worker.blocks_per_tier())
        self.books.on_worker_report(self.worker.take_report())
        self.books.finished(req)
        self.external_blocks.append(n_ext)

    def close(self) -> None:
        self.worker.close()
