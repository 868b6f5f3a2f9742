"""What the storage layer refuses, as exceptions the controller service maps to HTTP statuses.

Raised inside the controller service process (and `tierplan db`); the messages say what, where and what was
expected, since the service passes them on to its clients. Plain classes: nothing here touches a database.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base of every storage refusal."""


class NotFound(StoreError):
    """The agent, plan or record named does not exist (HTTP 404)."""


class Conflict(StoreError):
    """The write contradicts what is stored (HTTP 409): a different re-registration, a repeated window, a
    second ack."""


class PlanConflict(Conflict):
    """`insert_plan` lost: the plan's version is not one above the newest stored one (another service process
    issued it first, or the caller's state is stale). `current_version` is the newest stored version."""

    def __init__(self, agent_id: str, attempted_version: int, current_version: int) -> None:
        self.agent_id = agent_id
        self.attempted_version = attempted_version
        self.current_version = current_version
        super().__init__(f"plan version {attempted_version} for agent {agent_id!r} refused: the newest stored version "
                         f"is {current_version}, expected version {current_version + 1}")


class PolicyConflict(Conflict):
    """`put_policy` with an `expected_version` the group is no longer at; `current_version` is where it is."""

    def __init__(self, group: str, expected_version: int, current_version: int) -> None:
        self.group = group
        self.expected_version = expected_version
        self.current_version = current_version
        super().__init__(f"policy group {group!r} is at version {current_version}, not the expected_version "
                         f"{expected_version}; reload it and apply the change again")


class InvalidDatabaseURL(StoreError):
    """The database URL cannot be used: unparsable, or a scheme other than sqlite / postgresql."""


class Unavailable(StoreError):
    """The database did not answer (unreachable host, refused login, locked file) (HTTP 503)."""


class InvalidQuery(StoreError):
    """A read or write argument out of range (a limit, a negative measurement) (HTTP 422)."""
