"""The controller service's tables (SQLAlchemy 2 typed declarative). Messages are stored whole as JSON text
(`body`, written and read by pydantic, the one source of truth for their shape) next to the scalar columns the
queries filter, order and join on.

Imported by the controller service process (through `api.db.repo`) and by the Alembic migrations' autogenerate
check. Schema changes go through a new migration in api/db/migrations/versions (never `create_all` in the
service). No ORM object ever leaves api/db: the repository converts rows to protocol messages.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Float, ForeignKey, Index, Integer, MetaData, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from tierplan.controller.validation import MAX_ID_CHARS

ID_CHARS = MAX_ID_CHARS  # every id column holds any id the protocol accepts
ENUM_CHARS = 16

# Constraint names are fixed by convention so migrations (and SQLite batch mode) can name what they drop.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

RowId = BigInteger().with_variant(Integer, "sqlite")  # SQLite autoincrements only INTEGER PRIMARY KEY


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class AgentRow(Base):
    __tablename__ = "agents"

    agent_id: Mapped[str] = mapped_column(String(ID_CHARS), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer)
    group: Mapped[str] = mapped_column("agent_group", String(ID_CHARS), index=True)
    engine: Mapped[str] = mapped_column(String(ID_CHARS))
    model: Mapped[str] = mapped_column(String(ID_CHARS))
    registered_s: Mapped[float] = mapped_column(Float)
    last_seen_s: Mapped[float | None] = mapped_column(Float)
    num_windows: Mapped[int] = mapped_column(BigInteger, default=0)
    # The newest plan version stored for the agent: `insert_plan` advances it by compare-and-set, which is what
    # makes two service processes unable to both issue version N (the unique (agent_id, version) backs it up).
    issued_version: Mapped[int] = mapped_column(Integer, default=0)
    applied_version: Mapped[int] = mapped_column(Integer, default=0)
    registration: Mapped[str] = mapped_column(Text)  # AgentRegistration JSON


class TelemetryWindowRow(Base):
    __tablename__ = "telemetry_windows"
    __table_args__ = (
        UniqueConstraint("agent_id", "rank", "window_seq", name="uq_telemetry_windows_agent_rank_seq"),
        Index("ix_telemetry_windows_agent_id_id", "agent_id", "id"),
    )

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    agent_id: Mapped[str] = mapped_column(String(ID_CHARS), ForeignKey("agents.agent_id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    window_seq: Mapped[int] = mapped_column(BigInteger)
    window_end_s: Mapped[float] = mapped_column(Float, index=True)  # the agent's clock
    received_s: Mapped[float] = mapped_column(Float, index=True)  # the service's clock: retention prunes by it
    applied_plan_version: Mapped[int] = mapped_column(Integer)
    body: Mapped[str] = mapped_column(Text)  # Telemetry JSON


class PlanRow(Base):
    __tablename__ = "plans"
    __table_args__ = (UniqueConstraint("agent_id", "version", name="uq_plans_agent_version"),)

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    agent_id: Mapped[str] = mapped_column(String(ID_CHARS), ForeignKey("agents.agent_id", ondelete="CASCADE"))
    version: Mapped[int] = mapped_column(Integer)
    plan_id: Mapped[str] = mapped_column(String(ID_CHARS))
    base_version: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(ENUM_CHARS), index=True)  # PlanState value
    issued_s: Mapped[float] = mapped_column(Float)
    body: Mapped[str] = mapped_column(Text)  # Plan JSON
    acked_s: Mapped[float | None] = mapped_column(Float)
    ack: Mapped[str | None] = mapped_column(Text)  # PlanAck JSON


class DecisionRow(Base):
    __tablename__ = "decisions"
    __table_args__ = (
        Index("ix_decisions_agent_id_created_s", "agent_id", "created_s"),
        Index("ix_decisions_agent_id_version", "agent_id", "version"),
    )

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    agent_id: Mapped[str] = mapped_column(String(ID_CHARS), ForeignKey("agents.agent_id", ondelete="CASCADE"))
    version: Mapped[int] = mapped_column(Integer)
    outcome: Mapped[str] = mapped_column(String(ENUM_CHARS))  # DecisionOutcome value
    created_s: Mapped[float] = mapped_column(Float, index=True)
    measured_step_ms: Mapped[float | None] = mapped_column(Float)
    body: Mapped[str] = mapped_column(Text)  # DecisionRecord JSON (its id and measured_step_ms live in columns)


class PolicyRow(Base):
    """The current version of each group's knobs (the pointer `put_policy` moves by compare-and-set)."""

    __tablename__ = "policies"

    group: Mapped[str] = mapped_column("policy_group", String(ID_CHARS), primary_key=True)
    version: Mapped[int] = mapped_column(Integer)


class PolicyVersionRow(Base):
    """Every version of every group's knobs, with who changed them and why (the policy history)."""

    __tablename__ = "policy_versions"
    __table_args__ = (UniqueConstraint("policy_group", "version", name="uq_policy_versions_group_version"),)

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    group: Mapped[str] = mapped_column("policy_group", String(ID_CHARS))
    version: Mapped[int] = mapped_column(Integer)
    author: Mapped[str] = mapped_column(String(ID_CHARS))
    why: Mapped[str] = mapped_column(Text)
    created_s: Mapped[float] = mapped_column(Float)
    knobs: Mapped[str] = mapped_column(Text)  # PolicyKnobs JSON


class ApiTokenRow(Base):
    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(ID_CHARS), index=True)
    scope: Mapped[str] = mapped_column(String(ENUM_CHARS))  # Scope value
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the raw token
    created_s: Mapped[float] = mapped_column(Float)
