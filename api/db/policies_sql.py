"""Policy knobs per agent group (versioned, each change with who and why) and API tokens, as SQL on one open
transaction (the repository's).

Run by the controller service process, inside `Repository` methods only; never commits, never opens
connections, never returns ORM objects, never sees a raw token (only its sha256 hex). A group never set
reads as version 0, the built-in `PolicyKnobs()` defaults; `put_policy` advances the version in one
UPDATE under the row's lock, so concurrent writers never both create version N.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from tierplan.api.db.errors import Conflict, PolicyConflict
from tierplan.api.db.models import AgentRow, ApiTokenRow, PolicyRow, PolicyVersionRow
from tierplan.api.db.records import Scope, TokenRecord
from tierplan.controller.protocol_service import PolicyKnobs, PolicyRecord, PolicyUpdate

DEFAULT_AUTHOR = "defaults"
DEFAULT_WHY = "built-in defaults (never changed)"


def default_policy(group: str) -> PolicyRecord:
    return PolicyRecord(group=group, version=0, knobs=PolicyKnobs(), author=DEFAULT_AUTHOR, why=DEFAULT_WHY,
                        created_s=0.0)


_VERSION_COLUMNS = (PolicyVersionRow.group.label("group"), PolicyVersionRow.version, PolicyVersionRow.knobs,
                    PolicyVersionRow.author, PolicyVersionRow.why, PolicyVersionRow.created_s)


def _record(row: Any) -> PolicyRecord:
    return PolicyRecord(group=row.group, version=row.version, knobs=PolicyKnobs.model_validate_json(row.knobs),
                        author=row.author, why=row.why, created_s=row.created_s)


def _current_rows(conn: Connection, group: str | None = None) -> list[PolicyRecord]:
    query = select(*_VERSION_COLUMNS).join(
        PolicyRow, (PolicyRow.group == PolicyVersionRow.group) & (PolicyRow.version == PolicyVersionRow.version))
    if group is not None:
        query = query.where(PolicyRow.group == group)
    return [_record(row) for row in conn.execute(query.order_by(PolicyRow.group))]


def get_policy(conn: Connection, group: str) -> PolicyRecord:
    rows = _current_rows(conn, group)
    return rows[0] if rows else default_policy(group)


def list_policies(conn: Connection) -> list[PolicyRecord]:
    """The current policy of every group that has one stored or a registered agent in it, by group name."""
    stored = {rec.group: rec for rec in _current_rows(conn)}
    agent_groups = set(conn.execute(select(AgentRow.group).distinct()).scalars())
    return [stored.get(g) or default_policy(g) for g in sorted(set(stored) | agent_groups)]


def _ensure_row(conn: Connection, group: str) -> None:
    """The group's pointer row exists (version 0 until its first version is stored in this transaction)."""
    dialect_insert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
    conn.execute(dialect_insert(PolicyRow).values(group=group, version=0).on_conflict_do_nothing())


def put_policy(conn: Connection, group: str, change: PolicyUpdate, author: str, now_s: float) -> PolicyRecord:
    _ensure_row(conn, group)
    # One UPDATE moves the version: the row lock (PostgreSQL) or the write lock (SQLite) orders writers, so
    # each change lands on the version the one before it made, and a named expected_version is compared there.
    bump = update(PolicyRow).where(PolicyRow.group == group)
    if change.expected_version is not None:
        bump = bump.where(PolicyRow.version == change.expected_version)
    new_version = conn.execute(bump.values(version=PolicyRow.version + 1).returning(PolicyRow.version)).scalar()
    if new_version is None:
        raise PolicyConflict(group, change.expected_version or 0, current_version(conn, group))
    record = PolicyRecord(group=group, version=new_version, knobs=change.knobs, author=author, why=change.why,
                          created_s=now_s)
    conn.execute(insert(PolicyVersionRow).values(group=group, version=new_version, author=author,
                                                 why=change.why, created_s=now_s,
                                                 knobs=change.knobs.model_dump_json()))
    return record


def current_version(conn: Connection, group: str) -> int:
    return conn.execute(select(PolicyRow.version).where(PolicyRow.group == group)).scalar() or 0


def policy_history(conn: Connection, group: str, limit: int) -> list[PolicyRecord]:
    """Stored versions, newest first (a group never set has none: its version 0 is `default_policy`)."""
    query = (select(*_VERSION_COLUMNS).where(PolicyVersionRow.group == group)
             .order_by(PolicyVersionRow.version.desc()).limit(limit))
    return [_record(row) for row in conn.execute(query)]


# ---- API tokens ----
def add_token(conn: Connection, name: str, scope: Scope, token_hash: str, now_s: float) -> None:
    if conn.execute(select(ApiTokenRow.id).where(ApiTokenRow.token_hash == token_hash)).first() is not None:
        raise Conflict(f"token {name!r}: a token with the same hash is stored already; expected a new random token")
    conn.execute(insert(ApiTokenRow).values(name=name, scope=scope.value, token_hash=token_hash, created_s=now_s))


def token_by_hash(conn: Connection, token_hash: str) -> TokenRecord | None:
    row = conn.execute(select(ApiTokenRow.name, ApiTokenRow.scope, ApiTokenRow.created_s)
                       .where(ApiTokenRow.token_hash == token_hash)).first()
    return None if row is None else TokenRecord(name=row.name, scope=Scope(row.scope), created_s=row.created_s)
