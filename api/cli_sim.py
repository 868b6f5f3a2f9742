"""`tierplan sim`: the trace-driven simulator over the cost model.

Runs in the user's shell. Heavy modules are imported inside the command.
"""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this module's command(s) to `app` (called from api.cli.main)."""
