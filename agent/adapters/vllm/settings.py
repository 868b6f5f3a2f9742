"""The vLLM plugin's settings, from `TIERPLAN_VLLM_*` environment variables (every vLLM process reads them).

Built once per process by the plugin's `register()` (never at import). Every `TIERPLAN_VLLM_*` variable must
name a field below: an unknown name or a malformed value is refused with a `SettingsError` that names the
variable and says what was expected, so a typo never silently runs the defaults. It must never read any other
configuration source nor touch the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tierplan.controller.protocol import Id

ENV_PREFIX = "TIERPLAN_VLLM_"
MESSAGE_PREFIX = "tierplan vLLM plugin: "


class SettingsError(ValueError):
    """A `TIERPLAN_VLLM_*` variable is unknown or malformed: the message is one line that names it."""


class VllmPluginSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True  # TIERPLAN_VLLM_ENABLED=0: the plugin loads and does nothing (counted in its log line)
    # the agent id names the sidecar's socket file too: stricter than the protocol's Id
    agent_id: str = Field(default="vllm-0", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")
    group: Id = "default"  # the registration's policy group: what AgentRegistration accepts, checked here
    socket: str = ""  # the sidecar's unix socket; "" = `tierplan sidecar`'s default for this agent id
    window_steps: int = Field(default=16, ge=1, le=1_000_000)  # engine steps per Telemetry window
    max_queued_windows: int = Field(default=1024, ge=1)
    hbm_budget_bytes: int = Field(default=0, ge=0)  # 0 = experts + the KV cache vLLM allocated
    link_bytes_per_s: float = Field(default=2.0e10, gt=0)  # host<->device and disk links, for the cost model
    nvme_bytes_per_s: float = Field(default=2.0e9, gt=0)
    # KV tier capacity when the configured connector is not ours (ours: its cpu_blocks / nvme_blocks are used)
    kv_cpu_blocks: int = Field(default=0, ge=0)
    kv_nvme_blocks: int = Field(default=0, ge=0)
    stats_socket: str = ""  # where the stat logger sends vLLM's stats; "" = `<socket>.stats`

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> VllmPluginSettings:
        values: dict[str, str] = {}
        known = {ENV_PREFIX + name.upper(): name for name in cls.model_fields}
        for key, value in environ.items():
            if not key.startswith(ENV_PREFIX):
                continue
            if key not in known:
                raise SettingsError(f"{MESSAGE_PREFIX}{key}: unknown setting; known: {', '.join(sorted(known))}")
            values[known[key]] = value
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            err = exc.errors()[0]
            name = ENV_PREFIX + str(err["loc"][0]).upper() if err["loc"] else ENV_PREFIX
            value = values.get(str(err["loc"][0]), "") if err["loc"] else ""
            msg = " ".join(str(err["msg"]).split())  # one line, whatever pydantic wrote
            raise SettingsError(f"{MESSAGE_PREFIX}{name}={value!r}: {msg}") from None

    def socket_path(self, default_for: str) -> str:
        return self.socket or default_for

    def for_engine(self, dp_rank: int, dp_size: int, default_socket: str) -> VllmPluginSettings:
        """The settings of one data-parallel engine. Each of `dp_size` > 1 engines is its own agent
        (`<agent_id>-dp<rank>`: windows of two engines never share a sequence) with its own stats socket
        (`<stats socket>.dp<rank>`: the API server's stat logger of engine `rank` sends there), all through the one
        sidecar socket of the configured agent id (`default_socket`: the sidecar's default for that id)."""
        if dp_size <= 1:
            return self
        sock = self.socket_path(default_socket)
        values = {**self.model_dump(), "agent_id": f"{self.agent_id}-dp{dp_rank}", "socket": sock,
                  "stats_socket": f"{self.stats_socket_path(sock)}.dp{dp_rank}"}
        try:
            return type(self).model_validate(values)
        except ValidationError as exc:  # an agent id at its length limit cannot take the suffix
            raise SettingsError(f"{MESSAGE_PREFIX}{ENV_PREFIX}AGENT_ID={self.agent_id!r}: with data parallel "
                                f"engine {dp_rank} it becomes {values['agent_id']!r}, which is refused "
                                f"({exc.errors()[0]['msg']})") from None

    def stats_socket_path(self, socket_path: str) -> str:
        return self.stats_socket or str(Path(socket_path).with_name(Path(socket_path).name + ".stats"))
