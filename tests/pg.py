"""A throwaway PostgreSQL server for the tests: initdb + pg_ctl in a temporary folder, on a free loopback port.

Run by the pytest process (session fixtures in tests/conftest.py), as root (CI, this machine: the server runs
as the `postgres` user through runuser, since PostgreSQL refuses to run as root) or as a normal user (runs as
that user). It starts in a few seconds (no fsync, no instructions) and is stopped and deleted at session end
(and at interpreter exit if the session dies first). It never touches a system cluster, /var/lib/postgresql
or any server it did not start; `TIERPLAN_TEST_PG_URL` names an existing server to use instead.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

ENV_URL = "TIERPLAN_TEST_PG_URL"
SUPERUSER = "tierplan"
START_ATTEMPTS = 3  # a free port can be taken by someone else between our probe and the server's bind
RUN_AS_CANDIDATES = ("postgres", "nobody")  # when we are root: who owns and runs the cluster


def find_bindir() -> Path | None:
    """The newest /usr/lib/postgresql/<N>/bin with initdb, else the folder of `initdb` on PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parent.parent.name)
                   if Path(p).parent.parent.name.isdigit() else 0)
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("initdb")
    return Path(on_path).parent if on_path else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgCluster:
    """One running server; `url(dbname)` names a database on it, `create_database()` makes a fresh one."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="tierplan-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = 0
        self._run_as: str | None = None
        if os.geteuid() == 0:
            self._run_as = next((u for u in RUN_AS_CANDIDATES if _has_user(u)), None)
            if self._run_as is None:
                raise RuntimeError(f"running as root, and none of the users {RUN_AS_CANDIDATES} exists to run "
                                   "PostgreSQL as (it refuses to run as root)")
            pw = pwd.getpwnam(self._run_as)
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        self._stopped = False
        atexit.register(self.stop)

    def _cmd(self, tool: str, *args: str) -> list[str]:
        cmd = [str(self.bindir / tool), *args]
        return ["runuser", "-u", self._run_as, "--", *cmd] if self._run_as else cmd

    def _check(self, cmd: list[str], what: str) -> None:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{what} failed (exit {done.returncode}): {done.stderr.strip() or done.stdout.strip()}"
                               + self._log_tail())

    def _log_tail(self) -> str:
        try:
            return "\nserver log:\n" + "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
        except OSError:
            return ""

    def start(self) -> PgCluster:
        self._check(self._cmd("initdb", "-D", str(self.data), "-U", SUPERUSER, "-A", "trust", "-E", "UTF8",
                              "--no-sync", "--no-instructions", "--locale=C"), "initdb")
        for attempt in range(START_ATTEMPTS):
            self.port = _free_port()
            options = (f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.root} "
                       "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=100")
            done = subprocess.run(self._cmd("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60",
                                            "-o", options, "start"), capture_output=True, text=True, timeout=90)
            if done.returncode == 0:
                return self
            if attempt == START_ATTEMPTS - 1:
                raise RuntimeError(f"pg_ctl start failed (exit {done.returncode}): {done.stderr.strip()}"
                                   + self._log_tail())
        return self

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql+psycopg://{SUPERUSER}@127.0.0.1:{self.port}/{dbname}"

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.port and (self.data / "postmaster.pid").exists():
            subprocess.run(self._cmd("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop"),
                           capture_output=True, timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def create_database(admin_url: str, prefix: str = "t", template: str | None = None) -> str:
    """A new database on the server of `admin_url` (empty, or a copy of the database `template`); its URL."""
    import psycopg
    from sqlalchemy.engine import make_url

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = make_url(admin_url)
    with psycopg.connect(_libpq(admin), autocommit=True) as conn:
        sql = f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else "")
        # PostgreSQL 15's default WAL_LOG copy takes ~0.4 s even for an empty database; FILE_COPY ~0.05 s.
        if int(conn.execute("SHOW server_version_num").fetchone()[0]) >= 150000:
            sql += " STRATEGY FILE_COPY"
        conn.execute(sql)
    return admin.set(database=name).render_as_string(hide_password=False)


def drop_database(url: str) -> None:
    import psycopg
    from sqlalchemy.engine import make_url

    target = make_url(url)
    with contextlib.suppress(psycopg.Error), psycopg.connect(_libpq(target.set(database="postgres")),
                                                             autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{target.database}" WITH (FORCE)')


def _libpq(url: object) -> str:
    """A SQLAlchemy URL as a libpq connection string (psycopg.connect takes those)."""
    parts = {"host": url.host, "port": url.port, "user": url.username, "password": url.password,
             "dbname": url.database, **url.query}
    return " ".join(f"{k}={v}" for k, v in parts.items() if v is not None)


def start_cluster() -> PgCluster | None:
    """A started cluster, or None if this machine has no PostgreSQL binaries."""
    bindir = find_bindir()
    return None if bindir is None else PgCluster(bindir).start()
