"""Model shapes from Hugging Face config.json: the published parameter counts come out, bad fields are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierplan.controller.model_shape import BUILTIN_CONFIGS, ShapeError, builtin_shape, shape_from_config


@pytest.mark.parametrize(("name", "params_b", "weight_bytes"), [
    ("qwen3-30b-a3b", 30.5, 2), ("qwen3-235b-a22b", 235.1, 2), ("mixtral-8x7b", 46.7, 2), ("deepseek-v3", 671.0, 1)])
def test_builtin_shapes_count_the_published_parameters(name: str, params_b: float, weight_bytes: int) -> None:
    s = builtin_shape(name)
    assert (s.all_expert_bytes + s.dense_bytes) / weight_bytes / 1e9 == pytest.approx(params_b, abs=0.15)


def test_layer_layouts_and_kv_per_family() -> None:
    v3 = builtin_shape("deepseek-v3")
    assert v3.moe_layers == tuple(range(3, 61)) and v3.num_experts == 256 and v3.top_k == 8
    assert v3.kv_bytes_per_token == 61 * (512 + 64) * 2  # MLA: latent + rope key, bf16
    q = builtin_shape("qwen3-235b-a22b")
    assert q.num_moe_layers == 94 and q.expert_bytes == 3 * 4096 * 1536 * 2
    assert q.kv_bytes_per_token == 94 * 2 * 4 * 128 * 2
    assert builtin_shape("mixtral-8x7b").kv_bytes_per_block == 32 * 2 * 8 * 128 * 2 * 16


def test_qwen_sparse_step_and_mlp_only_layers(tmp_path: Path) -> None:
    cfg = dict(BUILTIN_CONFIGS["qwen3-30b-a3b"], num_hidden_layers=8, decoder_sparse_step=2, mlp_only_layers=[3])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    s = shape_from_config(tmp_path)
    assert s.moe_layers == (1, 5, 7) and s.name == tmp_path.name


def test_olmoe_and_dtype_override() -> None:
    cfg = {"model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16,
           "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
           "vocab_size": 50304}
    s = shape_from_config(cfg, name="olmoe", dtype_bytes=4)
    assert s.expert_bytes == 3 * 2048 * 1024 * 4 and s.moe_layers == tuple(range(16))


@pytest.mark.parametrize(("change", "match"), [
    ({"model_type": "llama"}, "model_type"), ({"num_experts": 0}, "num_experts"),
    ({"num_experts_per_tok": None}, "num_experts_per_tok"), ({"torch_dtype": "int3"}, "torch_dtype"),
    ({"mlp_only_layers": [99]}, "mlp_only_layers")])
def test_bad_fields_are_refused_by_name(change: dict[str, object], match: str) -> None:
    cfg = {k: v for k, v in dict(BUILTIN_CONFIGS["qwen3-30b-a3b"], **change).items() if v is not None}
    with pytest.raises(ShapeError, match=match):
        shape_from_config(cfg)


def test_missing_or_broken_files(tmp_path: Path) -> None:
    with pytest.raises(ShapeError, match="no such file"):
        shape_from_config(tmp_path / "nope.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ShapeError, match="not valid JSON"):
        shape_from_config(tmp_path / "config.json")
    with pytest.raises(ShapeError, match="unknown preset"):
        builtin_shape("gpt-5")
