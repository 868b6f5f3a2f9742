"""What the agent and a trace replay plug into the reference model (inference process).

`ModelHooks` is handed to `MoEModel` (and `ReferenceEngine`) when it is built, or replaced later through
`ReferenceEngine.set_hooks` (which drops captured CUDA graphs: a graph bakes in the forced-route table's
address). `ForcedRoutes` is the interface of a routing table that replaces the router's choice: the table
lives on the device (graphs gather from it through a static row buffer), a host copy lets the engine know a
step's experts before it runs (piecewise graphs load a layer's misses, and prefetch ahead, without reading
anything back). `StepRouting` is one forward's routing inputs. Nothing here moves bytes or decides placement.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from tierplan.runtime.engine.attention import MassObserver

RouteTap = Callable[[int, torch.Tensor, torch.Tensor], None]  # (layer, ids [N, k], weights [N, k])


class ForcedRoutes(Protocol):
    """A routing table: trace token t, MoE layer m -> k expert ids and weights (runtime/engine/runner.py)."""

    ids: torch.Tensor  # [T, L_moe, k] int64 on the device
    weights: torch.Tensor  # [T, L_moe, k] float32 on the device
    ids_host: np.ndarray  # [T, L_moe, k] int64, the same ids on the host

    def trace_rows(self, seqs: Sequence[int], starts: Sequence[int], num_tokens: Sequence[int]) -> list[int]:
        """The trace token of every row of a forward, in batch order (sequence i: rows at positions
        starts[i] .. starts[i] + num_tokens[i] - 1)."""
        ...


@dataclass(frozen=True)
class ModelHooks:
    route_tap: RouteTap | None = None  # the agent's router tap (sees the routes actually used)
    mass_observer: MassObserver | None = None  # the agent's sampled attention-mass tap
    forced_routes: ForcedRoutes | None = None  # a routing trace replacing the router
    decode_kernel: bool = False  # decode batches through the Triton paged kernel


@dataclass
class StepRouting:
    """One forward's routing inputs.

    Eager: `forced` replaces the router by the table rows `trace_rows` [N]. Graph rows (static buffers): the
    router always runs; where `forced_mask` [N, 1] is set the table's route wins (one captured graph serves
    forced and live steps), and `row_src` [N] gives padding rows a real row's route (so a padded batch needs no
    expert the real rows do not). `route_out` (probs [L, N, k] float32, ids [L, N, k] int64) receives the routes
    used, for the agent's tap after a replay. `forced_rows` (ids [N, L, k] int64, weights [N, L, k] float32):
    the table's rows of the step, gathered once for every layer (a step pays one gather, not one per layer)."""

    trace_rows: torch.Tensor | None = None  # [N] int64
    forced: bool = False
    forced_mask: torch.Tensor | None = None  # [N, 1] bool
    row_src: torch.Tensor | None = None  # [N] int64
    route_out: tuple[torch.Tensor, torch.Tensor] | None = None
    forced_rows: tuple[torch.Tensor, torch.Tensor] | None = None
