"""`tierplan eval predictors`: expert-cache policies replayed on a routing trace.

Runs in the user's shell. Heavy modules are imported inside the command.
"""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this module's command(s) to `app` (called from api.cli.main)."""
