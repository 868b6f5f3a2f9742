"""Records of the storage layer that are not protocol messages: API tokens and their scopes.

Used by the controller service process (its auth dependency reads `TokenRecord`s). The raw token is never
seen here: the service hashes it (sha256 hex) and the repository stores and looks up only the hash.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class Scope(StrEnum):
    READ = "read"
    WRITE = "write"  # implies read


class TokenRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    scope: Scope
    created_s: float = Field(ge=0)

    def allows(self, needed: Scope) -> bool:
        return self.scope is Scope.WRITE or needed is Scope.READ
