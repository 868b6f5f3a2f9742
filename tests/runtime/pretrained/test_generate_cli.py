"""`tierplan generate` and `tierplan check exact --model` on transformers-saved checkpoints.

generate returns the token ids transformers' greedy `generate` returns (float32), batches prompts, reads the
folder's tokenizer, stops at eos like transformers; bad input is one `error:` line and exit code 2.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from tests.runtime.pretrained.hf_tiny import FAMILIES, SENTENCES, hf_greedy
from tierplan.api.cli import app

pytest.importorskip("transformers")
runner = CliRunner()
PROMPTS = ["5,9,3,17,22,4,8,11,30,2", "7,1,40"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_matches_transformers_greedy(family: str, checkpoints: dict[str, Path],
                                              references: dict[str, Any]) -> None:
    args = ["generate", "--model", str(checkpoints[family]), "--max-new-tokens", "8", "--json", "--resident-frac",
            "0.25"]  # a quarter of the experts in slots: loaded on demand, the same tokens
    r = runner.invoke(app, [*args, *(x for p in PROMPTS for x in ("--prompt-ids", p))])
    assert r.exit_code == 0, r.output
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(lines) == len(PROMPTS)
    for p, line in zip(PROMPTS, lines, strict=True):
        ids = [int(x) for x in p.split(",")]
        assert line["prompt_ids"] == ids
        assert line["output_ids"] == hf_greedy(references[family], ids, 8)[0]
        assert isinstance(line["text"], str)


def test_generate_text_prompt_and_eos(checkpoints: dict[str, Path], references: dict[str, Any],
                                      tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    folder = checkpoints["olmoe"]
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tok.encode(SENTENCES[0]).ids
    want = hf_greedy(references["olmoe"], ids, 8)[0]
    r = runner.invoke(app, ["generate", "--model", str(folder), "--prompt", SENTENCES[0], "--max-new-tokens", "8",
                            "--json"])
    assert r.exit_code == 0, r.output
    line = json.loads(r.stdout)
    assert line["prompt_ids"] == ids and line["output_ids"] == want and line["text"] == tok.decode(want)
    assert len(line["text"].split()) == len(want)  # every generated id is a word of the tokenizer
    # eos = the third generated token: transformers stops there, and so does generate
    eos_folder = tmp_path / "eos"
    shutil.copytree(folder, eos_folder)
    cfg = json.loads((eos_folder / "config.json").read_text())
    (eos_folder / "config.json").write_text(json.dumps({**cfg, "eos_token_id": want[2]}))
    with torch.no_grad():
        hf_out = references["olmoe"].generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                              eos_token_id=want[2], pad_token_id=0)[0, len(ids):].tolist()
    r = runner.invoke(app, ["generate", "--model", str(eos_folder), "--prompt-ids", ",".join(map(str, ids)),
                            "--max-new-tokens", "8", "--json"])
    assert json.loads(r.stdout)["output_ids"] == hf_out == want[: want.index(want[2]) + 1]


@pytest.mark.parametrize(("args", "message"), [
    (["--prompt-ids", "1,x"], "--prompt-ids '1,x'"),
    (["--prompt-ids", "1,500"], "token id 500 outside the vocabulary"),
    ([], "give --prompt TEXT or --prompt-ids"),
    (["--prompt-ids", "1", "--dtype", "int4"], "dtype must be one of"),
    (["--prompt-ids", "1", "--max-new-tokens", "300"], "max_position_embeddings is 256"),
])
def test_generate_bad_input_is_one_error_line(args: list[str], message: str, checkpoints: dict[str, Path]) -> None:
    r = runner.invoke(app, ["generate", "--model", str(checkpoints["mixtral"]), *args])
    assert r.exit_code == 2 and message in r.stderr and "Traceback" not in r.output, r.output


def test_generate_refuses_a_truncated_checkpoint_without_traceback(checkpoints: dict[str, Path],
                                                                    tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(checkpoints["qwen3_moe"], folder)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:-4096])
    r = runner.invoke(app, ["generate", "--model", str(folder), "--prompt-ids", "1,2"])
    assert r.exit_code == 2 and "truncated safetensors file" in r.stderr and "Traceback" not in r.output


def test_check_exact_on_a_checkpoint(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    r = runner.invoke(app, ["check", "exact", "--model", str(checkpoints["mixtral"]), "--workdir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert r.output.strip().splitlines()[-1] == "exact: max_abs_diff=0.0 tokens_equal=True ok"
    r = runner.invoke(app, ["check", "exact", "--model", str(checkpoints["mixtral"]), "--layers", "1"])
    assert r.exit_code == 2 and "--model runs the whole checkpoint" in r.output
