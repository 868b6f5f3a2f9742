"""`tierplan eval predictors`: expert-cache policies replayed on a routing trace.

Runs in the user's shell. Heavy modules are imported inside the command. Bad input (a missing, empty or .npy
trace, a cache fraction outside (0, 1], a batch below 1) prints `error: ...` on stderr and exits 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer


def _fail(message: str) -> typer.Exit:
    print(f"error: {message}", file=sys.stderr)
    return typer.Exit(2)


def register(app: typer.Typer) -> None:
    """Add this module's command(s) to `app` (called from api.cli.main)."""

    @app.command("predictors")
    def eval_predictors(
        trace: Annotated[Path, typer.Option(help="A normalized .npz routing trace (data/README.md).")],
        cache_frac: Annotated[float, typer.Option(help="Resident experts per layer, as a fraction in (0, 1].")],
        batch: Annotated[int, typer.Option(help="Tokens per step (their union per layer is demanded).")] = 1,
        as_json: Annotated[bool, typer.Option("--json", help="Last stdout line: one JSON object per policy.")] = False,
        with_lgbm: Annotated[bool, typer.Option("--with-lgbm", help="Also the LightGBM blend (slower).")] = False,
    ) -> None:
        """Replay lru, lfu, lfru, belady (clairvoyant, no prefetch) and the tierplan policies; score the 2nd half."""
        from rich.console import Console
        from rich.table import Table

        from tierplan.controller.eval.expert_cache import cache_capacity, layer_streams, replay, step_unions
        from tierplan.controller.eval.policies import ReplayInputs, policy_factories
        from tierplan.controller.routing_npz import RoutingTraceError, load_routing_npz

        if not 0.0 < cache_frac <= 1.0:
            raise _fail(f"--cache-frac must be in (0, 1], got {cache_frac}")
        if batch < 1:
            raise _fail(f"--batch must be >= 1, got {batch}")
        try:
            routing = load_routing_npz(trace)
        except RoutingTraceError as exc:
            raise _fail(str(exc)) from None
        unions = step_unions(routing, batch)
        inputs = ReplayInputs(unions, layer_streams(unions, routing.num_layers), routing.num_layers,
                              routing.num_experts, batch)
        results = {name: replay(routing, make(inputs), cache_frac, batch, unions)
                   for name, make in policy_factories(with_lgbm).items()}
        best_hit = results["belady"].hit_rate
        out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 120)
        table = Table(title=f"{trace.name}: {routing.num_tokens} tokens, {routing.num_layers} layers, "
                            f"top-{routing.top_k} of {routing.num_experts}, cache "
                            f"{cache_capacity(cache_frac, routing.num_experts)}/layer, batch {batch}")
        for col in ("policy", "hit rate", "loads/demand", "gap to belady", "prefetches", "wasted"):
            table.add_column(col, justify="left" if col == "policy" else "right")
        for name, r in results.items():
            table.add_row(name, f"{r.hit_rate:.3f}", f"{r.loads_per_demand:.3f}", f"{best_hit - r.hit_rate:+.3f}",
                          str(r.prefetch_loads), f"{r.prefetch_waste:.2f}" if r.prefetch_loads else "-")
        out.print(table)
        out.print("belady: clairvoyant eviction, no prefetch. Prefetches for a layer are issued once the previous "
                  "layer of the same step has routed. router-lookahead (the next layer's router on the current "
                  "hidden state) is not evaluated: routing traces carry no hidden states.")
        if as_json:
            print(json.dumps({name: {"hit_rate": round(r.hit_rate, 6), "loads_per_demand": round(r.loads_per_demand, 6)}
                              for name, r in results.items()}))
