"""The framed unix-socket protocol between an engine's agent (`ServiceLink`) and its sidecar (both processes).

A frame is a 4-byte big-endian payload length, then the payload: UTF-8 JSON `{"type": T, "body": {...}}` with T
one of `FrameType` and the body that message (controller/protocol.py or controller/protocol_service.py,
`PlanRequest` included). A payload is at most `MAX_FRAME_BYTES`; the sender refuses a bigger message
(`FrameError`) before writing a byte, so the stream stays in step.

`FrameDecoder` turns received bytes into frames. A frame whose payload is not JSON, not the envelope, of an
unknown type or a body that does not validate becomes a `FrameError` for that frame alone: the length prefix
keeps the stream in step, so the next frame decodes. A length prefix over the limit (or zero) cannot be
skipped safely (garbage, or another protocol on the socket): that error is `fatal` and the decoder refuses
every later byte; the reader closes the connection. Neither side ever crashes on what the other sends.
Pure functions and one decoder class: no sockets opened here, no threads, no state at import.
"""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from tierplan.controller.protocol import Plan, PlanAck, ProtocolError, ProtocolModel, Telemetry, parse
from tierplan.controller.protocol_service import PlanRequest

MAX_FRAME_BYTES = 8 << 20
HEADER = struct.Struct(">I")


class FrameType(StrEnum):
    AGENT_REGISTRATION = "AgentRegistration"  # agent -> sidecar, first on every connection
    TELEMETRY = "Telemetry"  # agent -> sidecar, one window
    PLAN_ACK = "PlanAck"  # agent -> sidecar
    PLAN_REQUEST = "PlanRequest"  # agent -> sidecar: "send me the current plan if newer than this"
    PLAN = "Plan"  # sidecar -> agent


def _registration_type() -> type[ProtocolModel]:
    # Imported on first use: the engine side never decodes a registration, only sends one.
    from tierplan.controller.protocol_service import AgentRegistration

    return AgentRegistration


_BODY_TYPES: dict[FrameType, Any] = {FrameType.TELEMETRY: Telemetry, FrameType.PLAN_ACK: PlanAck,
                                     FrameType.PLAN_REQUEST: PlanRequest, FrameType.PLAN: Plan}


def body_type(kind: FrameType) -> type[ProtocolModel]:
    return _registration_type() if kind is FrameType.AGENT_REGISTRATION else _BODY_TYPES[kind]


class FrameError(ValueError):
    """A frame that cannot be sent or was received broken. `fatal`: the stream is out of step (close it)."""

    def __init__(self, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


@dataclass(frozen=True)
class Frame:
    type: FrameType
    body: Any  # the validated message of `type`
    num_bytes: int  # header + payload


def encode_frame(msg: ProtocolModel, max_frame_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """The frame for one message; FrameError (nothing written) for an unknown type or a payload over the limit."""
    name = type(msg).__name__
    try:
        kind = FrameType(name)
    except ValueError:
        raise FrameError(f"frame type {name!r} is not one of {[t.value for t in FrameType]}") from None
    payload = b'{"type":"' + kind.value.encode() + b'","body":' + msg.model_dump_json().encode() + b"}"
    if len(payload) > max_frame_bytes:
        raise FrameError(f"{name} frame of {len(payload)} bytes exceeds the {max_frame_bytes}-byte frame limit")
    return HEADER.pack(len(payload)) + payload


def decode_payload(payload: bytes) -> tuple[FrameType, Any]:
    """(type, validated body) of one payload, or FrameError saying what is wrong with it."""
    try:
        envelope = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FrameError(f"frame payload is not UTF-8 JSON: {exc}") from None
    if not isinstance(envelope, dict) or set(envelope) != {"type", "body"}:
        got = sorted(envelope) if isinstance(envelope, dict) else type(envelope).__name__
        raise FrameError(f"frame payload must be an object with exactly 'type' and 'body', got {got}")
    try:
        kind = FrameType(envelope["type"])
    except (ValueError, TypeError):
        raise FrameError(f"frame type {envelope['type']!r} is not one of {[t.value for t in FrameType]}") from None
    if not isinstance(envelope["body"], dict):
        raise FrameError(f"{kind.value} frame body must be an object, got {type(envelope['body']).__name__}")
    try:
        return kind, parse(body_type(kind), envelope["body"])
    except ProtocolError as exc:
        raise FrameError(f"{kind.value} frame: {exc}") from None


class FrameDecoder:
    """Incremental decoder for one connection: `feed(bytes)` -> the frames and frame errors completed so far."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()
        self.broken: FrameError | None = None  # set by a fatal error; every later feed returns it again

    def feed(self, data: bytes) -> list[Frame | FrameError]:
        if self.broken is not None:
            return [self.broken]
        self._buf += data
        out: list[Frame | FrameError] = []
        while len(self._buf) >= HEADER.size:
            (length,) = HEADER.unpack_from(self._buf)
            if length == 0 or length > self.max_frame_bytes:
                self.broken = FrameError(f"frame length {length} is outside 1..{self.max_frame_bytes} bytes: the "
                                         "stream is out of step (not this protocol?); closing it", fatal=True)
                self._buf.clear()
                out.append(self.broken)
                return out
            if len(self._buf) < HEADER.size + length:
                break
            payload = bytes(self._buf[HEADER.size:HEADER.size + length])
            del self._buf[:HEADER.size + length]
            try:
                kind, body = decode_payload(payload)
                out.append(Frame(kind, body, HEADER.size + length))
            except FrameError as exc:
                out.append(exc)
        return out

    @property
    def num_buffered_bytes(self) -> int:
        return len(self._buf)


def send_frame(sock: socket.socket, msg: ProtocolModel, max_frame_bytes: int = MAX_FRAME_BYTES) -> int:
    """Encode and write one frame whole (the socket's timeout applies); returns the bytes written."""
    data = encode_frame(msg, max_frame_bytes)
    sock.sendall(data)
    return len(data)
