"""Field vocabulary and parsing shared by every protocol message (imported by `controller/protocol.py`).

Plain data validation: bounds, strict scalar types, the cross-field refusal helper, and `parse` / `to_json`
with precise 'field.path: message' errors. Like the protocol it must never import torch, runtime or agent,
touch the network or disk, or keep state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, Field, Strict, ValidationError
from pydantic_core import ErrorDetails, PydanticCustomError

# Bounds: generous for any real MoE model, small enough that a corrupt message cannot exhaust memory.
MAX_LAYERS = 1024
MAX_EXPERTS = 4096
MAX_PAIRS_PER_LAYER = 4096
MAX_ITEMS = 65_536  # reuse events per window, pinned experts, prefetch items, reuse scores
MAX_FALLBACK_NAMES = 256
MAX_ID_CHARS = 256
MAX_TEXT_CHARS = 4096
NUM_ERRORS_SHOWN = 5
_INVARIANT = "protocol_invariant"


def _check_id(value: str) -> str:
    if not value or any(ch.isspace() or not ch.isprintable() for ch in value):
        raise PydanticCustomError("bad_id", "must be non-empty and contain no whitespace or control characters")
    return value


def _check_text(value: str) -> str:
    if not value.strip():
        raise PydanticCustomError("blank_text", "must contain a non-whitespace character")
    return value


# Ints are strict: "3", 3.0 and True are refused rather than silently coerced.
MAX_INT = 2**63 - 1  # what every store (SQLite, PostgreSQL BIGINT) and Prometheus can hold exactly
Count = Annotated[int, Strict(), Field(ge=0, le=MAX_INT)]
Version = Annotated[int, Strict(), Field(ge=1, le=MAX_INT)]
LayerIndex = Annotated[int, Strict(), Field(ge=0, lt=MAX_LAYERS)]
ExpertIndex = Annotated[int, Strict(), Field(ge=0, lt=MAX_EXPERTS)]
NumLayers = Annotated[int, Strict(), Field(ge=1, le=MAX_LAYERS)]
NumExperts = Annotated[int, Strict(), Field(ge=1, le=MAX_EXPERTS)]
Seconds = Annotated[float, Field(ge=0)]
Millis = Annotated[float, Field(ge=0)]
Probability = Annotated[float, Field(ge=0, le=1)]
Id = Annotated[str, Field(max_length=MAX_ID_CHARS), AfterValidator(_check_id)]
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS), AfterValidator(_check_text)]


def _invalid(path: str, detail: str) -> PydanticCustomError:
    """A cross-field refusal; `path` is relative to the model raising it and joined onto pydantic's loc."""
    return PydanticCustomError(_INVARIANT, "{path}: {detail}", {"path": path, "detail": detail})


def refuse_repeats(field: str, keys: Sequence[Any], suffix: str = "") -> None:
    """Refuse the first key seen twice, naming both places: '<field>.<i><suffix>: <key> repeats ...'."""
    first_at: dict[Any, int] = {}
    for i, key in enumerate(keys):
        if key in first_at:
            raise _invalid(f"{field}.{i}{suffix}", f"{key} repeats {field}.{first_at[key]}{suffix}")
        first_at[key] = i


M = TypeVar("M", bound=BaseModel)


def _describe(error: ErrorDetails) -> str:
    """One pydantic error as 'field.path: message' (input values left out: they can be huge)."""
    loc, message = [str(part) for part in error["loc"]], error["msg"]
    if error["type"] == _INVARIANT:
        ctx = error.get("ctx", {})
        loc, message = [*loc, str(ctx["path"])], str(ctx["detail"])
    return f"{'.'.join(loc) or '(message)'}: {message}"


class ProtocolError(ValueError):
    """A message that failed to parse; `problems` holds every 'field.path: message', the text the first few."""

    def __init__(self, kind: str, problems: Sequence[str]) -> None:
        self.kind, self.problems = kind, tuple(problems)
        num_hidden = max(0, len(self.problems) - NUM_ERRORS_SHOWN)
        more = f"; (+{num_hidden} more)" if num_hidden else ""
        super().__init__(f"invalid {kind}: {'; '.join(self.problems[:NUM_ERRORS_SHOWN])}{more}")


def to_json(msg: BaseModel) -> str:
    return msg.model_dump_json()


def parse(kind: type[M], data: str | bytes | Mapping[str, Any]) -> M:
    """`data` (JSON text or an already-decoded mapping) as a `kind`, or ProtocolError saying what is wrong."""
    if not isinstance(data, str | bytes | Mapping):
        raise ProtocolError(kind.__name__, [f"(message): expected JSON text or a mapping, got {type(data).__name__}"])
    try:
        if isinstance(data, str | bytes):
            return kind.model_validate_json(data)
        return kind.model_validate(dict(data))
    except ValidationError as exc:
        # `from None`: the pydantic chain adds only noise to logs; `problems` keeps every error.
        raise ProtocolError(kind.__name__, [_describe(e) for e in exc.errors()]) from None
