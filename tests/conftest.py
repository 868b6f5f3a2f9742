"""Shared test fixtures: a seeded random-byte factory, the CPU device twin, fake clocks, and databases (SQLite
and a throwaway PostgreSQL, see api/db/throwaway_pg.py) for the service's storage tests."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tierplan.runtime.device import Device

if not torch.cuda.is_available():
    # Without a GPU, Triton kernels run in Triton's interpreter; it reads this when a kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _few_attention_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a GPU, Triton's interpreter runs every program in Python: fewer context splits per (sequence,
    head) keep the paged-attention tests fast (still several splits, so the reduce is exercised)."""
    if not torch.cuda.is_available():
        import tierplan.runtime.engine.kernels.paged_attention as pa

        monkeypatch.setattr(pa, "TARGET_PROGRAMS", 8)


@pytest.fixture
def rand() -> Callable[[int], torch.Tensor]:
    """`rand(n)` -> n random uint8 bytes from a per-test seeded generator (never zeros: stale reads show)."""
    gen = torch.Generator().manual_seed(1234)

    def make(n: int) -> torch.Tensor:
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)  # [N]

    return make


@pytest.fixture
def cpu() -> Device:
    return Device("cpu")


class FakeClock:
    """A clock the test moves by hand (`now_s`); pass it as `clock=` wherever a component reads time."""

    def __init__(self, now_s: float = 0.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def host_copy(device: Device, data: torch.Tensor) -> torch.Tensor:
    """`data` copied into fresh page-aligned host memory (what O_DIRECT needs)."""
    buf = device.alloc_host(data.numel()).tensor  # [N]
    buf.copy_(data)
    return buf


def wait_until(pred: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition") -> None:
    """Poll `pred` until true; fail (never hang) after `timeout_s`. Used for ordering, not for timing."""
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        time.sleep(0.001)


def start_thread(target: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    """Run `target` in a daemon thread; exceptions land in the returned list instead of vanishing."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, errors


# ---- databases for the service's storage tests (api/db/throwaway_pg.py starts a throwaway PostgreSQL) ----
@pytest.fixture(scope="session")
def pg_admin_url() -> Iterator[str]:
    """URL of a PostgreSQL server for this session: `TIERPLAN_TEST_PG_URL`, else a throwaway cluster."""
    from tierplan.api.db import throwaway_pg as pg

    given = os.environ.get(pg.ENV_URL)
    if given:
        yield given
        return
    if pg.find_bindir() is None:
        pytest.skip("PostgreSQL binaries not found (no /usr/lib/postgresql/*/bin/initdb, no initdb on PATH); "
                    f"install postgresql (.ci/system-deps.sh does) or set {pg.ENV_URL}")
    cluster = pg.start_cluster()
    assert cluster is not None
    try:
        yield cluster.url()
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def pg_url(pg_admin_url: str) -> Iterator[str]:
    """An empty database on the session's PostgreSQL server, shared by the session (migrate it yourself)."""
    from tierplan.api.db import throwaway_pg as pg

    url = pg.create_database(pg_admin_url, "session")
    yield url
    pg.drop_database(url)


@pytest.fixture
def fresh_pg_url(pg_admin_url: str) -> Iterator[str]:
    """A new empty PostgreSQL database for one test, dropped after it."""
    from tierplan.api.db import throwaway_pg as pg

    url = pg.create_database(pg_admin_url)
    yield url
    pg.drop_database(url)


@pytest.fixture(scope="session")
def _pg_migrated_template(pg_admin_url: str) -> Iterator[str]:
    """Name of a database migrated to head once per session; `migrated_db_url` copies it (faster than migrating)."""
    from sqlalchemy.engine import make_url

    from tierplan.api.db import migrate
    from tierplan.api.db import throwaway_pg as pg

    url = pg.create_database(pg_admin_url, "template")
    migrate.upgrade(url)  # disposes its engine: a template must have no open connections when copied
    yield str(make_url(url).database)
    pg.drop_database(url)


@pytest.fixture(scope="session")
def _sqlite_migrated_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tierplan.api.db import migrate

    path = tmp_path_factory.mktemp("sqlite-template") / "tierplan.db"
    migrate.upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture(params=["sqlite", "postgresql"])
def migrated_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A new database at the newest migration for one test, once on SQLite (a file) and once on PostgreSQL."""
    if request.param == "sqlite":
        import shutil

        path = tmp_path / "tierplan.db"
        shutil.copyfile(request.getfixturevalue("_sqlite_migrated_template"), path)
        yield f"sqlite:///{path}"
        return
    from tierplan.api.db import throwaway_pg as pg

    url = pg.create_database(request.getfixturevalue("pg_admin_url"),
                             template=request.getfixturevalue("_pg_migrated_template"))
    yield url
    pg.drop_database(url)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A new empty database for one test, once on SQLite (a file) and once on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'tierplan.db'}"
    return request.getfixturevalue("fresh_pg_url")
