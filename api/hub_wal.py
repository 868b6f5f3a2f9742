"""SQLite's WAL checkpoints moved off the request path, onto the hub's planner thread (service process).

By default SQLite checkpoints inside whichever commit grows the write-ahead log past 1,000 pages: with
telemetry arriving at ~200 KB a batch, every ~20th ingest POST paid for copying 4 MB into the database
(the periodic spikes of the ingest p99). `defer_checkpoints(engine)` turns that off on every connection of
a file database and returns the checkpoint the planner runs after each pass instead (PASSIVE: it never
waits for, nor blocks, a writer or reader, so the log stays bounded without holding up a request). For
PostgreSQL and in-memory SQLite it returns None. It stores nothing and never touches the schema.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, event


def defer_checkpoints(engine: Engine) -> Callable[[], None] | None:
    """Disable auto-checkpoints of a file SQLite `engine`; the returned callable checkpoints (PASSIVE)."""
    if engine.dialect.name != "sqlite" or engine.url.database in (None, "", ":memory:"):
        return None

    @event.listens_for(engine, "connect")
    def _no_auto_checkpoint(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA wal_autocheckpoint = 0")
        cur.close()

    def checkpoint() -> None:
        raw = engine.raw_connection()  # autocommit (the engine's connect hook): no transaction around the pragma
        try:
            cur = raw.cursor()
            cur.execute("PRAGMA wal_checkpoint(PASSIVE)")
            cur.close()
        finally:
            raw.close()

    return checkpoint
