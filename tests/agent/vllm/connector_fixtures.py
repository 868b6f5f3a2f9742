"""Prompts and vLLM set-up for the KV connector's vLLM tests (test process).

`mooncake_prompts` turns the bundled Mooncake conversation sample (data/requests) into token prompts that keep its
prefix sharing: each 512-token hash block of the trace becomes one 32-token vLLM block of the tiny model, the
same hash id giving the same tokens (runtime/engine/workloads.synthetic_prompt_tokens). `llm_kwargs` is the one
set of engine arguments every run shares, so runs with and without the connector differ only in it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from tierplan.runtime.engine.workloads import load_mooncake, synthetic_prompt_tokens

REPO = Path(__file__).resolve().parents[3]
MOONCAKE = REPO / "data" / "requests" / "mooncake_conversation_sample.jsonl"
BLOCK_TOKENS = 32
VOCAB = 512
CONNECTOR_MODULE = "tierplan.agent.adapters.vllm.connector"


def mooncake_prompts(num_requests: int = 10, max_blocks: int = 5, tail_tokens: int = 9) -> list[list[int]]:
    """Requests of the sample that share at least two leading hash blocks with an earlier one, each preceded by
    that earlier request, in trace order; each prompt is at most `max_blocks` blocks plus a tail of its own."""
    reqs = load_mooncake(MOONCAKE)
    chosen: list[int] = []
    for i, r in enumerate(reqs):
        best_j, best = None, 1
        for j in range(i):
            a, b = reqs[j].prefix_block_ids, r.prefix_block_ids
            k = next((n for n in range(min(len(a), len(b))) if a[n] != b[n]), min(len(a), len(b)))
            if k > best:
                best_j, best = j, k
        if best_j is not None:
            chosen += [x for x in (best_j, i) if x not in chosen]
        if len(chosen) >= num_requests:
            break
    chosen.sort()
    out = []
    for idx in chosen[:num_requests]:
        r = reqs[idx]
        n = min(len(r.prefix_block_ids), max_blocks)
        short = replace(r, prompt_len=n * BLOCK_TOKENS + tail_tokens, prefix_block_ids=r.prefix_block_ids[:n])
        out.append(synthetic_prompt_tokens(short, VOCAB, block_tokens=BLOCK_TOKENS))
    return out


def llm_kwargs(model_dir: Path) -> dict[str, Any]:
    """Engine arguments of every run: eager, one process, the CPU backend's 32-token blocks, and vLLM's own prefix
    cache off so that every reuse the runs see is the connector's."""
    return dict(model=str(model_dir), dtype="bfloat16", max_model_len=256, max_num_seqs=4,
                gpu_memory_utilization=0.3, enforce_eager=True, block_size=BLOCK_TOKENS,
                enable_prefix_caching=False, disable_log_stats=False, seed=0)


def connector_config(extra: dict[str, Any]) -> dict[str, Any]:
    return {"kv_connector": "TierplanConnector", "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
