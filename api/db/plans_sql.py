"""Plans, their acks and the decisions behind them, as SQL on one open transaction (the repository's).

Run by the controller service process, inside `Repository` methods only; never commits, never opens
connections, never returns ORM objects. `insert_plan` is the one place plan versions advance: a
compare-and-set on the agent's `issued_version` inside the inserting transaction, so two service processes
racing on one database can never both store version N (PostgreSQL's row lock / SQLite's write lock order
them; the loser's UPDATE matches no row). The unique (agent_id, version) constraint backs it up.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, insert, select, update

from tierplan.api.db.errors import Conflict, NotFound, PlanConflict
from tierplan.api.db.models import AgentRow, DecisionRow, PlanRow
from tierplan.controller.protocol import AckStatus, Plan, PlanAck
from tierplan.controller.protocol_service import DecisionRecord, PlanRecord, PlanState

PLANS = PlanRow.__table__


def issued_version(conn: Connection, agent_id: str) -> int | None:
    """The newest stored plan version of the agent (0: none yet); None if the agent is not registered."""
    return conn.execute(select(AgentRow.issued_version).where(AgentRow.agent_id == agent_id)).scalar()


def insert_plan(conn: Connection, agent_id: str, plan: Plan, now_s: float) -> None:
    moved = conn.execute(
        update(AgentRow).where(AgentRow.agent_id == agent_id, AgentRow.issued_version == plan.version - 1)
        .values(issued_version=plan.version))
    if moved.rowcount != 1:
        current = issued_version(conn, agent_id)
        if current is None:
            raise NotFound(f"agent {agent_id!r} is not registered; a plan needs a registered agent")
        raise PlanConflict(agent_id, plan.version, current)
    conn.execute(update(PlanRow).where(PlanRow.agent_id == agent_id, PlanRow.state == PlanState.ISSUED.value)
                 .values(state=PlanState.SUPERSEDED.value))
    conn.execute(insert(PLANS).values(agent_id=agent_id, version=plan.version, plan_id=plan.plan_id,
                                      base_version=plan.base_version, state=PlanState.ISSUED.value, issued_s=now_s,
                                      body=plan.model_dump_json(), acked_s=None, ack=None))


def _record(row: Any) -> PlanRecord:
    return PlanRecord(plan=Plan.model_validate_json(row.body), issued_s=row.issued_s, state=PlanState(row.state),
                      ack=None if row.ack is None else PlanAck.model_validate_json(row.ack))


_RECORD_COLUMNS = (PLANS.c.id, PLANS.c.plan_id, PLANS.c.body, PLANS.c.issued_s, PLANS.c.state, PLANS.c.ack)


def current_plan(conn: Connection, agent_id: str) -> PlanRecord | None:
    row = conn.execute(select(*_RECORD_COLUMNS).where(PLANS.c.agent_id == agent_id)
                       .order_by(PLANS.c.version.desc()).limit(1)).first()
    return None if row is None else _record(row)


def plan_history(conn: Connection, agent_id: str, limit: int, before_version: int | None) -> list[PlanRecord]:
    query = select(*_RECORD_COLUMNS).where(PLANS.c.agent_id == agent_id)
    if before_version is not None:
        query = query.where(PLANS.c.version < before_version)
    return [_record(row) for row in conn.execute(query.order_by(PLANS.c.version.desc()).limit(limit))]


def record_ack(conn: Connection, ack: PlanAck, now_s: float) -> PlanRecord:
    where = (PLANS.c.agent_id == ack.agent_id, PLANS.c.version == ack.version)
    # Lock the agent's row before its plan's, in the order insert_plan takes them: two service processes, one
    # issuing the next plan and one recording an ack, must not each hold the lock the other waits for.
    # (FOR NO KEY UPDATE, the lock insert_plan's UPDATE takes, so window inserts' foreign-key locks still pass.)
    lock_agent = select(AgentRow.agent_id).where(AgentRow.agent_id == ack.agent_id).with_for_update(key_share=True)
    conn.execute(lock_agent)
    row = conn.execute(select(*_RECORD_COLUMNS).where(*where)).first()
    if row is None:
        raise NotFound(f"agent {ack.agent_id!r} has no plan version {ack.version}; expected an ack for a plan the "
                       "service issued")
    if row.plan_id != ack.plan_id:
        raise Conflict(f"plan_id {ack.plan_id!r} is not plan version {ack.version} of agent {ack.agent_id!r} "
                       f"(that is {row.plan_id!r})")
    state = PlanState.APPLIED if ack.status is AckStatus.APPLIED else PlanState.REJECTED
    done = conn.execute(update(PLANS).where(PLANS.c.id == row.id, PLANS.c.ack.is_(None))
                        .values(ack=ack.model_dump_json(), acked_s=now_s, state=state.value))
    if done.rowcount != 1:
        first = conn.execute(select(PLANS.c.state).where(PLANS.c.id == row.id)).scalar()
        raise Conflict(f"plan version {ack.version} of agent {ack.agent_id!r} was acked already ({first}); "
                       "expected one ack per plan")
    if state is PlanState.APPLIED:
        conn.execute(update(AgentRow).where(AgentRow.agent_id == ack.agent_id,
                                            AgentRow.applied_version < ack.version)
                     .values(applied_version=ack.version))
    return PlanRecord(plan=Plan.model_validate_json(row.body), issued_s=row.issued_s, state=state, ack=ack)


# ---- decisions ----
def add_decision(conn: Connection, rec: DecisionRecord) -> DecisionRecord:
    if issued_version(conn, rec.agent_id) is None:
        raise NotFound(f"agent {rec.agent_id!r} is not registered; a decision needs a registered agent")
    result = conn.execute(insert(DecisionRow.__table__).values(
        agent_id=rec.agent_id, version=rec.version, outcome=rec.outcome.value, created_s=rec.created_s,
        measured_step_ms=rec.measured_step_ms, body=rec.model_dump_json()))
    (new_id,) = result.inserted_primary_key
    return rec.model_copy(update={"id": int(new_id)})


def set_measured(conn: Connection, agent_id: str, version: int, measured_step_ms: float) -> int:
    table = DecisionRow.__table__
    return conn.execute(update(table).where(table.c.agent_id == agent_id, table.c.version == version)
                        .values(measured_step_ms=measured_step_ms)).rowcount


def decisions(conn: Connection, agent_id: str | None, since_s: float | None, until_s: float | None,
              limit: int) -> list[DecisionRecord]:
    table = DecisionRow.__table__
    query = select(table.c.id, table.c.body, table.c.measured_step_ms)
    if agent_id is not None:
        query = query.where(table.c.agent_id == agent_id)
    if since_s is not None:
        query = query.where(table.c.created_s >= since_s)
    if until_s is not None:
        query = query.where(table.c.created_s <= until_s)
    query = query.order_by(table.c.created_s.desc(), table.c.id.desc()).limit(limit)
    return [DecisionRecord.model_validate_json(row.body).model_copy(
        update={"id": row.id, "measured_step_ms": row.measured_step_ms}) for row in conn.execute(query)]
