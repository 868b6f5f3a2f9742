"""agent/sidecar_ipc.py: every frame type round-trips, whole or fed a byte at a time; a broken frame is an
error for that frame alone (the next one decodes); a length out of range is fatal and stays so; a message
over the limit is refused before a byte is written."""

from __future__ import annotations

import json

import pytest

from tests.agent.sidecar.helpers import ack, plan, registration, telemetry
from tierplan.agent.sidecar_ipc import (
    HEADER,
    MAX_FRAME_BYTES,
    Frame,
    FrameDecoder,
    FrameError,
    FrameType,
    PlanRequest,
    encode_frame,
)
from tierplan.controller.protocol import LayerSlots

# The last: a window naming the split in force per layer (its rows decode from JSON as the service's would).
MESSAGES = [registration(), telemetry(3), ack(2), PlanRequest(agent_id="a", since_version=4), plan(5),
            telemetry(4, applied=1).model_copy(update={"expert_slots": (LayerSlots(layer=0, slots=3),
                                                                         LayerSlots(layer=1, slots=4))})]


def raw(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_each_type_round_trips(msg: object) -> None:
    data = encode_frame(msg)  # type: ignore[arg-type]
    [frame] = FrameDecoder().feed(data)
    assert isinstance(frame, Frame) and frame.type is FrameType(type(msg).__name__)
    assert frame.body == msg and frame.num_bytes == len(data)


def test_frames_split_anywhere_decode_the_same() -> None:
    stream = b"".join(encode_frame(m) for m in MESSAGES)  # type: ignore[arg-type]
    dec = FrameDecoder()
    got = [f for i in range(len(stream)) for f in dec.feed(stream[i:i + 1])]
    assert [f.body for f in got] == MESSAGES and dec.num_buffered_bytes == 0


@pytest.mark.parametrize("payload,says", [
    (b"\xff\xfe not utf-8", "not UTF-8 JSON"),
    (b"{not json", "not UTF-8 JSON"),
    (b"[1, 2]", "exactly 'type' and 'body'"),
    (json.dumps({"type": "Telemetry"}).encode(), "exactly 'type' and 'body'"),
    (json.dumps({"type": "Hello", "body": {}}).encode(), "'Hello' is not one of"),
    (json.dumps({"type": ["Plan"], "body": {}}).encode(), "is not one of"),
    (json.dumps({"type": "Plan", "body": [1]}).encode(), "body must be an object"),
    (json.dumps({"type": "Telemetry", "body": {"agent_id": "x"}}).encode(), "Telemetry frame: invalid Telemetry"),
    (json.dumps({"type": "PlanAck", "body": {**ack(1).model_dump(mode="json"), "extra": 1}}).encode(), "extra"),
])
def test_a_bad_payload_is_one_error_and_the_next_frame_decodes(payload: bytes, says: str) -> None:
    dec = FrameDecoder()
    bad, good = dec.feed(raw(payload) + encode_frame(plan(2)))
    assert isinstance(bad, FrameError) and not bad.fatal and says in str(bad)
    assert isinstance(good, Frame) and good.body == plan(2)


@pytest.mark.parametrize("length", [0, MAX_FRAME_BYTES + 1, 0xFFFFFFFF])
def test_a_length_out_of_range_is_fatal_and_stays_fatal(length: int) -> None:
    dec = FrameDecoder()
    out = dec.feed(encode_frame(plan(1)) + HEADER.pack(length) + b"x" * 10)
    assert isinstance(out[0], Frame)
    assert isinstance(out[1], FrameError) and out[1].fatal and "out of step" in str(out[1])
    [again] = dec.feed(encode_frame(plan(2)))  # nothing after garbage is trusted
    assert again is dec.broken


def test_http_on_the_socket_is_refused_not_waited_for() -> None:
    """Another protocol's bytes read as an absurd length: fatal at once, not a wait for 1.2 GB."""
    [err] = FrameDecoder().feed(b"GET /v1/agents HTTP/1.1\r\n\r\n")
    assert isinstance(err, FrameError) and err.fatal


def test_a_message_over_the_limit_is_refused_before_sending() -> None:
    big = plan(1)
    with pytest.raises(FrameError, match="exceeds the 100-byte frame limit"):
        encode_frame(big, max_frame_bytes=100)


def test_a_message_of_another_type_is_not_a_frame() -> None:
    from tierplan.controller.protocol import Forecast

    fc = Forecast(model="m", num_layers=1, num_experts=2, horizon_steps=1, created_s=0.0, layers=())
    with pytest.raises(FrameError, match="'Forecast' is not one of"):
        encode_frame(fc)
