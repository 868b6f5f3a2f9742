"""The vLLM KV connector's settings: `kv_transfer_config.kv_connector_extra_config`, checked (vLLM scheduler and
worker processes).

Every key is known by name; an unknown key or a bad value is refused with what, where and what was expected, before
the connector holds anything. `cpu_blocks`/`nvme_blocks` are both the tiers' capacity (memory and file reserved
at start) and the limits used until a plan sets its own (a plan asking more than the capacity is held at it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, model_validator

WHERE = "kv_transfer_config.kv_connector_extra_config"
BlockCount = Annotated[StrictInt, Field(ge=0, le=1 << 24)]


class ConnectorSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    cpu_blocks: BlockCount = 256  # KV blocks on the (pinned) CPU tier
    nvme_blocks: BlockCount = 0  # KV blocks in the NVMe file
    nvme_dir: str | None = None  # folder of the NVMe file (one file per worker, removed at shutdown)
    direct_io: StrictBool = True  # O_DIRECT on the file; a filesystem refusing it is reported, never hidden

    @model_validator(mode="after")
    def _nvme_needs_dir(self) -> ConnectorSettings:
        if self.nvme_blocks and not self.nvme_dir:
            raise ValueError(f"nvme_blocks={self.nvme_blocks} needs nvme_dir (the folder of the NVMe tier's file)")
        return self

    @staticmethod
    def parse(extra: Any) -> ConnectorSettings:
        """The settings in `extra` (vLLM's dict); ValueError naming the key otherwise."""
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise ValueError(f"{WHERE}: expected a dict, got {type(extra).__name__}")
        known = sorted(ConnectorSettings.model_fields)
        unknown = sorted(str(k) for k in extra if k not in ConnectorSettings.model_fields)
        if unknown:
            raise ValueError(f"{WHERE}: unknown key(s) {', '.join(map(repr, unknown))} for TierplanConnector; "
                             f"known keys: {', '.join(known)}")
        try:
            return ConnectorSettings(**extra)
        except ValidationError as exc:
            parts = []
            for err in exc.errors():
                loc = ".".join(str(p) for p in err["loc"])
                got = f" (got {err['input']!r})" if loc else ""
                msg = err["msg"].removeprefix("Value error, ")
                parts.append(f"{loc}: {msg}{got}" if loc else msg)
            raise ValueError(f"{WHERE} for TierplanConnector: " + "; ".join(parts)) from None

    def nvme_file(self, engine_id: str, rank: int) -> Path | None:
        """This worker's NVMe file (None without an NVMe tier)."""
        if not self.nvme_blocks or self.nvme_dir is None:
            return None
        return Path(self.nvme_dir) / f"tierplan-kv-{engine_id}-rank{rank}-pid{os.getpid()}.tpnvme"


def check_failure_policy(policy: Any) -> None:
    """vLLM's `kv_transfer_config.kv_load_failure_policy` must be "recompute": a block of ours that fails to load
    (a checksum mismatch, an I/O error) is then computed again; vLLM's default "fail" would fail the request."""
    if policy != "recompute":
        raise ValueError(f"kv_transfer_config.kv_load_failure_policy is {policy!r}; TierplanConnector needs "
                         "'recompute' (a block that fails to load is computed again instead of failing the request): "
                         'add "kv_load_failure_policy": "recompute" to kv_transfer_config')
