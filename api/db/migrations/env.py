"""Alembic's environment for the controller service's database (run by `api.db.migrate`, i.e. by the service
on start and by `tierplan db`). It migrates through the connection `api.db.migrate` hands it in
`config.attributes["connection"]`; it never builds an engine from alembic.ini (there is none) nor runs
offline SQL. SQLite gets batch mode, since SQLite cannot ALTER most of a table in place.
"""

from __future__ import annotations

from alembic import context

from tierplan.api.db.models import Base


def run_migrations() -> None:
    connection = context.config.attributes.get("connection")
    if connection is None:
        raise RuntimeError("api/db/migrations runs only through api.db.migrate (it passes the connection)")
    context.configure(connection=connection, target_metadata=Base.metadata,
                      render_as_batch=connection.dialect.name == "sqlite", compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


run_migrations()
