"""Continuous-batching scheduler of the reference engine (inference process).

Each step it decides which sequences run: swapped-out sequences come back first, then running ones decode,
then arrived requests are admitted while their prompt fits the GPU KV budget (and the batch and prefill-
token limits). When a decode step needs a block and none is free, the most recently admitted running
sequence is preempted (as vLLM does): SWAP parks its blocks on the CPU tier, RECOMPUTE frees them and
re-queues it with its generated tokens appended to the prompt. Pure bookkeeping over block counts, in
the inference process: it must never move bytes (the runner does) or look at the clock itself.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from tierplan.runtime.errors import ConfigError


class SeqState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class PreemptMode(Enum):
    SWAP = "swap"
    RECOMPUTE = "recompute"


@dataclass
class Sequence:
    seq_id: int
    arrival_s: float
    prompt: list[int]
    max_new_tokens: int
    state: SeqState = SeqState.WAITING
    output: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    admitted_s: float | None = None  # first time it was scheduled (queueing = admitted_s - arrival_s)
    first_token_s: float | None = None
    finish_s: float | None = None
    num_preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:  # len(tokens), without building them (a 16K prompt is copied each time)
        return len(self.prompt) + len(self.output)

    def tokens_from(self, start: int) -> list[int]:
        """tokens[start:], copying only that part: a decode step runs its last token, where building `tokens`
        copied the whole context twice a step per sequence (H100 phase runs 64-68: ~15 ns a token of the batch's
        context between decode steps)."""
        num_prompt = len(self.prompt)
        if start >= num_prompt:
            return self.output[start - num_prompt :]
        return self.prompt[start:] + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


@dataclass
class Batch:
    prefills: list[Sequence]  # run tokens[num_computed:] (the prompt, or prompt + output after a recompute)
    decodes: list[Sequence]  # run one token each: tokens[num_computed:] == [output[-1]]
    swapped_in: list[Sequence]
    preempted: list[Sequence]

    @property
    def empty(self) -> bool:
        return not (self.prefills or self.decodes)


class Scheduler:
    def __init__(self, gpu_blocks: int, block_tokens: int, max_batch: int = 64, max_prefill_tokens: int = 2048,
                 preempt: PreemptMode = PreemptMode.SWAP) -> None:
        for name, v in (("gpu_blocks", gpu_blocks), ("block_tokens", block_tokens), ("max_batch", max_batch),
                        ("max_prefill_tokens", max_prefill_tokens)):
            if v <= 0:
                raise ConfigError(f"Scheduler.{name} must be > 0, got {v}")
        self.gpu_blocks, self.block_tokens = gpu_blocks, block_tokens
        self.max_batch, self.max_prefill_tokens, self.preempt = max_batch, max_prefill_tokens, preempt
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.finished: list[Sequence] = []

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_tokens)

    def add(self, seq: Sequence) -> None:
        if not seq.prompt or seq.max_new_tokens < 1:
            raise ConfigError(f"request {seq.seq_id}: needs >= 1 prompt token and max_new_tokens >= 1, got "
                              f"{len(seq.prompt)} and {seq.max_new_tokens}")
        if not math.isfinite(seq.arrival_s):
            raise ConfigError(f"request {seq.seq_id}: arrival_s must be finite, got {seq.arrival_s}")
        if self.blocks_for(len(seq.prompt) + seq.max_new_tokens) > self.gpu_blocks:
            raise ConfigError(
                f"request {seq.seq_id}: {len(seq.prompt)} prompt + {seq.max_new_tokens} new tokens can never fit "
                f"the GPU KV budget of {self.gpu_blocks} blocks x {self.block_tokens} tokens"
            )
        self.waiting.append(seq)

    def _used(self) -> int:
        return sum(self.blocks_for(s.num_computed + 1) for s in self.running)

    def schedule(self, now_s: float) -> Batch:
        batch = Batch([], [], [], [])
        # Decodes first: each needs room for one more token; preempt the newest until they fit.
        while self.running and self._used() > self.gpu_blocks:
            victim = self.running.pop()
            victim.num_preemptions += 1
            if self.preempt is PreemptMode.SWAP:
                victim.state = SeqState.SWAPPED
                self.swapped.appendleft(victim)
            else:  # its K/V is dropped; the next prefill recomputes prompt + output so far
                victim.state, victim.num_computed = SeqState.WAITING, 0
                self.waiting.appendleft(victim)
            batch.preempted.append(victim)
        free = self.gpu_blocks - self._used()
        while self.swapped and len(self.running) < self.max_batch:
            s = self.swapped[0]
            need = self.blocks_for(s.num_computed + 1)
            if need > free:
                break
            self.swapped.popleft()
            s.state = SeqState.RUNNING
            self.running.append(s)
            batch.swapped_in.append(s)
            free -= need
        batch.decodes = [s for s in self.running if s.num_computed > 0]
        budget = self.max_prefill_tokens
        while self.waiting and self.waiting[0].arrival_s <= now_s and len(self.running) < self.max_batch:
            s = self.waiting[0]
            need = self.blocks_for(s.num_tokens + 1)
            if need > free or (batch.prefills and s.num_tokens > budget):
                break
            self.waiting.popleft()
            s.state = SeqState.RUNNING
            if s.admitted_s is None:
                s.admitted_s = now_s
            self.running.append(s)
            batch.prefills.append(s)
            free -= need
            budget -= s.num_tokens
        return batch

    def complete(self, seq: Sequence, token: int, now_s: float) -> None:
        """Record the token a step produced for `seq` (its K/V for all previous tokens are now cached)."""
        seq.num_computed = seq.num_tokens
        seq.output.append(token)
        if seq.first_token_s is None:
            seq.first_token_s = now_s
        if seq.done:
            seq.state, seq.finish_s = SeqState.FINISHED, now_s
            self.running.remove(seq)
            self.finished.append(seq)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.swapped)

    def next_arrival_s(self) -> float | None:
        return self.waiting[0].arrival_s if self.waiting and not self.running and not self.swapped else None

    def idle_gap_s(self, now_s: float) -> float:
        """After an empty batch at `now_s`: how far the clock must jump to the next arrival. RuntimeError when
        nothing is runnable and nothing new will arrive (a dead end the caller must not loop on)."""
        nxt = self.next_arrival_s()
        if nxt is None or nxt <= now_s:
            raise RuntimeError(f"scheduler made no progress with {len(self.waiting)} request(s) waiting and "
                               f"{len(self.swapped)} swapped out")
        return nxt - now_s
