"""`tierplan generate`: greedy text from a local Hugging Face checkpoint folder on the reference engine.

Runs in the user's shell (CPU twin or one GPU). Prompts come as text (the folder's own `tokenizer.json`,
read offline with `tokenizers`) or as token ids; several prompts decode together in one batch. Like
transformers' greedy `generate`, a sequence stops at the checkpoint's eos token (kept in the output). Bad
input prints `error: ...` and exits 2. Heavy modules are imported inside the command; nothing at import.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from tierplan.runtime.errors import ConfigError


def parse_ids(text: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3]; refuses anything else by quoting it."""
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--prompt-ids {text!r}: expected comma-separated token ids, e.g. 1,2,3") from None
    if not ids:
        raise ConfigError(f"--prompt-ids {text!r}: no token ids")
    return ids


def load_tokenizer(folder: Path) -> Any | None:
    """The folder's tokenizer.json (tokenizers), or None when there is none."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for a bad file
        raise ConfigError(f"{path}: cannot read the tokenizer ({e})") from None


def cut_at_eos(tokens: list[int], eos: tuple[int, ...]) -> list[int]:
    """Tokens up to and including the first eos (what transformers' generate returns for this sequence)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def generate_ids(folder: Path, prompts: list[list[int]], max_new_tokens: int, dtype: str | None,
                 resident_frac: float, device: str) -> tuple[list[list[int]], tuple[int, ...]]:
    """Greedy output ids per prompt (cut at eos) and the eos ids, from one batched engine run."""
    from tierplan.runtime.device import Device
    from tierplan.runtime.engine.engine import EngineConfig
    from tierplan.runtime.engine.pretrained import load_pretrained, read_pretrained
    from tierplan.runtime.selfcheck.exact import auto_block_tokens

    model = read_pretrained(folder, dtype)
    spec = model.spec
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > spec.max_position_embeddings:
        raise ConfigError(f"prompt + --max-new-tokens is {longest} tokens; the model's max_position_embeddings is "
                          f"{spec.max_position_embeddings}")
    bt = auto_block_tokens(spec)
    blocks = sum(-(-(len(p) + max_new_tokens) // bt) for p in prompts)
    cfg = EngineConfig(resident_frac=resident_frac, block_tokens=bt, kv_gpu_blocks=blocks)
    engine = load_pretrained(model, Device(device), cfg)
    try:
        result = engine.generate(prompts, max_new_tokens)
    finally:
        engine.close()
    return [cut_at_eos(t, model.eos_token_ids) for t in result.tokens], model.eos_token_ids


def register(app: typer.Typer) -> None:
    """Add `generate` to `app` (called from api.cli)."""

    @app.command()
    def generate(
        model: Annotated[Path, typer.Option(help="A local checkpoint folder: config.json, *.safetensors, "
                                                 "tokenizer.json.")],
        prompt: Annotated[list[str] | None, typer.Option(help="Prompt text (repeat for a batch).")] = None,
        prompt_ids: Annotated[list[str] | None, typer.Option(help="Prompt token ids, e.g. 1,2,3 (repeat for a "
                                                                  "batch).")] = None,
        max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens generated per prompt.")] = 32,
        dtype: Annotated[str | None, typer.Option(help="float32, bfloat16 or float16 (default: the config's).")]
        = None,
        resident_frac: Annotated[float, typer.Option(min=0.0, max=1.0, help="Fraction of experts with a slot.")]
        = 1.0,
        device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
        as_json: Annotated[bool, typer.Option("--json", help="One JSON line per prompt: prompt_ids, output_ids, "
                                                             "text.")] = False,
    ) -> None:
        """Greedy generation from a local Hugging Face checkpoint (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V2)."""
        try:
            if device not in ("cpu", "cuda"):
                raise ConfigError(f"--device must be cpu or cuda, got {device!r}")
            if not prompt and not prompt_ids:
                raise ConfigError("give --prompt TEXT or --prompt-ids 1,2,3 (each may repeat)")
            tok = load_tokenizer(model) if model.is_dir() else None
            if prompt and tok is None:
                raise ConfigError(f"--prompt needs {model / 'tokenizer.json'}; pass --prompt-ids instead")
            ids = [tok.encode(p).ids for p in prompt or []] + [parse_ids(p) for p in prompt_ids or []]
            if any(not p for p in ids):
                raise ConfigError("a --prompt encodes to no tokens")
            outs, _ = generate_ids(model, ids, max_new_tokens, dtype, resident_frac, device)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise typer.Exit(2) from None
        for p, o in zip(ids, outs, strict=True):
            text = tok.decode(o) if tok is not None else None
            if as_json:
                print(json.dumps({"prompt_ids": p, "output_ids": o, "text": text}))
            else:
                print(text if text is not None else ",".join(map(str, o)))
