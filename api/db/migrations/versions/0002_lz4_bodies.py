"""PostgreSQL: message bodies (telemetry, plans, decisions) compressed with lz4 instead of pglz.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 09:26:00

A 48-layer, 128-expert telemetry window is ~55 KB of JSON; PostgreSQL compresses such values when it stores
them, and with its default pglz that compression was most of the cost of ingest (about 3x slower than lz4,
measured with tests/api/db/ingest_rate.py). Only on servers built with lz4 (PostgreSQL >= 14 lists it in
default_toast_compression's values); elsewhere, and on SQLite, this revision changes nothing. Existing rows
keep their compression; new rows get lz4.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BODIES = (("telemetry_windows", "body"), ("plans", "body"), ("plans", "ack"), ("decisions", "body"))


def _has_lz4() -> bool:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return False
    values = bind.execute(sa.text("SELECT enumvals FROM pg_settings WHERE name = 'default_toast_compression'"))
    found = values.scalar()
    return found is not None and "lz4" in found


def _set(method: str) -> None:
    if _has_lz4():
        for table, column in BODIES:
            op.execute(f"ALTER TABLE {table} ALTER COLUMN {column} SET COMPRESSION {method}")


def upgrade() -> None:
    _set("lz4")


def downgrade() -> None:
    _set("pglz")
