"""Router capture inside vLLM (engine-core / worker process, on the model's forward path).

`RouterCapture.bind(model, ...)` runs once, when vLLM's model loader returns the model and before vLLM
compiles or warms it up. For every MoE layer whose router is a `BaseRouter` it sets the router's capture
callback (`BaseRouter.set_capture_fn`: called with the logical top-k ids right after top-k), and a forward
hook on the layer's gate that copies the router logits into one preallocated buffer. The callback folds the
rows into our `RouterTap`'s preallocated device counters (activation counts, top-k co-occurrence, router
entropy of the top-k routing weights, renormalised, scored by the router's own scoring function) with
in-place tensor ops only: no host sync, no Python state that changes per call, so it survives
`torch.compile` and CUDA graphs (measured: same counts eager and compiled).

Which rows are tokens: vLLM runs padded batches (`num_tokens_padded`, with the forward context's
`is_padding`) and dummy runs (profile, warm-up, CUDA-graph capture, data-parallel `execute_dummy_batch`).
A persistent device row mask (`row_live`, 1 = a token, 0 = padding) is filled before every forward from
`is_padding` (a device copy, so a captured graph replays it from vLLM's own buffer), or all 0 for a dummy run;
the callback multiplies it into the weights and the tap skips weight-0 rows. The tap is never reset between
windows' closes: a dummy run between two real steps costs the window nothing.

Layers it cannot bind are counted by reason (`unbound`, into every window's fallbacks), never skipped
silently: a fused (monolithic) kernel, a router without `set_capture_fn`, a router whose capture callback is
already taken (vLLM's routed-experts capturer: we never replace it), and layers whose top-k rows are gathered
across ranks before routing (data parallel > 1, sequence parallel, prefill-context parallel > 1: the rows are
not this rank's tokens and the gate's logits are not beside them). The host-side step hooks (a pre- and
post-forward hook on the whole model) fill the mask, read the step's real tokens from the attention metadata
(`num_actual_tokens`, on the host), time the step and hand it to `on_step`; a dummy run is counted in
`discarded_warmup_steps`. It must never move or change what the model computes: it only reads.
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
    CAPTURE_FN_TAKEN = "capture_fn_taken"  # vLLM's routed-experts capturer (or another) holds the callback
    GATHERED_ROWS = "gathered_rows"  # DP > 1, SP or PCP > 1: top-k rows gathered across ranks, not ours alone
    NO_GATE_LOGITS = "no_gate_logits"  # bound, but entropy is that of equal weights (gate fused or not in the runner)
    UNKNOWN_SCORING = "unknown_scoring"  # bound, but the router's scoring function is not one we can repeat:
    # entropy is that of equal weights


UNBOUND_LAYER = (Unbound.MONOLITHIC_KERNEL, Unbound.NOT_BASE_ROUTER, Unbound.CAPTURE_FN_TAKEN, Unbound.GATHERED_ROWS)

# The router's scoring functions whose top-k weights we can repeat from the gate's logits (before any
# correction bias, which only picks the experts): the tap renormalises them, as vLLM's `renormalize` does.
SCORES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "softmax": lambda x: torch.softmax(x, dim=-1),  # over the top-k logits: the renormalised top-k softmax
    "sigmoid": torch.sigmoid,
    "sqrtsoftplus": lambda x: torch.nn.functional.softplus(x).sqrt(),
}
MIN_WEIGHT = 1e-30  # a real row never reaches weight 0 (the tap's "no row" mark) by underflow


class InPlaceRouterTap(RouterTap):
    """`RouterTap` whose rows are folded at once on the device, in place (`add_rows`), so nothing depends on
    host bookkeeping per call; tokens per layer are read from the counts when the window is taken."""

    def __init__(self, moe_layers: tuple[int, ...], num_experts: int, top_k: int, device: torch.device) -> None:
        super().__init__(moe_layers, num_experts, device, capacity_rows=1)
        self.top_k = top_k

    def add_rows(self, m: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """ids/weights [N, k] of MoE layer index m (position in moe_layers); weight-0 rows are skipped."""
        self._accumulate(m, ids.long()[None], weights.float()[None])

    def snapshot(self) -> RouterCounts:
        self.tokens = (self.counts.sum(-1) // self.top_k).tolist()  # each routed token adds k counts
        return super().snapshot()


@dataclass(frozen=True)
class ModelShape:
    """What the capture learned of the model: MoE layers (vLLM's layer ids, bound or not), experts, top-k, bytes."""

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


def routed_experts_capturer_on(vllm_config: Any) -> bool:
    """vLLM binds its own routed-experts capturer after the model loads (`enable_return_routed_experts`)."""
    aux = getattr(vllm_config, "aux_output_config", None)
    return bool(getattr(aux, "enable_return_routed_experts", False))


def unbindable(runner: Any, capturer_on: bool = False) -> Unbound | None:
    """Why this MoE runner's router cannot carry our capture, or None when it can."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    if runner.is_monolithic:
        return Unbound.MONOLITHIC_KERNEL
    if not isinstance(runner.router, BaseRouter):
        return Unbound.NOT_BASE_ROUTER
    if capturer_on or runner.router.capture_fn is not None:
        return Unbound.CAPTURE_FN_TAKEN
    mc = runner.moe_config
    if mc.dp_size > 1 or mc.is_sequence_parallel or mc.pcp_size > 1:
        return Unbound.GATHERED_ROWS
    return None


def score_fn(router: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The router's scoring function over its top-k logits, or None when we cannot repeat it (a custom routing
    function, a simulator, a scoring function we do not know)."""
    if getattr(router, "custom_routing_function", None) is not None:
        return None
    name = getattr(router, "scoring_func", None)
    return SCORES.get(name) if isinstance(name, str) else None


def actual_tokens(attn_metadata: Any) -> int | None:
    """The step's real tokens from vLLM's attention metadata, read on the host (no device sync): each attention
    layer's metadata carries `num_actual_tokens` (padding excluded), the microbatches' summed under dual-batch
    overlap. None where a backend does not say (the window then reports no step's tokens)."""
    parts = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata]
    total = 0
    for part in parts:
        first = next(iter(part.values()), None) if isinstance(part, dict) else None
        n = getattr(first, "num_actual_tokens", None)
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            return None
        total += n
    return total


class RouterCapture:
    """See the module docstring. `on_step(step_s, warmup)` is called after every forward of the model."""

    def __init__(self, tap: InPlaceRouterTap, shape: ModelShape, max_tokens: int, device: torch.device) -> None:
        self.tap, self.shape = tap, shape
        self.logits = torch.zeros(max_tokens, shape.num_experts, dtype=torch.float32, device=device)  # [T, E]
        self.row_live = torch.zeros(max_tokens, dtype=torch.float32, device=device)  # [T] 1 = a token's row
        self.unbound: Counter[str] = Counter()
        self.discarded_warmup_steps = 0
        self.steps = 0
        self.hook_errors = 0
        self.last_error = ""
        self.on_step: Callable[[float, bool], None] | None = None
        self.last_step_tokens: int | None = None  # the last forward's real tokens (None: a dummy run, or unknown)
        self._t0 = 0.0
        self._warmup = True
        self._bindable: list[tuple[int, Any]] = []  # (MoE layer index, runner), from survey() until attach()

    @classmethod
    def bind(cls, model: torch.nn.Module, num_layers: int, max_tokens: int,
             vllm_config: Any = None) -> RouterCapture | None:
        """`survey` the model, then `attach` to it."""
        cap = cls.survey(model, num_layers, max_tokens, vllm_config)
        if cap is not None:
            cap.attach(model)
        return cap

    @classmethod
    def survey(cls, model: torch.nn.Module, num_layers: int, max_tokens: int,
               vllm_config: Any = None) -> RouterCapture | None:
        """The capture of `model`'s MoE layers, the unbindable ones counted by reason, not attached yet; None
        if it has no MoE layer (a dense model). Layers that all refuse still get a capture: its windows carry
        the reasons."""
        runners = sorted(_moe_runners(model), key=lambda r: r.layer_id)
        if not runners:
            return None
        capturer_on = routed_experts_capturer_on(vllm_config)
        why = [unbindable(r, capturer_on) for r in runners]
        first = next((r for r, w in zip(runners, why, strict=True) if w is None), runners[0])
        num_experts = int(getattr(first.router, "global_num_experts", 0) or first.moe_config.num_logical_experts)
        top_k = int(getattr(first.router, "top_k", 0) or first.moe_config.experts_per_token)
        device = next(model.parameters()).device
        shape = ModelShape(num_layers, tuple(int(r.layer_id) for r in runners), num_experts, top_k,
                           max(1, _param_bytes(first) // num_experts),
                           max(0, _param_bytes(model) - sum(_param_bytes(r) for r in runners)))
        cap = cls(InPlaceRouterTap(shape.moe_layers, num_experts, top_k, device), shape, max_tokens, device)
        cap.unbound.update(w for w in why if w is not None)
        cap._bindable = [(m, r) for m, (r, w) in enumerate(zip(runners, why, strict=True)) if w is None]
        return cap

    def attach(self, model: torch.nn.Module) -> None:
        """Set the surveyed routers' capture callbacks, their gates' logit hooks and the model's step hooks."""
        for m, runner in self._bindable:
            score = score_fn(runner.router)
            gate = getattr(runner, "gate", None)
            if gate is None or getattr(runner, "_fse_fuse_gate", False):
                self.unbound[Unbound.NO_GATE_LOGITS] += 1
                score = None
            elif score is None:
                self.unbound[Unbound.UNKNOWN_SCORING] += 1
            else:
                gate.register_forward_hook(self._keep_logits)
            runner.router.set_capture_fn(self.layer_capture(m, score))
        self._bindable = []
        model.register_forward_pre_hook(self._before_step)
        model.register_forward_hook(self._after_step)

    @property
    def bound_layers(self) -> int:
        return len(self.shape.moe_layers) - sum(self.unbound[u] for u in UNBOUND_LAYER)

    # ---- on the forward path: in-place tensor ops only --------------------------------------------------
    def _keep_logits(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        logits = out[0] if isinstance(out, tuple) else out  # [N, E]
        self.logits[: logits.shape[0]].copy_(logits)  # returns None: the gate's output is left as it was

    def layer_capture(self, m: int, score: Callable[[torch.Tensor], torch.Tensor] | None,
                      ) -> Callable[[torch.Tensor], None]:
        """The capture callback of MoE layer index m; `score` None: equal weights (entropy log k)."""
        tap, logits, live = self.tap, self.logits, self.row_live

        def capture(topk_ids: torch.Tensor) -> None:  # [N, k] logical expert ids
            n = topk_ids.shape[0]
            if score is not None:
                w = score(logits[:n].gather(1, topk_ids.long())).clamp_min(MIN_WEIGHT)  # [N, k]
            else:
                w = torch.ones(topk_ids.shape, dtype=torch.float32, device=topk_ids.device)
            tap.add_rows(m, topk_ids, w * live[:n, None])  # padding and dummy rows: weight 0, skipped

        return capture

    # ---- host side, once per step -----------------------------------------------------------------------
    def _before_step(self, module: torch.nn.Module, args: Any) -> None:
        self._t0 = time.perf_counter()
        try:
            self._warmup = self.fill_row_mask()
        except Exception as exc:  # ours: this step's rows are dropped, counted, never raised into vLLM
            self.row_live.zero_()
            self._warmup = True
            self.hook_errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"

    def fill_row_mask(self) -> bool:
        """Fill `row_live` for the forward about to run; True when it is a dummy run (no traffic)."""
        from vllm.forward_context import get_forward_context, is_forward_context_available

        ctx = get_forward_context() if is_forward_context_available() else None
        padding = getattr(ctx, "is_padding", None)
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        self.last_step_tokens = None
        if ctx is None or (ctx.attn_metadata is None and not capturing) or (capturing and padding is None):
            self.row_live.zero_()  # a profile / warm-up run on dummy tokens
            return True
        if not capturing:
            self.last_step_tokens = actual_tokens(ctx.attn_metadata)
        if padding is None:
            self.row_live.fill_(1.0)  # no padding mask from this runner: every row is a token
        else:
            # a device copy: a graph captured now replays it from vLLM's buffer, which each real step refills
            t = min(int(padding.shape[0]), self.row_live.shape[0])
            self.row_live[:t].copy_(padding[:t].logical_not())
            self.row_live[t:].zero_()
        return capturing  # a CUDA-graph capture is a dummy run too (vLLM pads all of it)

    def _after_step(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        try:
            warmup = self._warmup
            if warmup:  # its rows had weight 0: nothing to take out of the tap
                self.discarded_warmup_steps += 1
            else:
                self.steps += 1
            if self.on_step is not None:
                self.on_step(time.perf_counter() - self._t0, warmup)
        except Exception as exc:  # ours: counted, never raised into vLLM's forward
            self.hook_errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
