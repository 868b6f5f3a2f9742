"""A tiny Qwen3-MoE checkpoint made locally for the vLLM tests (test process; no network, no downloads).

`build_tiny_qwen3_moe(dir)` writes a transformers `Qwen3MoeConfig` model (2 layers, 8 experts, top-2, hidden 128,
vocabulary 512) with random weights drawn from a fixed seed, and a byte-level BPE tokenizer trained with the
`tokenizers` package on text held in this file. The same call gives the same files on the same library versions,
so tests comparing runs (with and without a plugin, vLLM against transformers) see one model. Never touches the
network; never writes outside `dir`.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB_SIZE = 512
SEED = 1234
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
# A minimal chat template so the OpenAI server's chat endpoint has one to render.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS_LINES = (
    "The controller arbitrates one memory budget between expert weights and the key value cache.",
    "Inference engineers measure tokens per second, time to first token and the tail of the latency.",
    "A mixture of experts routes every token to two of eight experts chosen by a small gate.",
    "Blocks of the cache move between the device, pinned host memory and a file on fast storage.",
    "Prefix reuse lets a new request skip the prompt tokens that an earlier request already computed.",
    "0123456789 +-*/=<>()[]{} , . ; : ! ? ' \" _ # @ $ % & | ~ ^ ` \\",
    "def forward(self, x):\n    return self.down(self.act(self.gate(x)) * self.up(x))\n",
    "user: how many blocks fit on the cpu tier?\nassistant: as many as the plan allows, never more.",
)


def _corpus() -> list[str]:
    """Deterministic training text: the lines above in several fixed rotations and joins."""
    lines = list(_CORPUS_LINES)
    out = []
    for shift in range(len(lines)):
        rot = lines[shift:] + lines[:shift]
        out.append(" ".join(rot))
        out.append("\n".join(reversed(rot)))
    return out


def _train_tokenizer(out_dir: Path) -> dict[str, int]:
    """Train and save the byte-level BPE tokenizer; returns the ids of the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if tok.get_vocab_size() > VOCAB_SIZE:
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} tokens, more than the model's {VOCAB_SIZE}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, bos_token=None, unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 512
    fast.save_pretrained(out_dir)
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def build_tiny_qwen3_moe(out_dir: str | Path) -> Path:
    """Write the tiny checkpoint (config, bf16 safetensors weights, tokenizer) into `out_dir`; returns it."""
    import torch
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    special = _train_tokenizer(path)
    eos_id = special[EOS_TOKEN]
    config = Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # the CPU attention backend supports 32
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype="bfloat16",
        initializer_range=0.05,  # a little above the default so greedy picks are rarely near-ties
    )
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(SEED)
        model = Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()
    finally:
        torch.random.set_rng_state(rng_state)  # the caller's random stream is left as it was
    model.save_pretrained(path, safe_serialization=True)
    gen = GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False)
    gen.save_pretrained(path)
    (path / "tierplan_tiny.json").write_text(json.dumps({"seed": SEED, "special_token_ids": special}, indent=1))
    return path
