"""Agents and their telemetry windows, as SQL on one open transaction (the repository opens and closes it).

Run by the controller service process, inside `Repository` methods only. Functions here never commit, never
open connections and never return ORM objects: they read and write rows and hand back protocol messages.
Telemetry ingest is the service's hot path, so windows go in as one multi-row insert with the message JSON
made by pydantic's serializer, never row by row through the ORM.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, bindparam, delete, insert, select, tuple_, update

from tierplan.api.db.errors import Conflict, NotFound
from tierplan.api.db.models import AgentRow, TelemetryWindowRow
from tierplan.controller.protocol import Telemetry
from tierplan.controller.protocol_service import AgentRegistration, AgentState, AgentStatus

WINDOWS = TelemetryWindowRow.__table__
# All of a registration but its time: a re-registration that changes any of these (the compute prior included,
# which the controller is built from) is refused, never answered with the stored one as if it had been taken.
COMPARED_FIELDS = ("rank", "group", "engine", "shape", "hardware", "split", "compute")


def _differences(stored: AgentRegistration, new: AgentRegistration) -> list[str]:
    """Dotted paths (one level into shape/hardware/split) where `new` differs from `stored`."""
    old_d, new_d = stored.model_dump(mode="json"), new.model_dump(mode="json")
    paths = []
    for field in COMPARED_FIELDS:
        a, b = old_d[field], new_d[field]
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            paths += [f"{field}.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        else:
            paths.append(field)
    return paths


def _registration_json(reg: AgentRegistration) -> str:
    # Defaults left out: a default pydantic did not validate (HardwareSheet.name = "" is blank Text) would
    # otherwise be stored and then refused when read back; left out, it reads back as the same default.
    return reg.model_dump_json(exclude_defaults=True)


def register(conn: Connection, reg: AgentRegistration) -> tuple[AgentRegistration, bool]:
    stored_json = conn.execute(select(AgentRow.registration).where(AgentRow.agent_id == reg.agent_id)).scalar()
    if stored_json is not None:
        stored = AgentRegistration.model_validate_json(stored_json)
        diff = _differences(stored, reg)
        if diff:
            raise Conflict(f"agent {reg.agent_id!r} already registered with a different shape: {', '.join(diff)} "
                           f"differ from its registration at {stored.registered_s}; expected the same shape, "
                           "hardware, split and compute prior (or a new agent_id)")
        return stored, False
    conn.execute(insert(AgentRow).values(
        agent_id=reg.agent_id, rank=reg.rank, group=reg.group, engine=reg.engine, model=reg.shape.name,
        registered_s=reg.registered_s, last_seen_s=None, num_windows=0, issued_version=0, applied_version=0,
        registration=_registration_json(reg)))
    return reg, True


def get_registration(conn: Connection, agent_id: str) -> AgentRegistration | None:
    stored_json = conn.execute(select(AgentRow.registration).where(AgentRow.agent_id == agent_id)).scalar()
    return None if stored_json is None else AgentRegistration.model_validate_json(stored_json)


_STATUS_COLUMNS = (AgentRow.agent_id, AgentRow.rank, AgentRow.group.label("group"), AgentRow.engine, AgentRow.model,
                   AgentRow.registered_s, AgentRow.last_seen_s, AgentRow.num_windows, AgentRow.issued_version,
                   AgentRow.applied_version)


def _status(row: Any, now_s: float, stale_after_s: float) -> AgentStatus:
    if row.last_seen_s is None:
        state = AgentState.NEW
    elif now_s - row.last_seen_s <= stale_after_s:
        state = AgentState.ACTIVE
    else:
        state = AgentState.STALE
    return AgentStatus(agent_id=row.agent_id, rank=row.rank, group=row.group, engine=row.engine, model=row.model,
                       registered_s=row.registered_s, last_seen_s=row.last_seen_s, state=state,
                       windows=row.num_windows, issued_version=row.issued_version,
                       applied_version=row.applied_version)


def statuses(conn: Connection, now_s: float, stale_after_s: float, agent_id: str | None = None) -> list[AgentStatus]:
    query = select(*_STATUS_COLUMNS).order_by(AgentRow.agent_id)
    if agent_id is not None:
        query = query.where(AgentRow.agent_id == agent_id)
    return [_status(row, now_s, stale_after_s) for row in conn.execute(query)]


def _window_key(w: Telemetry) -> tuple[str, int, int]:
    return (w.agent_id, w.rank, w.window_seq)


def check_batch(conn: Connection, windows: Sequence[Telemetry]) -> None:
    """Refuse a batch that repeats a window or names an unregistered agent, before anything is written."""
    seen: dict[tuple[str, int, int], int] = {}
    for i, w in enumerate(windows):
        key = _window_key(w)
        if key in seen:
            raise Conflict(f"windows.{i}: agent {w.agent_id!r} rank {w.rank} window_seq {w.window_seq} repeats "
                           f"windows.{seen[key]} of the same batch; expected each window once")
        seen[key] = i
    names = {w.agent_id for w in windows}
    known = set(conn.execute(select(AgentRow.agent_id).where(AgentRow.agent_id.in_(names))).scalars())
    for i, w in enumerate(windows):
        if w.agent_id not in known:
            raise NotFound(f"windows.{i}: agent {w.agent_id!r} is not registered; expected POST /v1/agents first")


def add_windows(conn: Connection, windows: Sequence[Telemetry], now_s: float) -> None:
    check_batch(conn, windows)
    rows = [{"agent_id": w.agent_id, "rank": w.rank, "window_seq": w.window_seq, "window_end_s": w.window_end_s,
             "received_s": now_s, "applied_plan_version": w.applied_plan_version, "body": w.model_dump_json()}
            for w in windows]
    conn.execute(insert(WINDOWS), rows)
    per_agent = Counter(w.agent_id for w in windows)
    conn.execute(
        update(AgentRow.__table__)
        .where(AgentRow.__table__.c.agent_id == bindparam("b_agent_id"))
        .values(last_seen_s=now_s, num_windows=AgentRow.__table__.c.num_windows + bindparam("b_count")),
        # Agents in name order: two batches naming the same agents lock their rows in the same order.
        [{"b_agent_id": agent_id, "b_count": per_agent[agent_id]} for agent_id in sorted(per_agent)])


def describe_duplicate(conn: Connection, windows: Sequence[Telemetry]) -> str:
    """Which window of a refused batch was stored already (for the Conflict message)."""
    keys = [_window_key(w) for w in windows]
    cols = (WINDOWS.c.agent_id, WINDOWS.c.rank, WINDOWS.c.window_seq)
    stored = {tuple(r) for r in conn.execute(select(*cols).where(tuple_(*cols).in_(keys)))}
    for i, key in enumerate(keys):
        if key in stored:
            return (f"windows.{i}: agent {key[0]!r} rank {key[1]} window_seq {key[2]} is stored already; expected "
                    "each window once")
    return "a window of the batch was stored by another request at the same time; expected each window once"


def recent_windows(conn: Connection, agent_id: str, limit: int) -> list[Telemetry]:
    query = (select(WINDOWS.c.body).where(WINDOWS.c.agent_id == agent_id)
             .order_by(WINDOWS.c.id.desc()).limit(limit))
    bodies = list(conn.execute(query).scalars())
    return [Telemetry.model_validate_json(body) for body in reversed(bodies)]


def prune_windows(conn: Connection, older_than_s: float) -> int:
    return conn.execute(delete(WINDOWS).where(WINDOWS.c.received_s < older_than_s)).rowcount
