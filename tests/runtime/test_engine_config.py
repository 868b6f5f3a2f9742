"""Model configs of the reference engine: HF config.json parsing, presets at true shapes, and every refusal."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from tierplan.runtime.engine.config import AttentionKind, ModelFamily, ModelSpec
from tierplan.runtime.engine.hf_config import load_hf_config
from tierplan.runtime.engine.presets import PRESETS, preset, preset_names
from tierplan.runtime.errors import ConfigError


def cfg(name: str, **changes: Any) -> dict[str, Any]:
    """A deep copy of preset `name`'s config dict with `changes` applied (a value of ... deletes the key)."""
    out = copy.deepcopy(PRESETS[name])
    for key, value in changes.items():
        if value is ...:
            del out[key]
        else:
            out[key] = value
    return out


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_parses_and_round_trips_through_json(name: str) -> None:
    spec = preset(name)
    assert spec.name == name
    assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert spec.top_k <= spec.num_experts and spec.num_heads % spec.num_kv_heads == 0


def test_preset_names_cover_the_four_families_and_tiny() -> None:
    assert preset_names() == ["deepseek-v2-lite", "mixtral-8x7b", "olmoe-1b-7b", "qwen3-30b-a3b", "tiny"]
    assert {preset(n).family for n in preset_names()} == set(ModelFamily)


def test_qwen3_30b_a3b_shapes() -> None:
    s = preset("qwen3-30b-a3b")
    assert s.family == "qwen3_moe" and s.attention is AttentionKind.GQA
    assert (s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim) == (2048, 48, 32, 4, 128)
    assert (s.num_experts, s.top_k, s.expert_intermediate, s.dense_intermediate) == (128, 8, 768, 6144)
    assert s.moe_layers == tuple(range(48)) and s.dense_layers == ()
    assert s.norm_topk_prob and s.qk_norm and s.qk_norm_per_head
    assert s.expert_bytes == 3 * 2048 * 768 * 2 == 9437184
    assert s.kv_bytes_per_token == 2 * 4 * 128 * 2
    assert (s.rope_theta, s.rms_norm_eps, s.max_position_embeddings, s.vocab_size) == (1e6, 1e-6, 40960, 151936)


def test_mixtral_8x7b_shapes() -> None:
    s = preset("mixtral-8x7b")
    assert s.expert_bytes == 3 * 4096 * 14336 * 2 == 352321536
    assert (s.num_experts, s.top_k, s.num_kv_heads, s.head_dim) == (8, 2, 8, 128)
    assert s.moe_layers == tuple(range(32)) and s.dense_intermediate == 0
    assert s.norm_topk_prob and not s.qk_norm


def test_deepseek_v2_lite_shapes() -> None:
    s = preset("deepseek-v2-lite")
    assert s.attention is AttentionKind.MLA
    assert s.moe_layers == tuple(range(1, 27)) and s.dense_layers == (0,)
    assert s.kv_bytes_per_token == (512 + 64) * 2
    assert (s.num_shared_experts, s.shared_intermediate) == (2, 2816)
    assert (s.num_experts, s.top_k, s.expert_intermediate, s.dense_intermediate) == (64, 6, 1408, 10944)
    assert (s.head_dim, s.q_lora_rank, s.v_head_dim, s.qk_nope_head_dim) == (192, 0, 128, 128)
    assert not s.norm_topk_prob and not s.qk_norm and s.routed_scaling_factor == 1.0
    assert isinstance(s.rope_theta, float)  # the config writes the int 10000


def test_olmoe_shapes() -> None:
    s = preset("olmoe-1b-7b")
    assert s.moe_layers == tuple(range(16)) and s.num_moe_layers == 16
    assert (s.num_experts, s.top_k, s.expert_intermediate, s.head_dim) == (64, 8, 1024, 128)
    assert s.qk_norm and not s.qk_norm_per_head and not s.norm_topk_prob


def test_tiny_is_cpu_sized() -> None:
    s = preset("tiny")
    assert (s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim) == (64, 2, 4, 2, 16)
    assert s.expert_bytes == 3 * 64 * 32 * 2


def test_reads_a_config_json_file_and_a_folder(tmp_path: Path) -> None:
    folder = tmp_path / "Qwen3-30B-A3B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(PRESETS["qwen3-30b-a3b"]))
    from_file = load_hf_config(folder / "config.json")
    from_folder = load_hf_config(str(folder), name="q")
    assert from_file.name == "Qwen3-30B-A3B" and from_folder.name == "q"
    assert from_file.with_(name="q") == from_folder == preset("qwen3-30b-a3b").with_(name="q")


def test_file_errors_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json .*not valid JSON at line 1"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(cfg("mixtral-8x7b", num_local_experts="8")))
    with pytest.raises(ConfigError) as info:
        load_hf_config(tmp_path)
    path = tmp_path / "config.json"
    assert str(info.value) == f"config.json ({path}): field 'num_local_experts' must be an int >= 1, got '8'"


def test_truncated_keeps_shapes() -> None:
    full = preset("deepseek-v2-lite")
    two = full.truncated(2)
    assert two.name == "deepseek-v2-lite@2L" and two.num_layers == 2 and two.moe_layers == (1,)
    assert two.expert_bytes == full.expert_bytes and two.kv_bytes_per_token == full.kv_bytes_per_token
    assert two == full.with_(name="deepseek-v2-lite@2L", num_layers=2, moe_layers=(1,))
    assert two.truncated(1).name == "deepseek-v2-lite@1L" and two.truncated(1).moe_layers == ()
    assert preset("qwen3-30b-a3b", num_layers=2).name == "qwen3-30b-a3b@2L"
    with pytest.raises(ConfigError, match=r"truncated\(num_layers\) must be an int in 1..num_layers \(27\), got 0"):
        full.truncated(0)


def test_qwen3_sparse_step_and_mlp_only_layers() -> None:
    s = load_hf_config(cfg("tiny", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert s.moe_layers == (1, 5) and s.dense_layers == (0, 2, 3, 4) and s.dense_intermediate == 128


@pytest.mark.parametrize(
    ("name", "changes", "message"),
    [
        ("qwen3-30b-a3b", {"hidden_size": ...}, "missing required field 'hidden_size'"),
        ("deepseek-v2-lite", {"q_lora_rank": ...}, "missing required field 'q_lora_rank'"),
        ("olmoe-1b-7b", {"vocab_size": "50304"}, "field 'vocab_size' must be an int >= 1, got '50304'"),
        ("olmoe-1b-7b", {"num_hidden_layers": 16.0}, "field 'num_hidden_layers' must be an int >= 1, got 16.0"),
        ("olmoe-1b-7b", {"norm_topk_prob": 1}, "field 'norm_topk_prob' must be true or false, got 1"),
        ("mixtral-8x7b", {"rope_theta": "1e6"}, "field 'rope_theta' must be a finite number > 0, got '1e6'"),
        ("tiny", {"rms_norm_eps": float("nan")}, "field 'rms_norm_eps' must be a finite number > 0, got nan"),
        ("tiny", {"rope_theta": float("inf")}, "field 'rope_theta' must be a finite number > 0, got inf"),
        ("tiny", {"mlp_only_layers": [0, 1], "intermediate_size": 128},
         "no MoE layer among the 2 layers (mlp_only_layers, decoder_sparse_step or first_k_dense_replace make"),
        ("tiny", {"model_type": "llama"}, "field 'model_type' must be one of ['qwen3_moe', 'mixtral', 'olmoe', "
         "'deepseek_v2'], got 'llama'"),
        ("qwen3-30b-a3b", {"num_experts_per_tok": 0},
         "field 'num_experts_per_tok' must be an int in 1..num_experts (128), got 0"),
        ("mixtral-8x7b", {"num_experts_per_tok": 9},
         "field 'num_experts_per_tok' must be an int in 1..num_local_experts (8), got 9"),
        ("tiny", {"num_key_value_heads": 3},
         "field 'num_key_value_heads' must be a divisor of num_attention_heads (4), got 3"),
        ("mixtral-8x7b", {"hidden_size": 4097},
         "field 'hidden_size' (4097) must be divisible by 'num_attention_heads' (32) when 'head_dim' is absent"),
        ("deepseek-v2-lite", {"topk_method": "group_limited_greedy"},
         "field 'topk_method' must be 'greedy' (the only topk_method supported yet; group-limited routing is not), "
         "got 'group_limited_greedy'"),
        ("deepseek-v2-lite", {"scoring_func": "sigmoid"}, "field 'scoring_func' must be 'softmax'"),
        ("tiny", {"mlp_only_layers": [2]}, "field 'mlp_only_layers' must be a list of layer indices in 0..1, got [2]"),
        ("tiny", {"mlp_only_layers": [0], "intermediate_size": ...}, "missing required field 'intermediate_size'"),
        ("tiny", {"rope_parameters": {"rope_theta": -1}, "rope_theta": ...},
         "field 'rope_parameters.rope_theta' must be a finite number > 0, got -1"),
    ],
)
def test_config_errors_name_the_field(name: str, changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_hf_config(cfg(name, **changes), name=name)
    assert str(info.value).startswith(f"config dict ({name}): ")
    assert message in str(info.value)


def test_hf_defaults_and_nulls() -> None:
    s = load_hf_config(cfg("olmoe-1b-7b", num_key_value_heads=None, rms_norm_eps=..., rope_theta=..., head_dim=None))
    assert (s.num_kv_heads, s.rms_norm_eps, s.rope_theta, s.head_dim) == (16, 1e-5, 10000.0, 128)
    assert load_hf_config(cfg("tiny", norm_topk_prob=...)).norm_topk_prob is False  # transformers' default
    nested = load_hf_config(cfg("tiny", rope_theta=..., rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    assert nested.rope_theta == 5e5
    assert load_hf_config(cfg("deepseek-v2-lite", n_shared_experts=None)).shared_intermediate == 0


def test_model_spec_validates_every_construction() -> None:
    s = preset("tiny")
    with pytest.raises(ConfigError, match=re.escape("field 'top_k' must be an int in 1..num_experts (8), got 9")):
        s.with_(top_k=9)
    with pytest.raises(ConfigError, match=re.escape("field 'num_kv_heads' must divide num_heads (4), got 3")):
        s.with_(num_kv_heads=3)
    with pytest.raises(ConfigError, match=re.escape("field 'moe_layers' must be ascending, unique and in 0..1")):
        s.with_(moe_layers=(1, 0))
    with pytest.raises(ConfigError, match="field 'kv_lora_rank' is MLA-only"):
        s.with_(kv_lora_rank=4)
    with pytest.raises(ConfigError, match=r"field 'dtype'.*unknown dtype 'bf16'"):
        s.with_(dtype="bf16")
    with pytest.raises(ConfigError, match="field 'family' must be one of"):
        s.with_(family="llama")
    with pytest.raises(ConfigError, match=re.escape("field 'head_dim' must equal qk_nope_head_dim + qk_rope_head_dim")):
        preset("deepseek-v2-lite").with_(head_dim=128)
    with pytest.raises(ConfigError, match="field 'router_scoring' must be one of"):
        s.with_(router_scoring="tanh")
    with pytest.raises(ConfigError, match=r"router_scoring 'sigmoid' .* needs num_expert_groups"):
        s.with_(router_scoring="sigmoid")
    assert s.with_(router_scoring="sigmoid", num_expert_groups=2, topk_groups=1).router_scoring == "sigmoid"
    assert s.with_(dtype="float32").expert_bytes == 2 * s.expert_bytes


def test_from_dict_refuses_unknown_and_missing_fields() -> None:
    d = preset("tiny").to_dict()
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['bogus'\]"):
        ModelSpec.from_dict(d | {"bogus": 1})
    del d["top_k"]
    with pytest.raises(ConfigError, match=r"missing required field\(s\) \['top_k'\]"):
        ModelSpec.from_dict(d)


def test_unknown_preset_lists_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown preset 'qwen'; expected one of \['deepseek-v2-lite'"):
        preset("qwen")
