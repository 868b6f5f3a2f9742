"""Agent taps: router counters, co-occurrence, entropy, stalls by cause, and the Telemetry they produce."""

from __future__ import annotations

import itertools

import torch

from tierplan.agent.taps import RouterTap, TelemetryWindow
from tierplan.controller.protocol import StallCause, Telemetry, parse, to_json


def test_router_tap_counts_pairs_and_entropy_then_resets() -> None:
    tap = RouterTap((1, 3), num_experts=6, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(20)])  # [20, 3] distinct per token
    w = torch.rand(20, 3, generator=g)
    tap(3, ids, w)
    stats = {s.layer: s for s in tap.drain()}
    assert stats[1].num_tokens == 0 and sum(stats[1].activation_counts) == 0
    s = stats[3]
    assert list(s.activation_counts) == torch.bincount(ids.reshape(-1), minlength=6).tolist()
    want = {}
    for row in ids.tolist():
        for a, b in itertools.combinations(sorted(row), 2):
            want[(a, b)] = want.get((a, b), 0) + 1
    assert {(p.a, p.b): p.count for p in s.cooccurrence} == want
    p = w / w.sum(-1, keepdim=True)
    assert abs(s.router_entropy_mean - float(-(p * p.log()).sum(-1).mean())) < 1e-5
    assert all(sum(x.activation_counts) == 0 for x in tap.drain())  # drained counters start again at zero


def test_window_classifies_stalls_and_builds_valid_telemetry() -> None:
    now = iter(float(i) for i in range(100))
    tap = RouterTap((0,), num_experts=4, device=torch.device("cpu"))
    win = TelemetryWindow("agent-0", 0, "tiny", 2, 4, tap, clock=lambda: next(now))
    tap(0, torch.tensor([[0, 1], [1, 2]]), torch.ones(2, 2))
    win.observe_step(0.010, expert_stall_s=0.002, kv_stall_s=0.0)
    win.observe_step(0.012, expert_stall_s=0.0, kv_stall_s=0.003)
    win.observe_step(0.020, expert_stall_s=0.001, kv_stall_s=0.001)
    win.observe_step(0.008, expert_stall_s=0.0, kv_stall_s=0.0)
    msg = win.close(kv_blocks={"gpu": 3, "cpu": 1, "nvme": 0}, kv_hits={"gpu": 9, "cpu": 0, "nvme": 0},
                    kv_misses={"gpu": 0, "cpu": 2, "nvme": 1},
                    links={"h2d": {"bytes": 4096, "queue_delay_ms_mean": 0.1, "queue_delay_ms_max": 0.3}},
                    expert_hits=5, expert_misses=2, plan_version=1, fallbacks={"lru_no_plan_order": 2})
    stalls = {s.cause: (s.count, round(s.total_ms, 6)) for s in msg.stalls}
    assert stalls == {StallCause.EXPERT_MISS: (1, 2.0), StallCause.KV_MISS: (1, 3.0), StallCause.BOTH: (1, 2.0)}
    assert msg.step_timings_ms.num_steps == 4 and msg.window_seq == 0
    assert parse(Telemetry, to_json(msg)) == msg  # what the sidecar will ship round-trips
    assert win.close({}, {}, {}, {}, 0, 0, 1, {}).window_seq == 1


def test_window_reports_each_steps_tokens_only_when_every_step_has_them() -> None:
    tap = RouterTap((0,), num_experts=4, device=torch.device("cpu"))
    win = TelemetryWindow("agent-0", 0, "tiny", 2, 4, tap, clock=lambda: 0.0)
    for tokens in (1000, 4, 4):
        win.observe_step(0.01, 0.0, 0.0, tokens=tokens)
    msg = win.close({}, {}, {}, {}, 0, 0, 1, {})
    assert msg.step_tokens == (1000, 4, 4) and parse(Telemetry, to_json(msg)) == msg
    win.observe_step(0.01, 0.0, 0.0, tokens=4)
    win.observe_step(0.01, 0.0, 0.0)  # an adapter that cannot tell: no partial list, which would mislead
    assert win.close({}, {}, {}, {}, 0, 0, 1, {}).step_tokens == ()


def test_window_reports_each_steps_decode_tokens_only_when_every_step_has_them() -> None:
    """A prompt step, then two decode steps: the decode tokens ride beside the step tokens. One step that cannot
    tell them apart, or says more decode tokens than the step had (counted), leaves the window without the
    split, its step tokens still sent; past MAX_UNION_STEPS steps only the newest count."""
    from tierplan.controller.protocol import MAX_UNION_STEPS

    tap = RouterTap((0,), num_experts=4, device=torch.device("cpu"))
    win = TelemetryWindow("agent-0", 0, "tiny", 2, 4, tap, clock=lambda: 0.0)
    for tokens, decodes in ((1000, 0), (4, 4), (4, 3)):
        win.observe_step(0.01, 0.0, 0.0, tokens=tokens, decode_tokens=decodes)
    msg = win.close({}, {}, {}, {}, 0, 0, 1, {})
    assert msg.step_decode_tokens == (0, 4, 3) and parse(Telemetry, to_json(msg)) == msg
    win.observe_step(0.01, 0.0, 0.0, tokens=4, decode_tokens=4)
    win.observe_step(0.01, 0.0, 0.0, tokens=4)
    msg = win.close({}, {}, {}, {}, 0, 0, 1, {})
    assert msg.step_tokens == (4, 4) and msg.step_decode_tokens == () and not msg.fallbacks
    win.observe_step(0.01, 0.0, 0.0, tokens=4, decode_tokens=9)
    msg = win.close({}, {}, {}, {}, 0, 0, 1, {})
    assert msg.step_decode_tokens == () and msg.fallbacks == {"decode_split_refused": 1}
    win.observe_step(0.01, 0.0, 0.0, tokens=4, decode_tokens=5)
    assert win.close({}, {}, {}, {}, 0, 0, 1, {}).fallbacks == {"decode_split_refused": 2}  # a running total
    win.observe_step(0.01, 0.0, 0.0, tokens=7)  # an old step without the split, then a full window's worth with it
    for _ in range(MAX_UNION_STEPS):
        win.observe_step(0.01, 0.0, 0.0, tokens=4, decode_tokens=2)
    msg = win.close({}, {}, {}, {}, 0, 0, 1, {})
    assert msg.step_decode_tokens == (2,) * MAX_UNION_STEPS and msg.step_tokens == (4,) * MAX_UNION_STEPS


def test_window_counts_the_steps_run_chunked() -> None:
    tap = RouterTap((0,), num_experts=4, device=torch.device("cpu"))
    win = TelemetryWindow("agent-0", 0, "tiny", 2, 4, tap, clock=lambda: 0.0)
    for chunked in (True, False, True):
        win.observe_step(0.01, 0.0, 0.0, chunked=chunked)
    msg = win.close({}, {}, {}, {}, 0, 0, 1, {})
    assert msg.chunked_steps == 2 and msg.schema_version == 3 and parse(Telemetry, to_json(msg)) == msg
    win.observe_step(0.01, 0.0, 0.0, tokens=4)
    msg = win.close({}, {}, {}, {}, 0, 0, 1, {})
    assert msg.chunked_steps == 0  # each window counts its own
    assert msg.schema_version == 2  # no v3 field sent: an older controller still reads it


def test_telemetry_refuses_step_tokens_that_do_not_cover_its_steps() -> None:
    import pytest

    from tierplan.controller.protocol import ProtocolError

    tap = RouterTap((0,), num_experts=4, device=torch.device("cpu"))
    win = TelemetryWindow("agent-0", 0, "tiny", 2, 4, tap, clock=lambda: 0.0)
    win.observe_step(0.01, 0.0, 0.0, tokens=4)
    win.observe_step(0.01, 0.0, 0.0, tokens=4)
    raw = to_json(win.close({}, {}, {}, {}, 0, 0, 1, {})).replace('"step_tokens":[4,4]', '"step_tokens":[4]')
    with pytest.raises(ProtocolError, match="step_tokens"):
        parse(Telemetry, raw)


def test_block_mass_sums_to_one_and_follows_the_keys() -> None:
    from tierplan.runtime.engine.attention import block_mass

    g = torch.Generator().manual_seed(1)
    q = torch.randn(4, 8, generator=g)
    keys = torch.randn(21, 2, 8, generator=g) * 0.1
    keys[17, :] = q.view(2, 2, 8).mean(1) * 40  # one key aligned with the query: its block dominates
    m = block_mass(q, keys, 8)
    assert m.shape == (3,) and abs(float(m.sum()) - 1.0) < 1e-5 and int(m.argmax()) == 2


def test_attention_mass_tap_samples_one_sequence_per_layer_on_sampled_steps() -> None:
    from tierplan.agent.taps import AttentionMassTap

    tap = AttentionMassTap(layers=(0,), every_steps=2)
    tap.begin_step(1)
    assert not tap.wants(0, 5)
    tap.begin_step(2)
    assert tap.wants(0, 5) and not tap.wants(0, 6) and not tap.wants(1, 5)
    tap.record(0, [10, 11], torch.tensor([0.25, 0.75]))
    tap.record(0, [10], torch.tensor([1.0]))
    out = {b.block: (b.mass, b.samples) for b in tap.drain()}
    assert out == {10: (0.625, 2), 11: (0.75, 1)} and tap.drain() == ()


def test_router_tap_ring_folds_on_overflow_and_big_batches_and_uneven_layers() -> None:
    g = torch.Generator().manual_seed(4)
    tap = RouterTap((1, 3), num_experts=6, device=torch.device("cpu"), capacity_rows=8)
    feeds = {1: [], 3: []}
    for layer, n in ((3, 5), (1, 5), (3, 5), (3, 20), (1, 2), (3, 1)):  # overflow, a batch > ring, uneven fills
        ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(n)])
        w = torch.rand(n, 2, generator=g) + 0.01
        tap(layer, ids, w)
        feeds[layer].append((ids, w))
    stats = {s.layer: s for s in tap.drain()}
    for layer, parts in feeds.items():
        ids = torch.cat([i for i, _ in parts])
        w = torch.cat([x for _, x in parts])
        s = stats[layer]
        assert s.num_tokens == ids.shape[0]
        assert list(s.activation_counts) == torch.bincount(ids.reshape(-1), minlength=6).tolist()
        pairs = {}
        for a, b in ids.sort(-1).values.tolist():
            pairs[(a, b)] = pairs.get((a, b), 0) + 1
        assert {(p.a, p.b): p.count for p in s.cooccurrence} == pairs
        p = w / w.sum(-1, keepdim=True)
        assert abs(s.router_entropy_mean - float(-(p * p.log()).sum(-1).mean())) < 1e-5


def _window_counts(seed: int = 3):
    """A qwen3-shaped window (48 layers x 128 experts, top-8) through a real RouterTap snapshot."""
    g = torch.Generator().manual_seed(seed)
    layers = tuple(range(48))
    tap = RouterTap(layers, num_experts=128, device=torch.device("cpu"))
    for _ in range(6):
        ids = torch.stack([torch.stack([torch.randperm(128, generator=g)[:8] for _ in range(16)])
                           for _ in layers])  # [48, 16, 8] distinct experts per token
        tap.add_all(ids, torch.rand(48, 16, 8, generator=g))
    return tap.snapshot()


def test_trusted_layer_stats_equal_validated_ones_and_round_trip() -> None:
    """The fast path (array checks + model_construct) builds exactly what validation builds, and the result
    validates: what the sidecar parses is what the agent made."""
    from tierplan.controller.protocol import LayerStats

    snap = _window_counts()
    fast, slow = snap.layer_stats(trusted=True), snap.layer_stats(trusted=False)
    assert fast == slow and len(fast) == 48 and all(len(s.cooccurrence) > 0 for s in fast)
    for s in fast:
        assert LayerStats.model_validate_json(s.model_dump_json()) == s


def test_trusted_layer_stats_refuse_what_validation_refuses() -> None:
    import dataclasses

    import numpy as np
    import pytest

    snap = _window_counts()

    def broken(**arrays):
        return dataclasses.replace(snap, **arrays)

    flat = snap.pair_flat.copy()
    flat[5, 0] = 7 * 128 + 7  # a == b
    with pytest.raises(ValueError, match=r"layers\.5\.cooccurrence\.0: pair \(7, 7\) must have a < b"):
        broken(pair_flat=flat).layer_stats(trusted=True)
    flat = snap.pair_flat.copy()
    flat[2, 1] = flat[2, 0]
    with pytest.raises(ValueError, match=r"layers\.2\.cooccurrence: a pair repeats in layer 2"):
        broken(pair_flat=flat).layer_stats(trusted=True)
    counts = snap.counts.copy()
    counts[9, 3] = -1
    with pytest.raises(ValueError, match=r"layers\.9\.activation_counts: negative count"):
        broken(counts=counts).layer_stats(trusted=True)
    ent = snap.entropy_sum.copy()
    ent[4] = np.nan
    with pytest.raises(ValueError, match=r"layers\.4\.router_entropy_mean: nan must be finite"):
        broken(entropy_sum=ent).layer_stats(trusted=True)
