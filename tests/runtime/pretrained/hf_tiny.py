"""Tiny random Hugging Face checkpoints saved by transformers, for the checkpoint-loading tests.

Every family gets non-default values for the fields that change inference (attention bias, sliding window,
clip_qkv, tied embeddings, norm_topk_prob, a dense layer, rope theta, eps), random biases, norm weights and
DeepSeek-V3 score-correction biases
(transformers initialises them to 0 and 1, which would hide a missing bias or norm), and a tiny WordLevel
tokenizer (tokenizer.json). Built in a temporary folder at test time: no hub, no network.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SENTENCES = ["the quick brown fox jumps over the lazy dog", "a model folder holds weights and a tokenizer",
             "experts move between tiers without changing one bit"]
BASE = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=0)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        intermediate_size=48, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, head_dim=24,
        norm_topk_prob=True, mlp_only_layers=[1], attention_bias=True, use_sliding_window=True, sliding_window=7,
        tie_word_embeddings=True, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 5e5})),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        intermediate_size=40, num_local_experts=8, num_experts_per_tok=2, sliding_window=6, head_dim=8,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        intermediate_size=32, num_experts=8, num_experts_per_tok=2, clip_qkv=0.9, attention_bias=True,
        norm_topk_prob=True, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 2e4})),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(  # V2-Lite's attention: no q compression
        num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=16, routed_scaling_factor=1.5, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 2e4})),
    "deepseek_v2_qlora_yarn_groups": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(  # V2 full / V3 attention
        num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
        num_experts_per_tok=3, n_shared_experts=2, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, routed_scaling_factor=2.0, attention_bias=True,
        topk_method="group_limited_greedy", n_group=4, topk_group=2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "original_max_position_embeddings": 32,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707})),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(  # noaux_tc: sigmoid, biased choice, groups
        num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=16,
        num_experts_per_tok=3, n_shared_experts=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, routed_scaling_factor=2.5, attention_bias=True,
        n_group=4, topk_group=2, norm_topk_prob=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8})),
    "deepseek_v3_plain_rope": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(  # rotate-half rope rows, no renorm
        num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=16, routed_scaling_factor=1.5, n_group=2, topk_group=1,
        norm_topk_prob=False, rope_interleave=False, rope_parameters={"rope_type": "default", "rope_theta": 2e4})),
}


def build_tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    filler = " ".join(f"w{i}" for i in range(vocab_size))  # every model id decodes to a word
    tok.train_from_iterator([*SENTENCES, filler], trainers.WordLevelTrainer(vocab_size=vocab_size,
                                                                            special_tokens=["[PAD]", "[UNK]"]))
    tok.save(str(folder / "tokenizer.json"))


def build_checkpoint(family: str, folder: Path, dtype: torch.dtype = torch.float32, seed: int = 0,
                     max_shard_size: str | None = None, **overrides: Any) -> Path:
    """Save a tiny random `family` model (transformers' save_pretrained) and a tokenizer into `folder`."""
    import transformers

    cfg_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(**{**BASE, **extra, **overrides})
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():  # DeepSeek-V3's e_score_correction_bias: 0 would hide a missing one
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.to(dtype).save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    build_tokenizer(folder, cfg.vocab_size)
    return folder


def hf_model(folder: Path, dtype: torch.dtype = torch.float32) -> Any:
    import transformers

    # `dtype=` (transformers >= 4.56; `torch_dtype=` before) keeps what the model keeps in float32 (DeepSeek's router)
    key = "dtype" if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (4, 56) else "torch_dtype"
    return transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager",
                                                             **{key: dtype}).eval()


def hf_greedy(model: Any, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the logits [new_tokens, V] float32 that chose them (full forward)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        toks = out[0, len(prompt):].tolist()
        logits = model(out[:, :-1]).logits[0, len(prompt) - 1 :].float()
    return toks, logits


if __name__ == "__main__":  # python -m tests.runtime.pretrained.hf_tiny DIR: every family's checkpoint under DIR
    import sys

    for name in FAMILIES:
        build_checkpoint(name, Path(sys.argv[1]) / name)
