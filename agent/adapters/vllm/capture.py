"""Router capture inside vLLM (engine-core / worker process, on the model's forward path).

`RouterCapture.bind(model, ...)` runs once, when vLLM's model loader returns the model and before vLLM
compiles or warms it up. For every MoE layer whose router is a `BaseRouter` it sets the router's capture
callback (`BaseRouter.set_capture_fn`: called with the logical top-k ids right after top-k), and a forward
hook on the layer's gate that copies the router logits into one preallocated buffer. The callback folds the
rows into our `RouterTap`'s preallocated device counters (activation counts, top-k co-occurrence, router
entropy of the renormalised top-k probabilities) with in-place tensor ops only: no host sync, no Python state
that changes per call. That is why it survives `torch.compile`: Dynamo traces the in-place writes into the
graph, where a Python side effect would run once at trace time and never again (measured: same counts eager
and compiled). Layers it cannot bind are counted by reason (`unbound`), never skipped silently.

The host-side step hooks (a pre- and post-forward hook on the whole model, Python on every step) time the
step and hand it to `on_step`; a step run without attention metadata is a warm-up/profile run, whose rows are
discarded (`discarded_warmup_steps`). It must never move or change what the model computes: it only reads.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

from tierplan.agent.router_counts import RouterCounts
from tierplan.agent.taps import RouterTap


class Unbound(StrEnum):
    MONOLITHIC_KERNEL = "monolithic_kernel"  # routing happens inside the fused kernel: no top-k ids to see
    NOT_BASE_ROUTER = "not_base_router"  # a router without set_capture_fn
    NO_GATE_LOGITS = "no_gate_logits"  # bound, but entropy is that of equal weights (gate fused or not in the runner)


class InPlaceRouterTap(RouterTap):
    """`RouterTap` whose rows are folded at once on the device, in place (`add_rows`), so nothing depends on
    host bookkeeping per call; tokens per layer are read from the counts when the window is taken."""

    def __init__(self, moe_layers: tuple[int, ...], num_experts: int, top_k: int, device: torch.device) -> None:
        super().__init__(moe_layers, num_experts, device, capacity_rows=1)
        self.top_k = top_k

    def add_rows(self, m: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """ids/weights [N, k] of MoE layer index m (position in moe_layers)."""
        self._accumulate(m, ids.long()[None], weights.float()[None])

    def snapshot(self) -> RouterCounts:
        self.tokens = (self.counts.sum(-1) // self.top_k).tolist()  # each routed token adds k counts
        return super().snapshot()

    def reset(self) -> None:
        for t in (self.counts, self.pairs, self.entropy_sum):
            t.zero_()
        self.tokens = [0] * len(self.tokens)


@dataclass(frozen=True)
class ModelShape:
    """What the capture learned of the model: MoE layers (vLLM's layer ids), experts, top-k, bytes."""

    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    expert_bytes: int  # one expert's weights
    dense_bytes: int  # every other parameter


def _moe_runners(model: torch.nn.Module) -> list[Any]:
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    return [m for m in model.modules() if isinstance(m, MoERunner)]


def _param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


class RouterCapture:
    """See the module docstring. `on_step(step_s, warmup)` is called after every forward of the model."""

    def __init__(self, tap: InPlaceRouterTap, shape: ModelShape, max_tokens: int, device: torch.device) -> None:
        self.tap, self.shape = tap, shape
        self.logits = torch.zeros(max_tokens, shape.num_experts, dtype=torch.float32, device=device)  # [T, E]
        self.unbound: Counter[str] = Counter()
        self.discarded_warmup_steps = 0
        self.steps = 0
        self.hook_errors = 0
        self.last_error = ""
        self.on_step: Callable[[float, bool], None] | None = None
        self._t0 = 0.0

    @classmethod
    def bind(cls, model: torch.nn.Module, num_layers: int, max_tokens: int) -> RouterCapture | None:
        """Bind to every MoE layer of `model`; None if it has none (a dense model: nothing to capture)."""
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        runners = _moe_runners(model)
        usable, unbound = [], Counter[str]()
        for r in runners:
            if r.is_monolithic:
                unbound[Unbound.MONOLITHIC_KERNEL] += 1
            elif not isinstance(r.router, BaseRouter):
                unbound[Unbound.NOT_BASE_ROUTER] += 1
            else:
                usable.append(r)
        if not usable:
            return None
        usable.sort(key=lambda r: r.layer_id)
        first = usable[0].router
        num_experts, top_k = int(first.global_num_experts), int(first.top_k)
        device = next(model.parameters()).device
        expert_bytes = max(1, _param_bytes(usable[0]) // num_experts)
        moe_bytes = sum(_param_bytes(r) for r in runners)
        shape = ModelShape(num_layers, tuple(int(r.layer_id) for r in usable), num_experts, top_k, expert_bytes,
                           max(0, _param_bytes(model) - moe_bytes))
        tap = InPlaceRouterTap(shape.moe_layers, num_experts, top_k, device)
        cap = cls(tap, shape, max_tokens, device)
        cap.unbound.update(unbound)
        for m, runner in enumerate(usable):
            gate = getattr(runner, "gate", None)
            has_logits = gate is not None and not getattr(runner, "_fse_fuse_gate", False)
            if has_logits:
                gate.register_forward_hook(cap._keep_logits)
            else:
                cap.unbound[Unbound.NO_GATE_LOGITS] += 1
            runner.router.set_capture_fn(cap._capture_fn(m, has_logits))
        model.register_forward_pre_hook(cap._before_step)
        model.register_forward_hook(cap._after_step)
        return cap

    # ---- on the forward path: in-place tensor ops only --------------------------------------------------
    def _keep_logits(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        logits = out[0] if isinstance(out, tuple) else out  # [N, E]
        self.logits[: logits.shape[0]].copy_(logits)  # returns None: the gate's output is left as it was

    def _capture_fn(self, m: int, has_logits: bool) -> Callable[[torch.Tensor], None]:
        tap, logits, k = self.tap, self.logits, self.shape.top_k

        def capture(topk_ids: torch.Tensor) -> None:  # [N, k] logical expert ids
            n = topk_ids.shape[0]
            if has_logits:
                w = torch.softmax(logits[:n].gather(1, topk_ids.long()), dim=-1)  # [N, k] renormalised top-k
            else:
                w = torch.full(topk_ids.shape, 1.0 / k, dtype=torch.float32, device=topk_ids.device)
            tap.add_rows(m, topk_ids, w)

        return capture

    # ---- host side, once per step -----------------------------------------------------------------------
    def _before_step(self, module: torch.nn.Module, args: Any) -> None:
        self._t0 = time.perf_counter()

    def _after_step(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        try:
            warmup = _is_warmup_step()
            if warmup:  # a profile / compile warm-up run on dummy tokens: not traffic
                self.tap.reset()
                self.discarded_warmup_steps += 1
            else:
                self.steps += 1
            if self.on_step is not None:
                self.on_step(time.perf_counter() - self._t0, warmup)
        except Exception as exc:  # ours: counted, never raised into vLLM's forward
            self.hook_errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"


def _is_warmup_step() -> bool:
    from vllm.forward_context import get_forward_context, is_forward_context_available

    return not is_forward_context_available() or get_forward_context().attn_metadata is None
