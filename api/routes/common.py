"""What the routers share: path parameter types and the documented error responses (service process)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Path, Query
from pydantic import AfterValidator, BaseModel

from tierplan.controller.validation import MAX_ID_CHARS, _check_id


class ErrorBody(BaseModel):
    detail: str  # what went wrong, where, and what was expected


# The protocol's own id check (non-empty, no whitespace by str.isspace, which a regex \S does not match).
AgentIdPath = Annotated[str, Path(min_length=1, max_length=MAX_ID_CHARS), AfterValidator(_check_id)]
GroupPath = Annotated[str, Path(min_length=1, max_length=MAX_ID_CHARS), AfterValidator(_check_id)]
AgentIdQuery = Annotated[str | None, Query(min_length=1, max_length=MAX_ID_CHARS),
                         AfterValidator(lambda v: None if v is None else _check_id(v))]


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for the given error status codes, all with an ErrorBody."""
    words = {400: "Malformed request", 401: "Missing or unknown token", 403: "Token lacks scope 'write'",
             404: "Not found", 409: "Conflict with the stored state", 413: "Request body too large",
             422: "Invalid body or parameters", 503: "Not ready"}
    return {c: {"model": ErrorBody, "description": words.get(c, "Error")} for c in codes}


WRITE_ERRORS = (400, 401, 403, 413, 422)
