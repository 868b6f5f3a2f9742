"""What the routers share: path parameter types and the documented error responses (service process)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Path
from pydantic import BaseModel

from controller.validation import MAX_ID_CHARS


class ErrorBody(BaseModel):
    detail: str  # what went wrong, where, and what was expected


AgentIdPath = Annotated[str, Path(min_length=1, max_length=MAX_ID_CHARS, pattern=r"^\S+$")]
GroupPath = Annotated[str, Path(min_length=1, max_length=MAX_ID_CHARS, pattern=r"^\S+$")]


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for the given error status codes, all with an ErrorBody."""
    words = {400: "Malformed request", 401: "Missing or unknown token", 403: "Token lacks scope 'write'",
             404: "Not found", 409: "Conflict with the stored state", 413: "Request body too large",
             422: "Invalid body or parameters", 503: "Not ready"}
    return {c: {"model": ErrorBody, "description": words.get(c, "Error")} for c in codes}


WRITE_ERRORS = (400, 401, 403, 413, 422)
