"""Real telemetry through the real path: the CPU reference engine and its agent replay the demo's phased workload
with a `ServiceLink` to a running sidecar as the closed loop's plan source (api/demo_service.py's
`replay_through_sidecar`: engine -> agent -> unix socket -> sidecar -> HTTP -> service, and plans back).

Test code (the pytest process runs the engine; the sidecar and the service are other processes). Each step is
paced by a few real milliseconds so the service's background planner has time to issue plans that the agent
then applies; the engine thread itself never waits on the sidecar (ServiceLink's contract).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tierplan.api.demo_service import replay_through_sidecar as _replay

PACE_S = 0.01  # real time per engine step, so plans land during the replay


def replay_through_sidecar(socket_path: str, workdir: Path, agent_id: str, num_requests: int = 24) -> dict[str, Any]:
    """Runs the phased workload with the sidecar at `socket_path` as plan source; the loop's and link's stats."""
    result, link = _replay(socket_path, workdir, agent_id, num_requests, pace_s=PACE_S)
    return {"loop": result.stats, "link": link}
