"""Continuous batching: admission by KV budget, preemption by swap or recompute, replay metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierplan.runtime.device import Device
from tierplan.runtime.engine.engine import EngineConfig, ReferenceEngine
from tierplan.runtime.engine.presets import preset
from tierplan.runtime.engine.routing_trace import RoutingTrace
from tierplan.runtime.engine.runner import ForcedRouter, Runner
from tierplan.runtime.engine.scheduler import PreemptMode, Scheduler, SeqState, Sequence
from tierplan.runtime.engine.workloads import Request, load_mooncake, scale_requests
from tierplan.runtime.errors import ConfigError
from tierplan.runtime.selfcheck.exact import auto_block_tokens

DATA = Path(__file__).parents[2] / "data"


def seq(i: int, n: int, new: int = 4, at: float = 0.0) -> Sequence:
    return Sequence(i, at, list(range(1, n + 1)), new)


def test_admission_waits_for_arrival_and_kv_room() -> None:
    s = Scheduler(gpu_blocks=4, block_tokens=4, max_batch=8)
    s.add(seq(0, 6))  # needs 2 blocks
    s.add(seq(1, 6))  # 2 more: fits
    s.add(seq(2, 6, at=5.0))
    b = s.schedule(now_s=0.0)
    assert [x.seq_id for x in b.prefills] == [0, 1] and not b.decodes
    assert s.schedule(now_s=1.0).prefills == []  # no room, and request 2 has not arrived anyway


def test_decode_growth_preempts_the_newest_by_swap_then_swaps_it_back() -> None:
    s = Scheduler(gpu_blocks=3, block_tokens=4, max_batch=8, preempt=PreemptMode.SWAP)
    a, b = seq(0, 4, new=8), seq(1, 3, new=8)
    s.add(a)
    s.add(b)
    s.schedule(0.0)
    s.complete(a, 7, 0.1)
    s.complete(b, 7, 0.1)
    a.output += [7, 7, 7, 7]  # a has grown to 9 tokens (8 cached): its next one needs a third block
    a.num_computed = 8
    batch = s.schedule(0.2)
    assert batch.preempted == [b] and b.state is SeqState.SWAPPED and b.num_preemptions == 1
    s.complete(a, 7, 0.3)
    s.running.remove(a)  # a finishes elsewhere: room again
    assert s.schedule(0.4).swapped_in == [b]


def test_recompute_preemption_requeues_with_generated_tokens_kept() -> None:
    s = Scheduler(gpu_blocks=3, block_tokens=4, preempt=PreemptMode.RECOMPUTE)
    a, b = seq(0, 3, new=8), seq(1, 3, new=8)
    s.add(a)
    s.add(b)
    s.schedule(0.0)
    for x in (a, b):
        s.complete(x, 9, 0.1)
        x.output += [9, 9, 9]
        x.num_computed = 6
    batch = s.schedule(0.2)
    assert b in batch.preempted and b.state is SeqState.WAITING and b.num_computed == 0
    assert b.tokens[-4:] == [9, 9, 9, 9]  # the recompute prefill will see prompt + output


def test_requests_that_can_never_fit_are_refused() -> None:
    with pytest.raises(ConfigError, match="never fit"):
        Scheduler(gpu_blocks=2, block_tokens=4).add(seq(0, 8, new=4))
    with pytest.raises(ConfigError, match="max_batch"):
        Scheduler(gpu_blocks=2, block_tokens=4, max_batch=0)


@pytest.mark.parametrize("mode", list(PreemptMode))
def test_replay_of_a_real_trace_finishes_every_request(mode: PreemptMode, tmp_path: Path) -> None:
    spec = preset("tiny")
    bt = auto_block_tokens(spec)
    reqs = scale_requests(load_mooncake(DATA / "requests/mooncake_conversation_sample.jsonl", limit=24,
                                        time_scale=0.01), 48, 16, 24, block_tokens=16)
    eng = ReferenceEngine(spec, Device("cpu"), EngineConfig(block_tokens=bt, resident_frac=0.5, kv_gpu_blocks=4,
                                                            kv_cpu_blocks=64, kv_nvme_blocks=64, workdir=tmp_path))
    try:
        trace = RoutingTrace.load(DATA / "routing/flame_moe_290m_sample.npz")
        rep = Runner(eng, Scheduler(4, bt, max_batch=16, preempt=mode), ForcedRouter(trace, eng)).run(reqs)
    finally:
        eng.close()
    assert [r.request_id for r in rep.requests] == sorted(r.request_id for r in reqs)
    assert all(m.output_len == r.output_len for m, r in zip(rep.requests, sorted(reqs, key=lambda r: r.request_id),
                                                            strict=True))
    assert all(0 <= m.queue_s <= m.ttft_s and m.tpot_s >= 0 for m in rep.requests)
    assert sum(m.preemptions for m in rep.requests) > 0  # the small KV budget forced preemptions
    assert 0.0 <= rep.expert_hit_rate <= 1.0 and rep.tokens_per_s > 0


def test_a_step_cap_stops_the_run_and_counts_what_it_left(tmp_path: Path) -> None:
    """`stop`: asked before each step, it ends the run where it says so; the requests that finished are reported
    as in a full run, the others counted as unfinished (their tokens in no request's metrics)."""
    spec = preset("tiny")
    bt = auto_block_tokens(spec)
    reqs = scale_requests(load_mooncake(DATA / "requests/mooncake_conversation_sample.jsonl", limit=12,
                                        time_scale=0.01), 48, 16, 24, block_tokens=16)
    trace = RoutingTrace.load(DATA / "routing/flame_moe_290m_sample.npz")
    reports = []
    for cap in (None, 20):
        eng = ReferenceEngine(spec, Device("cpu"), EngineConfig(block_tokens=bt, kv_gpu_blocks=64, kv_cpu_blocks=64,
                                                                workdir=tmp_path))
        try:
            runner = Runner(eng, Scheduler(64, bt, max_batch=4), ForcedRouter(trace, eng), virtual_step_s=0.01)
            steps = {"n": 0}
            runner.on_step = lambda b, s, n=steps: n.__setitem__("n", n["n"] + 1)
            reports.append(runner.run(reqs, stop=None if cap is None else lambda n=steps, c=cap: n["n"] >= c))
        finally:
            eng.close()
    full, capped = reports
    assert full.unfinished == 0 and full.steps > 20 and len(full.requests) == len(reqs)
    assert capped.steps == 20 and capped.unfinished > 0
    assert len(capped.requests) + capped.unfinished == len(reqs)
    early = {m.request_id: m.output_len for m in full.requests}
    assert all(early[m.request_id] == m.output_len for m in capped.requests)  # finished ones whole


def test_preemption_does_not_change_the_tokens(tmp_path: Path) -> None:
    """Swap and recompute are placement decisions: the generated tokens must equal an unconstrained run."""
    spec = preset("tiny")
    bt = auto_block_tokens(spec)
    reqs = [Request(i, 0.0, 20 + 7 * i, 10, (), "test") for i in range(6)]
    outs = []
    for gpu_blocks, mode in ((64, PreemptMode.SWAP), (6, PreemptMode.SWAP), (6, PreemptMode.RECOMPUTE)):
        eng = ReferenceEngine(spec, Device("cpu"), EngineConfig(block_tokens=bt, kv_gpu_blocks=gpu_blocks,
                                                                kv_cpu_blocks=64, kv_nvme_blocks=8,
                                                                workdir=tmp_path / f"{gpu_blocks}{mode.value}"))
        try:
            sched = Scheduler(gpu_blocks, bt, max_batch=1, preempt=mode)  # one at a time: same batches
            runner = Runner(eng, sched)
            runner.run(reqs)
            outs.append({s.seq_id: s.output for s in sched.finished})
        finally:
            eng.close()
    assert outs[0] == outs[1] == outs[2]


def test_requests_the_runner_could_never_finish_are_refused_up_front() -> None:
    s = Scheduler(gpu_blocks=4, block_tokens=4)
    with pytest.raises(ConfigError, match="max_new_tokens >= 1"):
        s.add(seq(0, 3, new=0))
    with pytest.raises(ConfigError, match="arrival_s must be finite"):
        s.add(Sequence(1, float("nan"), [1, 2], 2))
    with pytest.raises(ConfigError, match="never fit"):
        s.add(seq(2, 16, new=1))  # 17 tokens: 5 blocks of 4, the budget is 4
    assert not s.waiting


def test_runner_refuses_a_scheduler_that_does_not_match_the_engine(tmp_path: Path) -> None:
    spec = preset("tiny")
    bt = auto_block_tokens(spec)
    eng = ReferenceEngine(spec, Device("cpu"), EngineConfig(block_tokens=bt, kv_gpu_blocks=8, workdir=tmp_path))
    try:
        with pytest.raises(ConfigError, match="block_tokens"):
            Runner(eng, Scheduler(8, bt * 2, preempt=PreemptMode.RECOMPUTE))
        with pytest.raises(ConfigError, match="kv_gpu_blocks"):
            Runner(eng, Scheduler(9, bt, preempt=PreemptMode.RECOMPUTE))
        with pytest.raises(ConfigError, match="kv_cpu_blocks"):
            Runner(eng, Scheduler(8, bt, preempt=PreemptMode.SWAP))
    finally:
        eng.close()


def test_forced_routes_depend_on_sequence_and_position_only(tmp_path: Path) -> None:
    spec = preset("tiny")
    eng = ReferenceEngine(spec, Device("cpu"), EngineConfig(block_tokens=auto_block_tokens(spec), workdir=tmp_path))
    try:
        router = ForcedRouter(RoutingTrace.load(DATA / "routing/flame_moe_290m_sample.npz"), eng)
        a = router.trace_rows([3, 1], [5, 0], [1, 2])  # rows (3, 5), (1, 0), (1, 1)
        b = router.trace_rows([1, 7, 3], [1, 2, 5], [1, 1, 1])  # rows (1, 1), (7, 2), (3, 5)
        a_ids, a_w, b_ids, b_w = router.ids[a, 0], router.weights[a, 0], router.ids[b, 0], router.weights[b, 0]
    finally:
        eng.close()
    assert torch.equal(a_ids[0], b_ids[2]) and torch.equal(a_ids[2], b_ids[0]) and torch.equal(a_w[0], b_w[2])


def test_a_step_clock_makes_batches_independent_of_host_speed(tmp_path: Path) -> None:
    """Regression: with wall-clock pacing a slower host admitted requests in other batches."""
    spec = preset("tiny")
    bt = auto_block_tokens(spec)
    reqs = scale_requests(load_mooncake(DATA / "requests/mooncake_conversation_sample.jsonl", limit=16,
                                        time_scale=0.01), 32, 8, 16, block_tokens=16)
    outs, batches = [], []
    for speed in (1.0, 50.0):
        seen: list[tuple[int, ...]] = []
        ticks = iter(range(10**9))
        eng = ReferenceEngine(spec, Device("cpu"), EngineConfig(block_tokens=bt, kv_gpu_blocks=64, kv_cpu_blocks=16,
                                                                workdir=tmp_path / str(speed)))
        try:
            trace = RoutingTrace.load(DATA / "routing/flame_moe_290m_sample.npz")
            sched = Scheduler(64, bt, max_batch=16)  # room for all: only arrivals pace admission
            Runner(eng, sched, ForcedRouter(trace, eng), clock=lambda s=speed, tk=ticks: next(tk) * 0.001 * s,
                   on_step=lambda b, _s, seen=seen: seen.append(tuple(x.seq_id for x in b.prefills + b.decodes)),
                   virtual_step_s=0.005).run(reqs)
            outs.append({x.seq_id: x.output for x in sched.finished})
            batches.append(seen)
        finally:
            eng.close()
    assert batches[0] == batches[1] and outs[0] == outs[1]


@pytest.mark.parametrize(("prompt", "output"), [(5, 0), (5, 3), (1, 1)])
def test_tokens_from_and_num_tokens_say_what_the_whole_token_list_says(prompt: int, output: int) -> None:
    """The runner reads a step's tokens through `tokens_from` (no copy of the whole context a step)."""
    s = seq(0, prompt)
    s.output = [100 + i for i in range(output)]
    assert s.num_tokens == len(s.tokens)
    for start in range(s.num_tokens + 2):
        assert s.tokens_from(start) == s.tokens[start:]
