"""The KV retention part of a `Plan` (version 3): prefix hashes the agent's KV tiers keep first.

The controller ranks the prefixes its KV reuse predictor expects back soonest (highest P(reused within the
horizon) first); the agent evicts every block outside the list before one inside it, and inside it from the
end. A prefix hash is the agent's own key of a block (for vLLM: the hex of its chained block hash), as its
telemetry's `ReuseEvent.prefix_hash` reported it, so the controller only hands back keys it was told.
Imported by `controller/protocol.py` (which re-exports the names); plain data plus validation: it must never
import torch, runtime or agent, touch the network or disk, or keep state.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from tierplan.controller.validation import Id

# A plan travels to every agent and is stored with each issue: 4096 hashes of vLLM's 64 hex digits are ~280 KB
# of JSON, and a tier rarely holds that many blocks worth ranking. Repeats are refused by the Plan (one order).
MAX_RETENTION = 4096

KvRetention = Annotated[tuple[Id, ...], Field(max_length=MAX_RETENTION)]
