"""SQLAlchemy engines for the controller service's database: SQLite (the default, WAL) or PostgreSQL (psycopg 3).

Run by the controller service process and `tierplan db`. `make_engine` only checks and prepares: it never
connects (the first query does, and `describe_failure` turns a refused connection into one readable line).
It must never create tables (migrations do) nor accept a database it cannot drive correctly.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, SQLAlchemyError
from sqlalchemy.pool import QueuePool

from tierplan.api.db.errors import InvalidDatabaseURL

SQLITE_BUSY_TIMEOUT_MS = 10_000  # a writer waits this long for another process's write lock before failing
PG_CONNECT_TIMEOUT_S = 5  # an unreachable host fails within this, not after the OS's minutes-long TCP timeout
SQLITE_DRIVERS = ("sqlite", "sqlite+pysqlite")
PG_DRIVERS = ("postgresql", "postgresql+psycopg")
MEMORY_POOL_WAIT_S = 300  # `sqlite://`: how long a thread waits for the one connection
WRITE_OPTION = "tierplan_write"  # execution option: this transaction writes (SQLite takes the write lock first)


def parse_url(url: str) -> URL:
    """The URL as SQLAlchemy's `URL`, with `postgresql://` meaning psycopg 3; refuses what we cannot drive."""
    if not isinstance(url, str) or not url.strip():
        raise InvalidDatabaseURL("database URL is empty; expected sqlite:///PATH, sqlite:// (in memory) or "
                                 "postgresql+psycopg://USER@HOST/DBNAME")
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise InvalidDatabaseURL(f"database URL {url!r} cannot be parsed; expected sqlite:///PATH, sqlite:// "
                                 "(in memory) or postgresql+psycopg://USER@HOST/DBNAME") from None
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.drivername not in SQLITE_DRIVERS + PG_DRIVERS:
        raise InvalidDatabaseURL(f"database URL scheme {parsed.drivername!r} is not supported; expected sqlite "
                                 "or postgresql (driver psycopg: postgresql+psycopg://...)")
    if parsed.drivername in SQLITE_DRIVERS and parsed.host:
        raise InvalidDatabaseURL(f"sqlite URL {url!r} names a host ({parsed.host!r}); expected sqlite:///relative"
                                 "/path, sqlite:////absolute/path or sqlite:// (in memory)")
    return parsed


def is_sqlite(url: URL | Engine) -> bool:
    return (url.url if isinstance(url, Engine) else url).get_backend_name() == "sqlite"


def make_engine(url: str) -> Engine:
    """An engine for `url`. SQLite: WAL journal, busy timeout, foreign keys on, and write transactions that take
    the write lock when they begin (BEGIN IMMEDIATE), so two processes never deadlock upgrading a read lock;
    `sqlite://` is one in-memory database in one connection, used by one thread at a time. PostgreSQL:
    psycopg 3, pre-ping, connect timeout."""
    parsed = parse_url(url)
    if is_sqlite(parsed):
        return _sqlite_engine(parsed)
    connect_args: dict[str, Any] = {"connect_timeout": PG_CONNECT_TIMEOUT_S}
    return create_engine(parsed, pool_pre_ping=True, connect_args=connect_args)


def _sqlite_engine(parsed: URL) -> Engine:
    in_memory = parsed.database in (None, "", ":memory:")
    if in_memory:
        # The database lives in its one connection, which every thread shares: a pool of exactly one makes a
        # second thread wait for the first to hand it back (a StaticPool would let their transactions mix).
        engine = create_engine(parsed, poolclass=QueuePool, pool_size=1, max_overflow=0,
                               pool_timeout=MEMORY_POOL_WAIT_S, connect_args={"check_same_thread": False})
    else:
        engine = create_engine(parsed, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # pysqlite's own transaction handling begins lazily and never for DDL; we begin explicitly instead.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA foreign_keys = ON")
        if not in_memory:
            cur.execute("PRAGMA journal_mode = WAL")
            cur.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL: durable across process crashes
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        write = conn.get_execution_options().get(WRITE_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


def describe_failure(exc: SQLAlchemyError, url: URL | str) -> str:
    """One line naming the database (password hidden) and the driver's own reason, for `error: ...`."""
    shown = (url if isinstance(url, URL) else make_url(url)).render_as_string(hide_password=True)
    orig = exc.orig if isinstance(exc, DBAPIError) else exc
    reason = " ".join(str(orig).split()) or type(orig).__name__
    return f"database {shown} is not reachable: {reason}"
