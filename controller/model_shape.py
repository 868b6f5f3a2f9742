"""Model shapes for the cost model: how many bytes each expert, the dense weights and a KV block take.

Runs in the controller process and in `tierplan sim`. Pure Python: reads a Hugging Face config.json (a file,
a folder holding one, or the dict) for Qwen3-MoE / Qwen2-MoE, Mixtral, OLMoE and DeepSeek-V2/V3 into a
frozen `ModelShape`; `builtin_shape(name)` gives the true shapes of the models we plan for. Every refusal is
a `ShapeError` naming the source, the field, what was expected and what was got. It never imports torch
or runtime (the engine's own parser is runtime/engine/config.py; this one only counts bytes).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ShapeError(ValueError):
    """A config cannot be read as a model shape (the message says where and why)."""


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    name: str
    num_layers: int
    moe_layers: tuple[int, ...]  # ascending indices of the layers whose MLP is routed experts
    num_experts: int
    top_k: int
    expert_bytes: int  # one routed expert (gate, up, down)
    dense_bytes: int  # everything always resident: attention, dense MLPs, shared experts, embeddings, head
    kv_bytes_per_token: int  # all layers together
    block_tokens: int = 16

    def __post_init__(self) -> None:
        for f in ("num_layers", "num_experts", "top_k", "expert_bytes", "kv_bytes_per_token", "block_tokens"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ShapeError(f"ModelShape {self.name!r}: field '{f}' must be an int >= 1, got {v!r}")
        if isinstance(self.dense_bytes, bool) or not isinstance(self.dense_bytes, int) or self.dense_bytes < 0:
            raise ShapeError(f"ModelShape {self.name!r}: field 'dense_bytes' must be an int >= 0, got "
                             f"{self.dense_bytes!r}")
        if self.top_k > self.num_experts:
            raise ShapeError(f"ModelShape {self.name!r}: field 'top_k' must be <= num_experts ({self.num_experts}), "
                             f"got {self.top_k}")
        layers = tuple(self.moe_layers)
        if list(layers) != sorted(set(layers)) or any(not 0 <= i < self.num_layers for i in layers) or not layers:
            raise ShapeError(f"ModelShape {self.name!r}: field 'moe_layers' must be non-empty, ascending, unique and "
                             f"in 0..{self.num_layers - 1}, got {layers}")
        object.__setattr__(self, "moe_layers", layers)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv_bytes_per_token * self.block_tokens

    @property
    def all_expert_bytes(self) -> int:
        return self.num_moe_layers * self.num_experts * self.expert_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "num_layers": self.num_layers, "moe_layers": list(self.moe_layers),
                "num_experts": self.num_experts, "top_k": self.top_k, "expert_bytes": self.expert_bytes,
                "dense_bytes": self.dense_bytes, "kv_bytes_per_token": self.kv_bytes_per_token,
                "block_tokens": self.block_tokens}


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8": 1, "fp8": 1}
_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3")


class _Cfg:
    def __init__(self, cfg: Mapping[str, Any], source: str) -> None:
        self.cfg, self.source = cfg, source

    def int(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        v = self.cfg.get(key, default)
        if v is None:
            raise ShapeError(f"{self.source}: missing required field '{key}'")
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ShapeError(f"{self.source}: field '{key}' must be an int >= {minimum}, got {v!r}")
        return v

    def first(self, *keys: str) -> int:
        for k in keys:
            if self.cfg.get(k) is not None:
                return self.int(k)
        raise ShapeError(f"{self.source}: missing required field, one of {list(keys)}")


def _weight_bytes(c: _Cfg, dtype_bytes: int | None) -> int:
    if dtype_bytes is not None:
        return dtype_bytes
    q = c.cfg.get("quantization_config")
    if isinstance(q, Mapping) and q.get("quant_method") == "fp8":  # DeepSeek-V3 ships e4m3 weights
        return 1
    name = c.cfg.get("torch_dtype") or c.cfg.get("dtype") or "bfloat16"
    if name not in _DTYPE_BYTES:
        raise ShapeError(f"{c.source}: field 'torch_dtype' must be one of {sorted(_DTYPE_BYTES)}, got {name!r}")
    return _DTYPE_BYTES[name]


def _moe_layers(c: _Cfg, family: str, num_layers: int) -> list[int]:
    if family.startswith("deepseek"):
        first, freq = c.int("first_k_dense_replace", 0, minimum=0), c.int("moe_layer_freq", 1)
        return [i for i in range(num_layers) if i >= first and i % freq == 0]
    if family in ("qwen3_moe", "qwen2_moe"):
        step, only = c.int("decoder_sparse_step", 1), c.cfg.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) and 0 <= i < num_layers for i in only):
            raise ShapeError(f"{c.source}: field 'mlp_only_layers' must be a list of layer indices in "
                             f"0..{num_layers - 1}, got {only!r}")
        return [i for i in range(num_layers) if i not in set(only) and (i + 1) % step == 0]
    return list(range(num_layers))


def _attention_params(c: _Cfg, family: str, hidden: int) -> tuple[int, int]:
    """(attention weight parameters per layer, KV elements per token per layer)."""
    heads = c.int("num_attention_heads")
    if family.startswith("deepseek"):  # MLA: caches the compressed latent plus the shared rope key
        lora, rope = c.int("kv_lora_rank"), c.int("qk_rope_head_dim")
        nope, v = c.int("qk_nope_head_dim"), c.int("v_head_dim")
        q_lora = c.cfg.get("q_lora_rank")
        qk = heads * (nope + rope)
        q = hidden * qk if not q_lora else hidden * c.int("q_lora_rank") + q_lora * qk
        return q + hidden * (lora + rope) + lora * heads * (nope + v) + heads * v * hidden, lora + rope
    kv_heads = c.cfg.get("num_key_value_heads") or heads
    head_dim = c.cfg.get("head_dim") or hidden // heads
    return hidden * head_dim * (2 * heads + 2 * kv_heads), 2 * kv_heads * head_dim


def shape_from_config(config: str | os.PathLike[str] | Mapping[str, Any], name: str | None = None,
                      dtype_bytes: int | None = None, kv_dtype_bytes: int = 2, block_tokens: int = 16) -> ModelShape:
    """A ModelShape from a Hugging Face config.json (file, folder or dict). Weights at the config's dtype (FP8
    when it says so) unless `dtype_bytes` is given; KV at `kv_dtype_bytes` (bf16 by default)."""
    if isinstance(config, Mapping):
        cfg, source = config, f"config dict ({name or 'unnamed'})"
    else:
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        source = f"config.json ({path})"
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ShapeError(f"{source}: no such file (expected a config.json or a folder holding one)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ShapeError(f"{source}: not valid JSON: {e}") from None
        if not isinstance(cfg, dict):
            raise ShapeError(f"{source}: expected a JSON object at the top level, got {type(cfg).__name__}")
        name = name or path.resolve().parent.name
    c = _Cfg(cfg, source)
    family = cfg.get("model_type")
    if family not in _FAMILIES:
        raise ShapeError(f"{source}: field 'model_type' must be one of {list(_FAMILIES)}, got {family!r}")
    wb = _weight_bytes(c, dtype_bytes)
    hidden, num_layers, vocab = c.int("hidden_size"), c.int("num_hidden_layers"), c.int("vocab_size")
    num_experts = c.first("num_experts", "num_local_experts", "n_routed_experts")
    top_k = c.int("num_experts_per_tok")
    expert_inter = c.first("moe_intermediate_size", "intermediate_size")
    moe = _moe_layers(c, family, num_layers)
    attn, kv_elems = _attention_params(c, family, hidden)
    dense_mlp = 3 * hidden * c.int("intermediate_size") if len(moe) < num_layers else 0
    shared = 0
    if family.startswith("deepseek"):
        shared = 3 * hidden * expert_inter * c.int("n_shared_experts", 0, minimum=0)
    elif family == "qwen2_moe":
        shared = 3 * hidden * c.int("shared_expert_intermediate_size", 0, minimum=0) + hidden  # + its gate
    router = hidden * num_experts
    embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    dense_params = (num_layers * attn + (num_layers - len(moe)) * dense_mlp + len(moe) * (shared + router) + embed)
    return ModelShape(name=name or str(family), num_layers=num_layers, moe_layers=tuple(moe), num_experts=num_experts,
                      top_k=top_k, expert_bytes=3 * hidden * expert_inter * wb, dense_bytes=dense_params * wb,
                      kv_bytes_per_token=num_layers * kv_elems * kv_dtype_bytes, block_tokens=block_tokens)


# The architecture fields of each public config.json (huggingface.co/<repo>/blob/main/config.json).
BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": {  # Qwen/Qwen3-30B-A3B
        "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "vocab_size": 151936, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "qwen3-235b-a22b": {  # Qwen/Qwen3-235B-A22B
        "model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
        "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "vocab_size": 151936, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "mixtral-8x7b": {  # mistralai/Mixtral-8x7B-v0.1
        "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 32000, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "deepseek-v3": {  # deepseek-ai/DeepSeek-V3 (FP8 e4m3 weights per its quantization_config; MTP layer not counted)
        "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "num_attention_heads": 128, "num_key_value_heads": 128,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "vocab_size": 129280, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}},
    "tiny": {  # runtime/engine/presets.py "tiny": the CPU-sized Qwen3-MoE of the demo
        "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "vocab_size": 512, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
}


def builtin_shape(name: str, block_tokens: int = 16) -> ModelShape:
    if name not in BUILTIN_CONFIGS:
        raise ShapeError(f"unknown preset {name!r}; expected one of {sorted(BUILTIN_CONFIGS)}")
    return shape_from_config(BUILTIN_CONFIGS[name], name=name, block_tokens=block_tokens)
