"""The cost model's step time: compute, demand misses, streamed prefetches, KV fetches and their overlap."""

from __future__ import annotations

import pytest

from tierplan.controller.costmodel import ComputeParams, CostModel, HardwareSpec, StepLoad
from tierplan.controller.model_shape import ModelShape
from tierplan.controller.protocol import Link, StallCause

MB = 1 << 20


def _shape(num_layers: int = 4, moe: tuple[int, ...] = (1, 2, 3)) -> ModelShape:
    return ModelShape(name="t", num_layers=num_layers, moe_layers=moe, num_experts=16, top_k=2,
                      expert_bytes=10 * MB, dense_bytes=100 * MB, kv_bytes_per_token=1024, block_tokens=16)


def _hw(gbps: float = 10.0, overhead_s: float = 0.0) -> HardwareSpec:
    return HardwareSpec({lk: gbps * 1e9 for lk in Link}, overhead_s, 80 << 30)


def _model(**kw: float) -> CostModel:
    params = ComputeParams(dense_ms=1.0, moe_ms=2.0, **kw)
    return CostModel(_shape(), _hw(), params)


def test_no_transfers_is_pure_compute() -> None:
    b = _model(step_ms=0.5).step_time_ms(StepLoad(batch_tokens=4))
    assert b.total_ms == pytest.approx(4 * 1.0 + 3 * 2.0 + 0.5)
    assert sum(b.stall_ms.values()) == 0.0
    assert b.compute_ms == pytest.approx(b.total_ms)


def test_miss_at_the_layer_stalls_in_full() -> None:
    m = _model()
    one_load_ms = 10 * MB / 10e9 * 1e3
    b = m.step_time_ms(StepLoad(batch_tokens=1, miss_count=(0, 3, 0)))
    assert b.stall_ms[StallCause.EXPERT_MISS] == pytest.approx(3 * one_load_ms)
    assert b.expert_stall_ms_per_layer[1] == pytest.approx(3 * one_load_ms)
    assert b.total_ms == pytest.approx(10.0 + 3 * one_load_ms)


def test_prefetch_hides_behind_earlier_layers_compute() -> None:
    m = _model()
    one_load_ms = 10 * MB / 10e9 * 1e3  # 1.05 ms
    # Layer 3 starts its experts at 1+3+3+1 = 8 ms: two loads (2.1 ms) streamed from step start are long done.
    hidden = m.step_time_ms(StepLoad(batch_tokens=1, prefetch_count=(0, 0, 2)))
    assert hidden.total_ms == pytest.approx(10.0)
    # Layer 1's experts start at 2 ms: 4 loads (4.2 ms) streamed from 0 stall 2.2 ms; misses would stall 4.2 ms.
    streamed = m.step_time_ms(StepLoad(batch_tokens=1, prefetch_count=(4, 0, 0)))
    missed = m.step_time_ms(StepLoad(batch_tokens=1, miss_count=(4, 0, 0)))
    assert streamed.total_ms == pytest.approx(10.0 + 4 * one_load_ms - 2.0)
    assert missed.total_ms == pytest.approx(10.0 + 4 * one_load_ms)


def test_urgent_miss_pushes_queued_prefetches_back() -> None:
    m = _model()
    one = 10 * MB / 10e9 * 1e3
    b = m.step_time_ms(StepLoad(batch_tokens=1, miss_count=(2, 0, 0), prefetch_count=(0, 6, 0)))
    # Layer 2's six loads end at 6.3 ms without the miss, 8.4 with it; layer 2 routes at 1+1+2.1+2+1 = 7.1 ms.
    assert b.expert_stall_ms_per_layer[0] == pytest.approx(2 * one)
    assert b.expert_stall_ms_per_layer[1] == pytest.approx(8 * one - (5 + 2 * one))


def test_kv_fetch_stalls_first_and_a_step_waiting_on_both_counts_as_both() -> None:
    m = _model()
    one = 10 * MB / 10e9 * 1e3
    kv_only = m.step_time_ms(StepLoad(batch_tokens=1, kv_fetch_bytes=20 * MB, kv_fetch_count=2))
    assert kv_only.stall_ms[StallCause.KV_MISS] == pytest.approx(2 * one)
    assert kv_only.total_ms == pytest.approx(10.0 + 2 * one)
    # The KV fetch holds the link first: six loads for layer 1 queue behind it and arrive at 2.1 + 6.3 ms.
    b = m.step_time_ms(StepLoad(batch_tokens=1, prefetch_count=(6, 0, 0), kv_fetch_bytes=20 * MB, kv_fetch_count=2))
    assert b.expert_stall_ms_per_layer[0] == pytest.approx(8 * one - (2 * one + 2.0))
    assert b.stall_ms[StallCause.BOTH] == pytest.approx(2 * one + b.expert_stall_ms_per_layer[0])
    assert b.stall_ms[StallCause.EXPERT_MISS] == b.stall_ms[StallCause.KV_MISS] == 0.0
    assert b.link_ms[Link.H2D] == pytest.approx(8 * one)


def test_per_transfer_overhead_charges_small_records() -> None:
    m = CostModel(_shape(), _hw(overhead_s=1e-3), ComputeParams(dense_ms=1.0))
    assert m.transfer_ms(Link.H2D, 0, 5) == pytest.approx(5.0)
    assert m.layer_stall_ms(num_missed=2) == pytest.approx(2 * (1.0 + 10 * MB / 10e9 * 1e3))


def test_layer_stall_counts_only_what_the_window_cannot_hide() -> None:
    m = _model()
    one = 10 * MB / 10e9 * 1e3
    window = m.compute_ms(1.0) / 4
    assert m.layer_stall_ms(0, num_streamed=1) == pytest.approx(max(0.0, one - window))
    assert m.layer_stall_ms(0, num_streamed=10) == pytest.approx(10 * one - window)
    assert m.layer_stall_ms(0, num_streamed=10, window_layers=3) < m.layer_stall_ms(0, num_streamed=10)


def test_spills_longer_than_the_step_stretch_it() -> None:
    m = _model()
    b = m.step_time_ms(StepLoad(batch_tokens=1, kv_spill_bytes=200 * MB, kv_spill_count=1))
    assert b.total_ms == pytest.approx(200 * MB / 10e9 * 1e3)
    assert b.stall_ms[StallCause.KV_MISS] == pytest.approx(b.total_ms - 10.0)


def test_bad_load_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="miss_count"):
        _model().step_time_ms(StepLoad(batch_tokens=1, miss_count=(1, 2)))
    with pytest.raises(ValueError, match="h2disk"):
        HardwareSpec({Link.H2D: 1e9}, 0.0, 0)


def test_layer_valuation_agrees_with_the_step_it_values() -> None:
    """The optimizer's per-layer stall is what the step model adds when only that layer misses."""
    m = _model(dense_ms_per_token=0.01)
    base = m.step_time_ms(StepLoad(batch_tokens=8)).total_ms
    for j in range(3):
        misses = tuple(5 if i == j else 0 for i in range(3))
        added = m.step_time_ms(StepLoad(batch_tokens=8, miss_count=misses)).total_ms - base
        assert added == pytest.approx(m.layer_stall_ms(num_missed=5, batch_tokens=8))


def test_a_chunked_step_pays_its_term_once_and_the_fit_learns_it_apart_from_the_misses() -> None:
    """A step run chunked off its graphs costs `chunked_step_ms` once, beside its layers' compute. Fed steps of
    one size, some chunked with more misses (as the engine's are: H100/H200 phase runs 01-40, +9-27 ms a step
    beyond 0.06-0.16 ms a miss), the fit finds the step's term and the per-miss one apart."""
    b = _model(chunked_step_ms=12.0).step_time_ms(StepLoad(batch_tokens=4, chunked=True))
    assert b.total_ms == pytest.approx(4 * 1.0 + 3 * 2.0 + 12.0) and b.compute_ms == pytest.approx(b.total_ms)
    cost = CostModel(_shape(), _hw(), ComputeParams(), forgetting=1.0)
    for i in range(400):
        chunked, misses = (i % 3 == 0), 20 + (i % 7) * 10 + (i % 2) * 15
        cost.observe(4, 0, 8, 5.0 + 0.1 * misses + (15.0 if chunked else 0.0), expert_misses=misses,
                     chunked=float(chunked))
    assert cost.compute.chunked_step_ms == pytest.approx(15.0, rel=0.05)
    assert cost.compute.moe_ms_per_miss == pytest.approx(0.1, rel=0.05)


def test_calibrate_reads_the_share_of_a_windows_steps_run_chunked() -> None:
    from tests.controller.loop_fixtures import Windows, make_controller

    tel = Windows(steps=4).next(batch=4, kv_live=20).model_copy(update={"chunked_steps": 3, "schema_version": 3})
    cost, seen = make_controller().cost, {}
    cost.observe = lambda *a, **kw: seen.update(kw)  # type: ignore[method-assign]
    cost.calibrate(tel)
    assert seen["chunked"] == pytest.approx(3 / 4) and seen["weight"] == 4
