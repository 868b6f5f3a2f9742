"""Continuous batching for the simulator: the reference engine's scheduler (runtime/engine/scheduler.py)
restated over plain counters, so a simulated run forms the batches a real one would.

Runs in `tierplan sim`. Pure Python. Each step: decodes first (preempting the newest running sequence,
swapped out to host memory, while the GPU KV blocks do not fit), swapped sequences back in while they fit,
then new prefills in arrival order within `max_batch`, the free blocks and `max_prefill_tokens`. It never
decides placement and never touches a trace file.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tierplan.controller.sim_traces import SimRequest


@dataclass
class SimSeq:
    req: SimRequest
    num_computed: int = 0  # tokens whose KV is cached
    num_out: int = 0
    num_preemptions: int = 0
    admitted_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def num_tokens(self) -> int:
        return self.req.prompt_len + self.num_out

    @property
    def done(self) -> bool:
        return self.num_out >= self.req.output_len


@dataclass
class SimBatch:
    prefills: list[SimSeq] = field(default_factory=list)
    decodes: list[SimSeq] = field(default_factory=list)
    swapped_in: list[SimSeq] = field(default_factory=list)
    preempted: list[SimSeq] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.prefills or self.decodes)


class SimScheduler:
    def __init__(self, gpu_blocks: int, block_tokens: int, max_batch: int, max_prefill_tokens: int = 2048) -> None:
        for name, v in (("gpu_blocks", gpu_blocks), ("block_tokens", block_tokens), ("max_batch", max_batch),
                        ("max_prefill_tokens", max_prefill_tokens)):
            if v < 1:
                raise ValueError(f"SimScheduler: {name} must be >= 1, got {v}")
        self.gpu_blocks, self.block_tokens = gpu_blocks, block_tokens
        self.max_batch, self.max_prefill_tokens = max_batch, max_prefill_tokens
        self.waiting: deque[SimSeq] = deque()
        self.running: list[SimSeq] = []
        self.swapped: deque[SimSeq] = deque()
        self.finished: list[SimSeq] = []

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_tokens)

    def add(self, req: SimRequest) -> None:
        if self.blocks_for(req.prompt_len + req.output_len) > self.gpu_blocks:
            raise ValueError(f"request {req.request_id}: {req.prompt_len} prompt + {req.output_len} new tokens can "
                             f"never fit the GPU KV budget of {self.gpu_blocks} blocks x {self.block_tokens} tokens")
        self.waiting.append(SimSeq(req))

    def _used(self) -> int:
        return sum(self.blocks_for(s.num_computed + 1) for s in self.running)

    def schedule(self, now_s: float) -> SimBatch:
        batch = SimBatch()
        while self.running and self._used() > self.gpu_blocks:
            victim = self.running.pop()
            victim.num_preemptions += 1
            self.swapped.appendleft(victim)
            batch.preempted.append(victim)
        free = self.gpu_blocks - self._used()
        while self.swapped and len(self.running) < self.max_batch:
            need = self.blocks_for(self.swapped[0].num_computed + 1)
            if need > free:
                break
            s = self.swapped.popleft()
            self.running.append(s)
            batch.swapped_in.append(s)
            free -= need
        batch.decodes = [s for s in self.running if s.num_computed > 0]
        budget = self.max_prefill_tokens
        while self.waiting and self.waiting[0].req.arrival_s <= now_s and len(self.running) < self.max_batch:
            s = self.waiting[0]
            need = self.blocks_for(s.num_tokens + 1)
            if need > free or (batch.prefills and s.num_tokens > budget):
                break
            self.waiting.popleft()
            s.admitted_s = now_s if s.admitted_s is None else s.admitted_s
            self.running.append(s)
            batch.prefills.append(s)
            free -= need
            budget -= s.num_tokens
        return batch

    def complete(self, s: SimSeq, now_s: float) -> None:
        s.num_computed = s.num_tokens
        s.num_out += 1
        if s.first_token_s is None:
            s.first_token_s = now_s
        if s.done:
            s.finish_s = now_s
            self.running.remove(s)
            self.finished.append(s)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.swapped)

    def next_arrival_s(self) -> float | None:
        return self.waiting[0].req.arrival_s if self.waiting and not self.running and not self.swapped else None
