"""`Repository`: everything the controller service stores and reads, one transaction per method.

Run by the controller service process (its routes call it from FastAPI's threadpool, its planner thread from
its own thread; the engine's connection pool makes that safe). Takes and returns the pydantic messages of
controller/protocol.py and controller/protocol_service.py; no ORM object or connection ever leaves it. It
never plans, validates plans or hashes tokens (the service does); it refuses what contradicts the stored
state with the errors of api/db/errors.py, and a database that does not answer with `Unavailable`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import IntegrityError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from tierplan.api.db import agents_sql, plans_sql, policies_sql
from tierplan.api.db.engine import WRITE_OPTION, describe_failure
from tierplan.api.db.errors import Conflict, InvalidQuery, PlanConflict, Unavailable
from tierplan.api.db.records import Scope, TokenRecord
from tierplan.controller.protocol import Plan, PlanAck, Telemetry
from tierplan.controller.protocol_service import (
    AgentRegistration,
    AgentStatus,
    DecisionRecord,
    PlanRecord,
    PolicyRecord,
    PolicyUpdate,
)

__all__ = ["Repository", "Scope", "TokenRecord"]

MAX_LIMIT = 10_000  # rows one read may return


def _check_limit(limit: int, what: str = "limit") -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise InvalidQuery(f"{what} {limit!r} is out of range; expected an integer from 1 to {MAX_LIMIT}")
    return limit


class Repository:
    """The service's storage. `clock` stamps received/issued/acked times (service time, seconds);
    `stale_after_s` is how long after its last telemetry an agent still counts as active."""

    def __init__(self, engine: Engine, clock: Callable[[], float] = time.time, stale_after_s: float = 60.0) -> None:
        self._engine = engine
        self._clock = clock
        self._stale_after_s = stale_after_s

    @property
    def engine(self) -> Engine:
        return self._engine

    @contextmanager
    def _tx(self, write: bool = False) -> Iterator[Connection]:
        """One transaction; a write takes SQLite's write lock at BEGIN (see api.db.engine)."""
        try:
            with self._engine.connect() as conn:
                if write:
                    conn.execution_options(**{WRITE_OPTION: True})
                with conn.begin():
                    yield conn
        except (OperationalError, InterfaceError, PoolTimeout) as exc:  # PoolTimeout: every connection busy
            raise Unavailable(describe_failure(exc, self._engine.url)) from exc

    def ping(self) -> None:
        """Raises `Unavailable` unless the database answers a query."""
        with self._tx() as conn:
            conn.execute(text("SELECT 1"))

    # ---- agents ----
    def register_agent(self, reg: AgentRegistration) -> tuple[AgentRegistration, bool]:
        """(the stored registration, created). An identical re-registration returns the first one."""
        try:
            with self._tx(write=True) as conn:
                return agents_sql.register(conn, reg)
        except IntegrityError:  # another request registered it between our read and insert: compare with it
            with self._tx(write=True) as conn:
                return agents_sql.register(conn, reg)

    def get_registration(self, agent_id: str) -> AgentRegistration | None:
        with self._tx() as conn:
            return agents_sql.get_registration(conn, agent_id)

    def list_agents(self) -> list[AgentStatus]:
        with self._tx() as conn:
            return agents_sql.statuses(conn, self._clock(), self._stale_after_s)

    def agent_status(self, agent_id: str) -> AgentStatus | None:
        with self._tx() as conn:
            found = agents_sql.statuses(conn, self._clock(), self._stale_after_s, agent_id)
        return found[0] if found else None

    # ---- telemetry ----
    def add_windows(self, windows: Sequence[Telemetry]) -> None:
        """Store a batch whole or not at all: one multi-row insert; updates each agent's last_seen_s and window
        count. A repeated (agent_id, rank, window_seq) is a `Conflict`, an unregistered agent `NotFound`."""
        if not windows:
            return
        try:
            with self._tx(write=True) as conn:
                agents_sql.add_windows(conn, windows, self._clock())
        except IntegrityError:
            with self._tx() as conn:
                raise Conflict(agents_sql.describe_duplicate(conn, windows)) from None

    def recent_windows(self, agent_id: str, limit: int) -> list[Telemetry]:
        """The agent's newest `limit` stored windows, oldest first (in the order the service received them)."""
        with self._tx() as conn:
            return agents_sql.recent_windows(conn, agent_id, _check_limit(limit))

    def prune_windows(self, older_than_s: float) -> int:
        """Delete windows received before `older_than_s` (service clock); returns how many."""
        with self._tx(write=True) as conn:
            return agents_sql.prune_windows(conn, older_than_s)

    # ---- plans ----
    def insert_plan(self, agent_id: str, plan: Plan) -> None:
        """Store `plan` as the agent's newest, only if its version is exactly one above the newest stored one
        (else `PlanConflict(current)`); the previous unacked plan becomes SUPERSEDED."""
        try:
            with self._tx(write=True) as conn:
                plans_sql.insert_plan(conn, agent_id, plan, self._clock())
        except IntegrityError:  # the unique (agent_id, version) caught what the compare-and-set should have
            raise self._plan_conflict(agent_id, plan.version) from None

    def _plan_conflict(self, agent_id: str, attempted: int) -> PlanConflict:
        return PlanConflict(agent_id, attempted, self.newest_version(agent_id))

    def current_plan(self, agent_id: str) -> PlanRecord | None:
        with self._tx() as conn:
            return plans_sql.current_plan(conn, agent_id)

    def plan_history(self, agent_id: str, limit: int = 50, before_version: int | None = None) -> list[PlanRecord]:
        """Newest first; with `before_version`, only versions below it (the next page)."""
        with self._tx() as conn:
            return plans_sql.plan_history(conn, agent_id, _check_limit(limit), before_version)

    def newest_version(self, agent_id: str) -> int:
        """The newest stored plan version (0: none, or the agent is not registered)."""
        with self._tx() as conn:
            return plans_sql.issued_version(conn, agent_id) or 0

    def record_ack(self, ack: PlanAck) -> PlanRecord:
        """Mark the acked plan APPLIED or REJECTED; unknown plan `NotFound`, a second ack `Conflict`."""
        with self._tx(write=True) as conn:
            return plans_sql.record_ack(conn, ack, self._clock())

    # ---- decisions ----
    def add_decision(self, rec: DecisionRecord) -> DecisionRecord:
        """Store a decision (its `id` is ignored) and return it with the id the database gave it."""
        with self._tx(write=True) as conn:
            return plans_sql.add_decision(conn, rec)

    def set_measured(self, agent_id: str, version: int, measured_step_ms: float) -> int:
        """Record the measured step time of every decision that chose or kept `version`; returns how many."""
        if not (isinstance(measured_step_ms, int | float) and math.isfinite(measured_step_ms)
                and measured_step_ms >= 0):
            raise InvalidQuery(f"measured_step_ms {measured_step_ms!r} must be a finite number >= 0")
        with self._tx(write=True) as conn:
            return plans_sql.set_measured(conn, agent_id, version, float(measured_step_ms))

    def decisions(self, agent_id: str | None = None, since_s: float | None = None, until_s: float | None = None,
                  limit: int = 100) -> list[DecisionRecord]:
        """Newest first; `since_s <= created_s <= until_s` where given."""
        with self._tx() as conn:
            return plans_sql.decisions(conn, agent_id, since_s, until_s, _check_limit(limit))

    # ---- policies ----
    def get_policy(self, group: str) -> PolicyRecord:
        with self._tx() as conn:
            return policies_sql.get_policy(conn, group)

    def list_policies(self) -> list[PolicyRecord]:
        """The current policy of every group with a stored policy or a registered agent."""
        with self._tx() as conn:
            return policies_sql.list_policies(conn)

    def put_policy(self, group: str, update: PolicyUpdate, author: str) -> PolicyRecord:
        """Store the group's next version. With `update.expected_version`, only if the group is at it (else
        `PolicyConflict(current)`); without, the change lands on whatever version is current."""
        with self._tx(write=True) as conn:
            return policies_sql.put_policy(conn, group, update, author, self._clock())

    def policy_history(self, group: str, limit: int = 50) -> list[PolicyRecord]:
        """Stored versions newest first (empty for a group never set: its version 0 is the defaults)."""
        with self._tx() as conn:
            return policies_sql.policy_history(conn, group, _check_limit(limit))

    # ---- tokens ----
    def add_token(self, name: str, scope: Scope, token_hash: str) -> None:
        """Store a token by its sha256 hex (the raw token never reaches the database)."""
        if not name or len(name) > 128 or any(ch.isspace() for ch in name):
            raise InvalidQuery(f"token name {name!r} must be 1 to 128 characters without whitespace")
        if len(token_hash) != 64 or any(ch not in "0123456789abcdef" for ch in token_hash):
            raise InvalidQuery("token_hash must be the 64-character lowercase sha256 hex of the token")
        try:
            with self._tx(write=True) as conn:
                policies_sql.add_token(conn, name, Scope(scope), token_hash, self._clock())
        except IntegrityError:
            raise Conflict(f"token {name!r}: a token with the same hash is stored already") from None

    def token_by_hash(self, token_hash: str) -> TokenRecord | None:
        with self._tx() as conn:
            return policies_sql.token_by_hash(conn, token_hash)
