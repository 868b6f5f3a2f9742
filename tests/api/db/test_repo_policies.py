"""Repository, policies and tokens: version 0 is the defaults, each change is a new version with who and why,
an expected_version the group is not at is refused naming where it is; tokens are looked up by hash."""

from __future__ import annotations

import hashlib

import pytest

from tests.api.db.builders import registration
from tests.conftest import FakeClock
from tierplan.api.db.errors import Conflict, InvalidQuery, PolicyConflict
from tierplan.api.db.repo import Repository, Scope
from tierplan.controller.protocol_service import PolicyKnobs, PolicyUpdate


def test_a_group_never_set_reads_as_the_defaults(repo: Repository) -> None:
    rec = repo.get_policy("default")
    assert (rec.version, rec.knobs, rec.group) == (0, PolicyKnobs(), "default")
    assert repo.policy_history("default") == []


def test_each_change_is_a_version_with_who_and_why(repo: Repository, clock: FakeClock) -> None:
    first = repo.put_policy("fleet", PolicyUpdate(knobs=PolicyKnobs(hysteresis=0.2), why="calmer"), "alice")
    clock.now_s = 1005.0
    second = repo.put_policy("fleet", PolicyUpdate(knobs=PolicyKnobs(kv_weight=2.0), why="kv matters",
                                                   expected_version=1), "bob")
    assert (first.version, first.author, first.why, first.created_s) == (1, "alice", "calmer", 1000.0)
    assert (second.version, second.knobs.kv_weight, second.created_s) == (2, 2.0, 1005.0)
    assert repo.get_policy("fleet") == second
    assert repo.policy_history("fleet") == [second, first]
    assert repo.policy_history("fleet", limit=1) == [second]
    assert repo.get_policy("default").version == 0  # other groups untouched


@pytest.mark.parametrize("expected", [0, 2, 5])
def test_an_expected_version_the_group_is_not_at_is_refused(repo: Repository, expected: int) -> None:
    repo.put_policy("fleet", PolicyUpdate(knobs=PolicyKnobs(), why="one"), "alice")
    with pytest.raises(PolicyConflict, match="is at version 1, not the expected_version") as err:
        repo.put_policy("fleet", PolicyUpdate(knobs=PolicyKnobs(top_m=8), why="two", expected_version=expected),
                        "bob")
    assert err.value.current_version == 1
    assert repo.get_policy("fleet").knobs == PolicyKnobs()


def test_first_write_may_expect_version_zero(repo: Repository) -> None:
    rec = repo.put_policy("new", PolicyUpdate(knobs=PolicyKnobs(), why="init", expected_version=0), "alice")
    assert rec.version == 1


def test_list_policies_covers_groups_with_agents(repo: Repository) -> None:
    repo.register_agent(registration("a", group="gpu-pool"))
    repo.put_policy("fleet", PolicyUpdate(knobs=PolicyKnobs(top_m=2), why="w"), "alice")
    listed = repo.list_policies()
    assert [(p.group, p.version) for p in listed] == [("fleet", 1), ("gpu-pool", 0)]


def _hash(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def test_tokens_by_hash(repo: Repository) -> None:
    repo.add_token("ci", Scope.WRITE, _hash("secret-1"))
    repo.add_token("grafana", Scope.READ, _hash("secret-2"))
    got = repo.token_by_hash(_hash("secret-1"))
    assert got is not None and (got.name, got.scope, got.created_s) == ("ci", Scope.WRITE, 1000.0)
    assert got.allows(Scope.WRITE)
    reader = repo.token_by_hash(_hash("secret-2"))
    assert reader is not None and reader.allows(Scope.READ) and not reader.allows(Scope.WRITE)
    assert repo.token_by_hash(_hash("unknown")) is None
    with pytest.raises(Conflict, match="same hash"):
        repo.add_token("again", Scope.READ, _hash("secret-1"))


@pytest.mark.parametrize(("name", "token_hash", "match"), [
    ("", "a" * 64, "token name"), ("has space", "a" * 64, "token name"),
    ("ok", "abc", "sha256 hex"), ("ok", "A" * 64, "sha256 hex")])
def test_bad_token_input_is_refused(repo: Repository, name: str, token_hash: str, match: str) -> None:
    with pytest.raises(InvalidQuery, match=match):
        repo.add_token(name, Scope.READ, token_hash)


def test_concurrent_writers_without_expected_version_all_land(repo: Repository) -> None:
    """Four threads change one group at once, none naming a version: each change becomes its own version
    (a lost compare-and-set is retried), none overwrites another."""
    from tests.conftest import start_thread

    def write(who: str) -> None:
        for i in range(5):
            repo.put_policy("fleet", PolicyUpdate(knobs=PolicyKnobs(top_m=1 + i), why=f"{who} {i}"), who)

    started = [start_thread(lambda w=f"w{n}": write(w)) for n in range(4)]
    for thread, _ in started:
        thread.join(timeout=120)
    assert [e for _, errs in started for e in errs] == []
    history = repo.policy_history("fleet", limit=100)
    assert [p.version for p in history] == list(range(20, 0, -1))
    assert sorted(p.why for p in history) == sorted(f"w{n} {i}" for n in range(4) for i in range(5))
