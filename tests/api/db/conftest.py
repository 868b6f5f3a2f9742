"""Fixtures of the storage tests: a migrated database (SQLite and PostgreSQL) and a Repository on a fake clock."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import FakeClock
from tierplan.api.db.engine import make_engine
from tierplan.api.db.repo import Repository


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


@pytest.fixture
def repo(migrated_db_url: str, clock: FakeClock) -> Iterator[Repository]:
    engine = make_engine(migrated_db_url)
    yield Repository(engine, clock=clock, stale_after_s=60.0)
    engine.dispose()
