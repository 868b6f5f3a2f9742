"""Storage of the controller service: SQLAlchemy 2 tables, the `Repository` the service's routes call, Alembic
migrations. Run by the controller service process (and by `tierplan db ...`); never by the agent or the sidecar,
and it never plans or decides anything: it stores what the service hands it and answers queries.
"""
