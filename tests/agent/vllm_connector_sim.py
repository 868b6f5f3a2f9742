"""A stand-in for vLLM's scheduler and model runner around the KV connector's two sides (test process).

Drives `ConnectorBooks` and one or more `KvTierWorker`s (tensor-parallel ranks) through the calls vLLM makes for
one prefill step per request, on fake requests (chained block hashes over token ids) and fake paged caches whose
block content is a pure function of the block's prefix hash, provided every block before it holds what it should:
the forward computes a block over the blocks before it (as attention does), so a block computed over a wrong one
is wrong too. A load that fails is handled as vLLM's "recompute" policy does: the request is scheduled again from
the failed block. A block loaded by the connector must hold exactly what computing it writes. `admit`/`step`/
`deliver` drive several requests per step (chunks, blocks shared through vLLM's own prefix cache) and hand a step's
report to the scheduler only when the test says (async scheduling builds the next step first). No vLLM.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from tierplan.agent.adapters.vllm.connector_config import ConnectorSettings
from tierplan.agent.adapters.vllm.connector_meta import WorkerReport
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
class SimRequest:
    req: SimpleNamespace
    hashes: list[bytes]
    ids: list[int]
    computed: int  # vLLM's num_computed_tokens
    new: bool = True


@dataclass
class RecordingSource:
    """A KvLimitsSource whose limits follow `schedule` (call index -> KvLimits) and which keeps every report."""

    schedule: dict[int, KvLimits]
    calls: int = 0
    reports: list[tuple[dict[str, int], dict[str, int], dict[str, int]]] = field(default_factory=list)
    current: KvLimits | None = None
    limits_at_report: list[KvLimits | None] = field(default_factory=list)
    reuse: list[tuple[str, float, str]] = field(default_factory=list)
    failures: list[dict[str, int]] = field(default_factory=list)

    def kv_limits(self) -> KvLimits | None:
        self.current = self.schedule.get(self.calls, self.current)
        self.calls += 1
        return self.current

    def report_kv(self, hits: dict[str, int], misses: dict[str, int], blocks: dict[str, int]) -> None:
        self.reports.append((dict(hits), dict(misses), dict(blocks)))
        self.limits_at_report.append(self.current)

    def report_reuse(self, events: list[tuple[str, float, str]]) -> None:
        self.reuse.extend(events)

    def report_failures(self, counts: dict[str, int]) -> None:
        self.failures.append(dict(counts))


class FakeEngine:
    """One prefill step per request (and one more from a failed load on), as vLLM's scheduler and runner would
    make the connector calls; `num_workers` ranks, each with its own cache and tiers."""

    def __init__(self, settings: ConnectorSettings, nvme_path, source=None, num_blocks: int = 64,
                 clock=None, num_workers: int = 1) -> None:
        self.now_s = 0.0
        clock = clock or (lambda: self.now_s)  # the test moves time by setting now_s
        self.books = ConnectorBooks(settings, BLOCK_TOKENS, source=(lambda: source), clock=clock)
        caps = {Tier.CPU: settings.cpu_blocks, Tier.NVME: settings.nvme_blocks}
        self.workers = [KvTierWorker(caps, None if nvme_path is None else nvme_path.with_suffix(f".rank{r}"))
                        for r in range(num_workers)]
        self.worker = self.workers[0]
        self.caches_per_rank = [{n: torch.zeros(num_blocks, 2, BLOCK_TOKENS, 64, dtype=torch.bfloat16) for n in LAYERS}
                                for _ in self.workers]
        self.caches = self.caches_per_rank[0]
        for w, caches in zip(self.workers, self.caches_per_rank, strict=True):
            w.register(caches)
        self.num_blocks = num_blocks
        self._next_block = 0
        self._ids: dict[str, list[int]] = {}
        self.books.kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: (self._ids[rid],))
        self.external_blocks: list[int] = []  # per request
        self.footprints: list[dict[str, int]] = []
        self.recomputed_from: list[int] = []  # per failed load: the block vLLM computed the request again from
        self.hash_of: dict[str, bytes] = {}  # every key seen -> its block hash
        self.sim_reqs: dict[str, SimRequest] = {}  # requests `admit` let in

    def _alloc(self, n: int) -> list[int]:
        ids = [(self._next_block + i) % self.num_blocks for i in range(n)]  # reuse blocks round-robin
        self._next_block += n
        return ids

    def _forward(self, caches: dict, ids: list[int], hashes: list[bytes], start: int) -> None:
        """Compute blocks `start..`: right only if every block before holds what computing it writes."""
        good = all(torch.equal(caches[n][ids[j]].view(torch.uint8), computed_block(hashes[j])[i].view(torch.uint8))
                   for j in range(start) for i, n in enumerate(LAYERS))
        for j in range(start, len(hashes)):
            content = computed_block(hashes[j]) if good else computed_block(hashes[j]) + 1  # over a wrong block
            for i, name in enumerate(LAYERS):
                caches[name][ids[j]] = content[i]

    def _step(self, out: SimpleNamespace, req_id: str, hashes: list[bytes], start: int) -> WorkerReport:
        step = self.books.build_step(out)
        ids = self._ids[req_id]
        for ld in step.loads:  # the scheduler names each load by its prefix hash
            assert ld.key in {prefix_hash(h) for h in hashes}
        report = WorkerReport()
        for w, caches in zip(self.workers, self.caches_per_rank, strict=True):
            w.load(step.loads)
            self._forward(caches, ids, hashes, start)
            w.apply(step)
            report = report.merge(w.take_report())
        for j, h in enumerate(hashes[:start]):  # exactness: a loaded block holds what computing it writes
            if ids[j] in report.failed_load_block_ids:
                continue
            for caches in self.caches_per_rank:
                for i, name in enumerate(LAYERS):
                    got = caches[name][ids[j]].view(torch.uint8)
                    assert torch.equal(got, computed_block(h)[i].view(torch.uint8)), f"block {j} of {req_id}"
        self.worker.finish_spills()  # (the next step would): a spill in flight counts on both tiers until done
        self.footprints.append(self.worker.blocks_per_tier())
        self.books.on_worker_report(report)
        return report

    def run(self, req_id: str, tokens: list[int]) -> None:
        hashes = block_hashes(tokens)
        self.hash_of.update({prefix_hash(h): h for h in hashes})
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
        n_ext = ext // BLOCK_TOKENS
        report = self._step(out, req_id, hashes, n_ext)
        if report.failed_load_block_ids:  # vLLM's "recompute": computed again from the first failed block on
            first = min(j for j, b in enumerate(ids) if b in report.failed_load_block_ids)
            self.recomputed_from.append(first)
            done = first * BLOCK_TOKENS
            out = SimpleNamespace(
                scheduled_new_reqs=[],
                scheduled_cached_reqs=SimpleNamespace(req_ids=[req_id], num_computed_tokens=[done]),
                num_scheduled_tokens={req_id: len(tokens) - done}, scheduled_spec_decode_tokens={})
            self._step(out, req_id, hashes, first)
        self.books.finished(req)
        self.external_blocks.append(n_ext)

    def admit(self, req_id: str, tokens: list[int], shared: SimRequest | None = None, local_blocks: int = 0,
              ) -> SimRequest:
        """vLLM admits a request; its first `local_blocks` blocks are vLLM's own prefix hit on `shared`'s blocks."""
        hashes = block_hashes(tokens)
        self.hash_of.update({prefix_hash(h): h for h in hashes})
        req = SimpleNamespace(request_id=req_id, block_hashes=hashes, num_tokens=len(tokens))
        self.books.new_request(req)
        start = local_blocks * BLOCK_TOKENS
        ext = self.books.num_new_matched_tokens(req, start)
        own = self._alloc(-(-len(tokens) // BLOCK_TOKENS) - local_blocks)
        ids = (shared.ids[:local_blocks] if shared else []) + own
        self._ids[req_id] = ids
        self.books.after_alloc(req, ids, ext)
        self.sim_reqs[req_id] = SimRequest(req, hashes, ids, start + ext)
        return self.sim_reqs[req_id]

    def _compute(self, caches: dict, r: SimRequest, num_tokens: int) -> None:
        """Tokens [computed, computed + num_tokens) of `r`: each block touched is right only if every block before
        it is, and (if begun earlier) its own first part is."""
        def right(j: int) -> bool:
            return all(torch.equal(caches[n][r.ids[j]].view(torch.uint8), computed_block(r.hashes[j])[i].view(
                torch.uint8)) for i, n in enumerate(LAYERS))

        end = r.computed + num_tokens
        for j in range(r.computed // BLOCK_TOKENS, min(-(-end // BLOCK_TOKENS), len(r.hashes))):
            good = all(right(k) for k in range(j)) and (r.computed <= j * BLOCK_TOKENS or right(j))
            content = computed_block(r.hashes[j]) + (0 if good else 1)
            for i, name in enumerate(LAYERS):
                caches[name][r.ids[j]] = content[i]

    def step(self, num_tokens: dict[str, int]) -> WorkerReport:
        """One engine step scheduling `num_tokens[req_id]` tokens of admitted requests; returns its report, which
        reaches the scheduler only through `deliver`."""
        reqs = {rid: self.sim_reqs[rid] for rid in num_tokens}
        new = [rid for rid, r in reqs.items() if r.new]
        cached = [rid for rid, r in reqs.items() if not r.new]
        out = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=rid, num_computed_tokens=reqs[rid].computed) for rid in new],
            scheduled_cached_reqs=SimpleNamespace(req_ids=cached,
                                                  num_computed_tokens=[reqs[rid].computed for rid in cached]),
            num_scheduled_tokens=dict(num_tokens), scheduled_spec_decode_tokens={})
        step = self.books.build_step(out)
        report = WorkerReport()
        for w, caches in zip(self.workers, self.caches_per_rank, strict=True):
            w.load(step.loads)
            failed = w._report.failed_load_block_ids
            for ld in step.loads:  # exactness: a loaded block holds what computing it writes
                if ld.block_id not in failed:
                    got = caches[LAYERS[0]][ld.block_id].view(torch.uint8)
                    assert torch.equal(got, computed_block(self.hash_of[ld.key])[0].view(torch.uint8)), ld.key
            for rid, n in num_tokens.items():
                self._compute(caches, reqs[rid], n)
            w.apply(step)
            report = report.merge(w.take_report())
        for rid, n in num_tokens.items():
            reqs[rid].computed += n
            reqs[rid].new = False
        return report

    def deliver(self, report: WorkerReport) -> None:
        """The scheduler hears a step's report; vLLM's "recompute" sends back every request holding a failed block
        in its computed part to that block."""
        self.books.on_worker_report(report)
        for r in self.sim_reqs.values():
            bad = [j for j, b in enumerate(r.ids[:-(-r.computed // BLOCK_TOKENS)]) if b in report.failed_load_block_ids]
            if bad:
                r.computed = min(r.computed, bad[0] * BLOCK_TOKENS)
                self.recomputed_from.append(bad[0])

    def idle_step(self) -> None:
        """A step that schedules nothing (vLLM's steps go on): carries out pending ops, reports to the source."""
        out = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}, scheduled_spec_decode_tokens={},
                              scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]))
        step = self.books.build_step(out)
        report = WorkerReport()
        for w in self.workers:
            w.apply(step)
            report = report.merge(w.take_report())
        self.books.on_worker_report(report)

    def stored_blocks_exact(self) -> dict[str, bool]:
        """Per key any worker holds: does every worker's stored copy equal what computing the block writes?"""
        out = {}
        for w in self.workers:
            w.finish_spills()
            for key in list(w._blocks):
                want = b"".join(computed_block(self.hash_of[key])[i].contiguous().view(torch.uint8).numpy().tobytes()
                                for i in range(len(LAYERS)))
                got = bytes(w.read_block(key).numpy())[:len(want)]
                out[key] = out.get(key, True) and got == want
        return out

    def close(self) -> None:
        for w in self.workers:
            w.close()
