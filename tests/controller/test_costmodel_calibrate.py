"""The cost model learns its compute and link parameters online from telemetry windows, from a wrong prior."""

from __future__ import annotations

import numpy as np
import pytest

from tierplan.controller.costmodel import ComputeParams, CostModel, HardwareSpec, StepLoad
from tierplan.controller.model_shape import ModelShape
from tierplan.controller.protocol import KVStats, LayerStats, Link, Stall, StallCause, StepTimings, Telemetry, Tier

SHAPE = ModelShape(name="t", num_layers=2, moe_layers=(0, 1), num_experts=8, top_k=2, expert_bytes=12288,
                   dense_bytes=1 << 20, kv_bytes_per_token=256, block_tokens=16)


def _window(seq: int, tokens_per_step: int, num_steps: int, misses: int, kv_loads: int, step_mean_ms: float,
            stall_ms: float, gpu_blocks: int = 4) -> Telemetry:
    layers = tuple(LayerStats(layer=i, activation_counts=(2 * tokens_per_step * num_steps // 8,) * 8,
                              router_entropy_mean=0.5, num_tokens=tokens_per_step * num_steps) for i in range(2))
    kv = KVStats(blocks_per_tier={Tier.GPU: gpu_blocks}, hits_per_tier={Tier.GPU: 10},
                 misses_per_tier={Tier.GPU: 0, Tier.CPU: kv_loads, Tier.NVME: 0})
    stalls = (Stall(cause=StallCause.EXPERT_MISS, count=num_steps, total_ms=stall_ms),) if stall_ms else ()
    return Telemetry(agent_id="a", rank=0, window_seq=seq, window_start_s=float(seq), window_end_s=seq + 1.0,
                     model="t", num_layers=2, num_experts=8, layers=layers, kv=kv, stalls=stalls,
                     step_timings_ms=StepTimings(num_steps=num_steps, mean=step_mean_ms, p50=step_mean_ms,
                                                 p99=step_mean_ms),
                     expert_hits=0, expert_misses=misses, applied_plan_version=0)


def test_fit_converges_from_a_wrong_prior_to_the_machine_that_made_the_telemetry() -> None:
    rng = np.random.default_rng(0)
    hw_prior = HardwareSpec({lk: 1e9 for lk in Link}, 1e-5, 1 << 30)  # 10x too fast a link, 20x too cheap a load
    model = CostModel(SHAPE, hw_prior, ComputeParams(dense_ms=0.1, moe_ms=0.1), forgetting=1.0)
    true_step = lambda t: 1.2 + 0.15 * t  # noqa: E731 - ms of compute per step at t tokens
    true_load_ms = lambda n, b: n * 0.2 + b / 1e8 * 1e3  # noqa: E731 - 0.2 ms per load, 100 MB/s
    truth = true_step(8) + true_load_ms(10, 10 * SHAPE.expert_bytes)
    prior_error = abs(model.compute_ms(8) + model.transfer_ms(Link.H2D, 10 * SHAPE.expert_bytes, 10) - truth)
    errors = []
    for seq in range(60):
        t, steps = int(rng.integers(1, 16)), 8
        misses, kv = int(rng.integers(0, 20)), int(rng.integers(0, 3))
        stall = true_load_ms(misses + kv, misses * SHAPE.expert_bytes + kv * SHAPE.kv_bytes_per_block)
        mean = true_step(t) + stall / steps
        noisy = mean * float(rng.normal(1.0, 0.02))
        # GPU KV blocks vary on their own: this machine's attention costs nothing per context token.
        model.calibrate(_window(seq, t, steps, misses, kv, noisy, stall, gpu_blocks=int(rng.integers(1, 40))))
        probe = model.compute_ms(8) + model.transfer_ms(Link.H2D, 10 * SHAPE.expert_bytes, 10)
        errors.append(abs(probe - (true_step(8) + true_load_ms(10, 10 * SHAPE.expert_bytes))))
    assert prior_error > 0.3 * truth  # the prior alone is far off
    assert errors[-1] < 0.03 * truth  # the fit has converged
    assert np.mean(errors[-10:]) < np.mean(errors[:10]) / 5
    assert model.overhead_s(Link.H2D) + SHAPE.expert_bytes / model.link_bytes_per_s(Link.H2D) == pytest.approx(
        0.2e-3 + SHAPE.expert_bytes / 1e8, rel=0.05)
    # The calibrated model prices a step the way the machine did.
    b = model.step_time_ms(StepLoad(batch_tokens=4, miss_count=(3, 2)))
    assert b.total_ms == pytest.approx(true_step(4) + true_load_ms(5, 5 * SHAPE.expert_bytes), rel=0.05)


def test_a_window_without_steps_changes_nothing() -> None:
    model = CostModel(SHAPE, HardwareSpec({lk: 1e9 for lk in Link}, 1e-5, 1 << 30), ComputeParams(dense_ms=0.1))
    before = (model.compute, model.link_bytes_per_s(Link.H2D))
    model.calibrate(_window(0, 0, 0, 0, 0, 0.0, 0.0))
    assert (model.compute, model.link_bytes_per_s(Link.H2D)) == before


def test_a_miss_costs_the_step_more_than_its_timed_stall_and_the_fit_learns_it() -> None:
    # The machine of H200 phase runs 26-29: a demand load stalls the layer for its copy (timed by the agent) and
    # costs the host 0.15 ms more that no stall counter sees (issuing it, mapping the slot, chunked layers).
    rng = np.random.default_rng(1)
    model = CostModel(SHAPE, HardwareSpec({lk: 1e8 for lk in Link}, 2e-4, 1 << 30), ComputeParams(dense_ms=0.1),
                      forgetting=1.0)
    host_ms_per_miss = 0.15
    true_stall = lambda n: n * (0.2 + SHAPE.expert_bytes / 1e8 * 1e3)  # noqa: E731 - the timed stall
    for seq in range(80):
        t, steps, misses = int(rng.integers(1, 16)), 8, int(rng.integers(0, 40))
        mean = 1.2 + 0.15 * t + (true_stall(misses) + host_ms_per_miss * misses) / steps
        model.calibrate(_window(seq, t, steps, misses, 0, mean * float(rng.normal(1.0, 0.01)), true_stall(misses)))
    assert model.compute.moe_ms_per_miss == pytest.approx(host_ms_per_miss, rel=0.1)
    truth = 1.2 + 0.15 * 4 + true_stall(5) + host_ms_per_miss * 5
    step = StepLoad(batch_tokens=4, context_tokens=64, miss_count=(3, 2))  # the windows' 4 GPU blocks of context
    assert model.step_time_ms(step).total_ms == pytest.approx(truth, rel=0.05)
    # what the optimizer charges a layer's demand load: its copy and the host's share
    assert model.layer_stall_ms(1.0) == pytest.approx(true_stall(1) + host_ms_per_miss, rel=0.05)


def test_a_fixed_cost_seen_at_one_step_size_is_not_priced_as_its_largest_feature() -> None:
    """Steps of one size (a B=1 decode: the layers' top-k experts active, 3 ms in all) cannot tell a fixed cost
    from a per-expert one; the prior decides. Its spreads are scaled by each feature's size in a typical step, so
    the fixed terms take their share: with one spread in raw units the 16 active experts of another step were
    priced as 16 x 0.4 ms (H100 phase steps: a b1 decode's 2.7 ms read as 64 x 0.05 ms, no intercept)."""
    model = CostModel(SHAPE, HardwareSpec({lk: 1e9 for lk in Link}, 1e-5, 1 << 30), ComputeParams(), forgetting=1.0)
    active = SHAPE.num_moe_layers * SHAPE.top_k
    for _ in range(200):
        model.observe(1.0, 0.0, active, 3.0)
    assert model.compute_ms(1.0) == pytest.approx(3.0, rel=0.02)  # what it saw, it prices
    truth = 3.0  # this machine's steps cost the same whatever their experts
    priced = model.step_time_ms(StepLoad(batch_tokens=1, active_experts=(8, 8))).total_ms
    assert priced < 2.0 * truth, model.compute


def test_how_far_a_slow_step_may_fall_before_it_counts_less_is_the_callers() -> None:
    """Steps of 3 ms with one in eight at 7 ms (a window's first, building its telemetry): a fit that down-weights
    beyond 1.5 median absolute residuals (the controller's default, for window means) sits near the common step;
    at 3 (the phase bench's per-step fits, which predict the mean) it counts the slow ones and lands nearer the
    mean of 3.5 ms. A huber_k that is not > 0 is refused."""
    from tierplan.controller.costmodel_fit import HUBER_K, OnlineLinear

    assert HUBER_K == 1.5
    fits = {k: OnlineLinear([0.0], [10.0], robust=True, huber_k=k) for k in (1.5, 3.0)}
    for i in range(400):
        for fit in fits.values():
            fit.update([1.0], 7.0 if i % 8 == 0 else 3.0)
    tight, loose = (float(fits[k].theta[0]) for k in (1.5, 3.0))
    assert tight < loose and abs(loose - 3.5) < abs(tight - 3.5), (tight, loose)
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="huber_k must be > 0"):
            OnlineLinear([0.0], [1.0], huber_k=bad)
