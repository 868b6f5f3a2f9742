"""The controller service's settings (pydantic), built in `main` from CLI flags and `TIERPLAN_*` variables.

Read by `create_app` and `tierplan serve` in the service process; nothing reads the environment at import.
`Settings.from_env(environ, **flags)` takes the flags given on the command line over the environment over
the defaults, and refuses an unknown or malformed value by name (pydantic's error names the field).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr

ENV_PREFIX = "TIERPLAN_"
MIB = 1 << 20


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    db_url: str = Field(default="sqlite:///./tierplan.db", min_length=1)
    host: str = "127.0.0.1"
    port: int = Field(default=8321, ge=0, le=65535)
    max_body_bytes: int = Field(default=4 * MIB, ge=1024)
    read_needs_token: bool = False
    bootstrap_token: SecretStr | None = None  # hashed into the DB as the write token "bootstrap" on start
    stale_after_s: float = Field(default=60.0, gt=0)
    retention_s: float = Field(default=86400.0, gt=0)  # telemetry windows older than this are pruned
    plan_interval_s: float = Field(default=0.2, gt=0)  # the planner thread's poll period
    migrate_on_start: bool = True
    log_level: str = "info"

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **flags: Any) -> Settings:
        """Flags (None: not given) over `TIERPLAN_<FIELD>` over the defaults; `TIERPLAN_TOKEN` is the bootstrap
        token. ValidationError names the field of a bad value."""
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            key = ENV_PREFIX + ("TOKEN" if name == "bootstrap_token" else name.upper())
            if key in environ:
                values[name] = environ[key]
        values.update({k: v for k, v in flags.items() if v is not None})
        return cls.model_validate(values)
