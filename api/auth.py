"""Bearer tokens for the controller service: made once, shown once, stored only as their SHA-256 (service process).

`new_token()` makes a raw token (printed once by `tierplan token create`, or given as `TIERPLAN_TOKEN`);
`hash_token` is what the database keeps and looks tokens up by. `TokenAuth.principal(header)` resolves an
`Authorization: Bearer <token>` value to who it is and what it may do, with a short cache so a telemetry
POST does not cost a database round trip. Write endpoints need scope `write` (no or unknown token: 401, a
read-only token: 403). It never logs or stores a raw token.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import HTTPException, status

from tierplan.api.db.repo import Repository, Scope

TOKEN_PREFIX = "tp_"
CACHE_S = 5.0  # a revoked or new token takes effect within this


@dataclass(frozen=True)
class Principal:
    name: str
    scope: Scope

    def can_write(self) -> bool:
        return self.scope is Scope.WRITE


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(raw: str) -> str:
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()


def unauthorized(detail: str) -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED, detail=detail, headers={"WWW-Authenticate": "Bearer"})


class TokenAuth:
    """See the module docstring."""

    def __init__(self, repo: Repository, clock: Callable[[], float]) -> None:
        self.repo, self.clock = repo, clock
        self._cache: dict[str, tuple[Principal | None, float]] = {}
        self._lock = threading.Lock()

    def lookup(self, raw: str) -> Principal | None:
        digest, now = hash_token(raw), self.clock()
        with self._lock:
            hit = self._cache.get(digest)
        if hit is not None and hit[1] > now:
            return hit[0]
        rec = self.repo.token_by_hash(digest)
        who = Principal(rec.name, Scope(rec.scope)) if rec is not None else None
        with self._lock:
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[digest] = (who, now + CACHE_S)
        return who

    def principal(self, authorization: str | None) -> Principal:
        """Who sends `authorization`; 401 (HTTPException) when it is missing, malformed or unknown."""
        if not authorization:
            raise unauthorized("missing Authorization header: expected 'Bearer <token>'")
        scheme, _, raw = authorization.partition(" ")
        if scheme.lower() != "bearer" or not raw.strip():
            raise unauthorized("Authorization header: expected 'Bearer <token>'")
        who = self.lookup(raw.strip())
        if who is None:
            raise unauthorized("unknown token")
        return who

    def writer(self, authorization: str | None) -> Principal:
        """As `principal`, and 403 when the token is read-only."""
        who = self.principal(authorization)
        if not who.can_write():
            raise HTTPException(status.HTTP_403_FORBIDDEN, detail=f"token {who.name!r} has scope 'read'; this "
                                                                  "endpoint needs scope 'write'")
        return who

    def bootstrap(self, raw: str, name: str = "bootstrap") -> None:
        """Store `raw` (hashed) as a write token unless it is there already (every start with TIERPLAN_TOKEN)."""
        if self.repo.token_by_hash(hash_token(raw)) is None:
            self.repo.add_token(name, Scope.WRITE, hash_token(raw))
