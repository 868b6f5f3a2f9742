"""The running batch from the steps' decode tokens, where the agent splits them from the prompt tokens."""

from __future__ import annotations

import numpy as np
import pytest

from tests.controller.loop_fixtures import Windows, make_controller
from tierplan.controller.protocol import ProtocolError, Telemetry, parse, to_json


def _window(tokens: tuple[int, ...], decodes: tuple[int, ...] | None, win: Windows | None = None) -> Telemetry:
    """A window of the fixture's routes whose steps carried `tokens`, `decodes` of them decoding (None: the
    agent does not say). No unions: the step tokens are what the batch is read from."""
    tel = (win or Windows(steps=len(tokens))).next(batch=4, kv_live=20)
    extra = {} if decodes is None else {"step_decode_tokens": decodes}
    return parse(Telemetry, to_json(tel.model_copy(update={"step_unions": (), "step_tokens": tokens, **extra})))


def test_a_window_mostly_of_prompt_chunks_reads_the_running_batch_from_its_decode_tokens() -> None:
    """Five of eight steps carry a 1,024-token prompt chunk beside the 4 decoding sequences: the median whole
    step is a prompt, so without the split the batch reads 1,028 tokens (every expert wanted); with it, 4, the
    five chunks kept apart as large steps (H200 phase run 37, b32 16K: the first plan priced at 14,304)."""
    tokens, decodes = (1028,) * 5 + (4,) * 3, (4,) * 8
    ctl = make_controller()
    ctl.sync_from(_window(tokens, None))
    assert ctl.demand.forecast().batch_tokens == pytest.approx(1028.0)
    ctl = make_controller()
    ctl.sync_from(_window(tokens, decodes))
    fc = ctl.demand.forecast()
    assert fc.batch_tokens == pytest.approx(4.0) and fc.large_step_share == pytest.approx(5 / 8)


def test_a_window_where_nothing_decodes_is_read_from_its_whole_steps() -> None:
    """A window of prompts alone (nothing decoding: a prefill-only load, or a run's first steps) has no running
    batch to read: its batch is its prompts, as an agent without the split reports it, and the controller plans
    at once. A decoding window after it brings the batch down to its decode tokens (the EWMA halves the gap)."""
    win = Windows(steps=4)
    ctl = make_controller()
    ctl.sync_from(_window((512,) * 4, (0,) * 4, win))
    assert ctl.demand.forecast().batch_tokens == pytest.approx(512.0)
    assert ctl.demand.forecast().large_step_share == 0.0 and ctl.step_next() is not None
    ctl.sync_from(_window((516, 4, 4, 4), (4, 4, 4, 4), win))
    assert ctl.demand.forecast().batch_tokens == pytest.approx((512 + 4) / 2)


def test_a_prompt_chunk_is_a_large_step_beside_the_decodes() -> None:
    """Two decoding windows, then one whose every step carries a 2,048-token chunk beside the 4 decodes: the
    batch stays at 4 and the chunks count as large steps (a share of the steps seen, at their own size). A
    chunk counts by its own tokens against the window's decodes: 40 beside 8 is large, 30 is not."""
    win = Windows(steps=4)
    ctl = make_controller()
    for _ in range(2):
        ctl.sync_from(_window((4,) * 4, (4,) * 4, win))
    ctl.sync_from(_window((2052,) * 4, (4,) * 4, win))
    fc = ctl.demand.forecast()
    assert fc.batch_tokens == pytest.approx(4.0) and 0.3 < fc.large_step_share < 0.4
    ctl = make_controller()
    ctl.sync_from(_window((48, 38, 8, 8), (8,) * 4, Windows(steps=4)))
    assert ctl.demand.forecast().large_step_share == pytest.approx(1 / 4)


def test_after_decodes_a_window_of_prompts_alone_leaves_the_batch_and_adds_large_steps() -> None:
    """Once the batch has come from decodes, a window where nothing decodes (a burst of arrivals) does not pull
    it toward its prompts: its steps are large ones against the batch in force."""
    win = Windows(steps=4)
    ctl = make_controller()
    ctl.sync_from(_window((4,) * 4, (4,) * 4, win))
    ctl.sync_from(_window((2048,) * 4, (0,) * 4, win))
    fc = ctl.demand.forecast()
    assert fc.batch_tokens == pytest.approx(4.0) and fc.large_step_share > 0.45


def test_telemetry_refuses_decode_tokens_that_do_not_match_the_steps() -> None:
    tel = _window((8, 4), (4, 4))
    raw = to_json(tel)
    for bad, where in (('"step_decode_tokens":[4,4]', '"step_decode_tokens":[4]'),
                       ('"step_decode_tokens":[4,4]', '"step_decode_tokens":[9,4]')):
        with pytest.raises(ProtocolError, match="step_decode_tokens"):
            parse(Telemetry, raw.replace(bad, where))
    v2 = tel.model_copy(update={"schema_version": 2})
    with pytest.raises(ProtocolError, match="step_decode_tokens: needs schema_version 3"):
        parse(Telemetry, to_json(v2))
    with pytest.raises(ProtocolError, match="chunked_steps: 9 exceeds the window's 2 steps"):
        parse(Telemetry, to_json(tel.model_copy(update={"chunked_steps": 9})))


def test_a_fills_prompts_are_not_read_as_more_prompts_at_a_larger_batch() -> None:
    """Prefills per step follow the sequences running in a steady stream, so a share running twice the batch
    runs twice the share of prompt steps; while the KV demand still rises (the fill) the prompts are arrivals,
    not turnover: a larger batch keeps the observed share, a smaller one still scales it down."""
    import dataclasses

    from tierplan.controller.demand import large_share_at, with_large_steps

    ctl = make_controller()
    ctl.sync_from(_window((1028, 4, 4, 4), (4,) * 4))
    filling = ctl.demand.forecast()  # one window: the KV demand has yet to settle
    steady = dataclasses.replace(filling, kv_rising=False)
    fc = filling
    assert filling.kv_rising and fc.large_step_share == pytest.approx(0.25)
    assert large_share_at(steady, 8.0) == pytest.approx(0.5) and large_share_at(filling, 8.0) == pytest.approx(0.25)
    assert large_share_at(steady, 2.0) == large_share_at(filling, 2.0) == pytest.approx(0.125)
    assert large_share_at(steady, 64.0) == 1.0
    a, b = np.asarray(with_large_steps(fc.misses_per_step, filling, 8.0)), np.asarray(
        with_large_steps(fc.misses_per_step, filling))
    assert a == pytest.approx(b)  # the curves' mix follows the same share


def test_while_the_batch_first_fills_it_is_read_at_the_newest_step() -> None:
    """A filling batch (sequences admitted one by one, the KV demand not settled yet) is read at the newest
    step's decoding sequences, not its window's median smoothed with the emptier windows before: every KV share's
    batch scales from it against the blocks in use at the window's end (H100 phase run 55, b256 1K 40 GiB: a
    share priced at 24.6 tokens a step ran ~118). Once the fill is over, smoothing goes on from there."""
    win = Windows(steps=8)
    ctl = make_controller()
    rising = (1, 1, 2, 2, 3, 3, 4, 4)
    ctl.sync_from(_window(rising, rising, win))
    fc = ctl.demand.forecast()
    assert fc.kv_first_fill and fc.batch_tokens == pytest.approx(4.0)  # the median: 2.5
    more = (5,) * 4 + (8,) * 4
    ctl.sync_from(_window(more, more, win))
    assert ctl.demand.forecast().batch_tokens == pytest.approx(8.0)  # smoothed medians: (4 + 6.5) / 2
    for _ in range(2):  # the demand (20 blocks a window) settles after four windows: the fill is over
        ctl.sync_from(_window((8,) * 8, (8,) * 8, win))
    assert not ctl.demand.forecast().kv_first_fill
    ctl.sync_from(_window((6,) * 8, (6,) * 8, win))
    assert ctl.demand.forecast().batch_tokens == pytest.approx(7.0)
