"""A checkpoint folder the engine cannot run faithfully is refused with a message that names the problem.

Config keys: every key of each family's transformers config is implemented, inert or refused (a test walks
the full config); an unknown key, an unsupported value or architecture is refused by name. Weights: no
files, a missing tensor, a wrong shape, a truncated file, a tensor the engine would drop.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.runtime.pretrained.hf_tiny import FAMILIES
from tierplan.runtime.device import Device
from tierplan.runtime.engine.engine import EngineConfig, ReferenceEngine
from tierplan.runtime.engine.families import SUPPORTED, family_for
from tierplan.runtime.engine.pretrained import read_pretrained
from tierplan.runtime.errors import ConfigError

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", SUPPORTED)
def test_every_config_key_is_implemented_inert_or_refused(family: str) -> None:
    fam = family_for(family, "test")
    assert not (fam.implemented & fam.inert) and not (fam.implemented & fam.refused) and not (fam.inert & fam.refused)
    cfg = getattr(transformers, FAMILIES[family][0])().to_dict()
    assert set(cfg) - fam.all_keys == set()


def copy_of(src: Path, dst: Path, **config_changes: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in config_changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(("family", "changes", "named"), [
    ("qwen3_moe", {"model_type": "llama"}, "'llama'"),
    ("mixtral", {"frobnicate_heads": 3}, "frobnicate_heads"),
    ("olmoe", {"hidden_act": "gelu"}, "hidden_act"),
    ("qwen3_moe", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_parameters"),
    ("mixtral", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ("qwen3_moe", {"max_window_layers": 1}, "max_window_layers"),
    ("olmoe", {"dtype": "float8_e4m3fn"}, "dtype"),
    ("olmoe", {"attention_bias": "yes"}, "attention_bias"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method"),
    ("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob"),
    ("deepseek_v2", {"mlp_bias": True}, "mlp_bias"),
    ("deepseek_v3", {"topk_method": "greedy"}, "topk_method"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func"),
    ("deepseek_v3", {"n_group": 16}, "n_group"),
    ("deepseek_v3", {"rope_interleave": "yes"}, "rope_interleave"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
])
def test_unsupported_config_is_refused_by_name(family: str, changes: dict[str, object], named: str,
                                                checkpoints: dict[str, Path], tmp_path: Path) -> None:
    folder = copy_of(checkpoints[family], tmp_path / "m", **changes)
    with pytest.raises(ConfigError, match=named):
        read_pretrained(folder)


def test_folder_without_config_or_with_a_binary_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no config\.json"):
        read_pretrained(tmp_path)
    (tmp_path / "config.json").write_bytes(b'{"model_type": "\xff"}')
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_pretrained(tmp_path)


def test_folder_without_weights(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    folder = copy_of(checkpoints["mixtral"], tmp_path / "m")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"no \*\.safetensors weight files; found \['pytorch_model.bin'\]"):
        read_pretrained(folder)


def test_shape_mismatch_names_the_tensor(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    folder = copy_of(checkpoints["qwen3_moe"], tmp_path / "m", moe_intermediate_size=16)
    with pytest.raises(ConfigError, match=r"tensor 'model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight' has shape "
                                          r"\[32, 64\], expected \[16, 64\]"):
        read_pretrained(folder)


def test_truncated_file(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    folder = copy_of(checkpoints["olmoe"], tmp_path / "m")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(ConfigError, match="truncated safetensors file"):
        read_pretrained(folder)


def test_tensor_the_engine_would_drop(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    folder = copy_of(checkpoints["olmoe"], tmp_path / "m", attention_bias=False)  # the file still has biases
    with pytest.raises(ConfigError, match=r"self_attn\.k_proj\.bias.* not used by the engine"):
        read_pretrained(folder)


def test_missing_tensor(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tied = copy_of(checkpoints["mixtral"], tmp_path / "tied", tie_word_embeddings=True)
    read_pretrained(tied)  # lm_head.weight in the file is not dropped silently: transformers ties it too
    folder = copy_of(checkpoints["mixtral"], tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"tensor 'model\.layers\.1\.block_sparse_moe\.experts\.5\.w3\.weight' "
                                          "not found in the checkpoint"):
        read_pretrained(folder)


def test_checkpoint_dtype_is_the_default_and_bf16_files_load(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    import torch

    from tests.runtime.pretrained.hf_tiny import build_checkpoint

    folder = build_checkpoint("mixtral", tmp_path / "bf16", dtype=torch.bfloat16)
    assert read_pretrained(folder).spec.dtype == "bfloat16"
    assert read_pretrained(folder, "float32").spec.dtype == "float32"  # an explicit conversion
    eng = ReferenceEngine.from_pretrained(folder, Device("cpu"), EngineConfig(block_tokens=32, kv_gpu_blocks=4))
    try:
        assert len(eng.generate([[1, 2, 3]], 2).tokens[0]) == 2
    finally:
        eng.close()


def test_sharded_checkpoint_with_index_loads_the_same(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from tests.runtime.pretrained.hf_tiny import build_checkpoint

    folder = build_checkpoint("olmoe", tmp_path / "sharded", max_shard_size="50KB")
    assert len(list(folder.glob("*.safetensors"))) > 1 and (folder / "model.safetensors.index.json").is_file()
    runs = []
    for f in (checkpoints["olmoe"], folder):
        eng = ReferenceEngine.from_pretrained(f, Device("cpu"), EngineConfig(block_tokens=32, kv_gpu_blocks=4))
        try:  # the same bytes: every dense tensor, every expert record in the pinned store
            dense = [t.clone() for lw in eng.model.w.layers for t in lw.attn.values()] + [eng.model.w.lm_head.clone()]
            runs.append((dense, eng.pinned.buffer.clone()))  # type: ignore[union-attr]
        finally:
            eng.close()
    assert all(a.equal(b) for a, b in zip(runs[0][0], runs[1][0], strict=True)) and runs[0][1].equal(runs[1][1])
    (folder / next(folder.glob("*.safetensors")).name).unlink()
    with pytest.raises(ConfigError, match="names weight file"):
        read_pretrained(folder)


def test_checkpoint_spec_fields_are_checked_and_round_trip(checkpoints: dict[str, Path]) -> None:
    from tierplan.runtime.engine.config import ModelSpec

    spec = read_pretrained(checkpoints["deepseek_v2_qlora_yarn_groups"]).spec
    assert spec.rope_scaling and (spec.num_expert_groups, spec.topk_groups) == (4, 2) and spec.q_lora_rank == 24
    assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    for bad, named in [({"sliding_window": -1}, "sliding_window"), ({"clip_qkv": float("inf")}, "clip_qkv"),
                       ({"num_expert_groups": 3}, "num_expert_groups"), ({"rope_scaling": [("factor", "x")]},
                                                                         "rope_scaling")]:
        with pytest.raises(ConfigError, match=named):
            spec.with_(**bad)


def test_a_spec_changed_from_its_checkpoint_is_refused(checkpoints: dict[str, Path]) -> None:
    spec = read_pretrained(checkpoints["mixtral"]).spec
    cfg = EngineConfig(block_tokens=32, kv_gpu_blocks=4)
    for changed, named in [(spec.truncated(1), "num_layers"), (spec.with_(rms_norm_eps=1e-3), "rms_norm_eps")]:
        with pytest.raises(ConfigError, match=rf"differs from its checkpoint .*{named!r}"):
            ReferenceEngine(changed, Device("cpu"), cfg)
    with pytest.raises(ConfigError, match="experts_on_device"):
        ReferenceEngine(spec, Device("cpu"), EngineConfig(block_tokens=32, kv_gpu_blocks=4, experts_on_device=True))


def test_deepseek_v3_own_config_keys_and_mtp_layers_load(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """DeepSeek's own V3 config.json keys (at the values transformers assumes) are accepted, and the
    multi-token-prediction layer's tensors after the last layer are skipped as transformers skips them."""
    from safetensors.torch import load_file, save_file

    folder = copy_of(checkpoints["deepseek_v3"], tmp_path / "v3", topk_method="noaux_tc", scoring_func="sigmoid",
                     moe_layer_freq=1, ep_size=1, aux_loss_alpha=0.001, seq_aux=True, num_nextn_predict_layers=1)
    tensors = load_file(folder / "model.safetensors")
    n = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    mtp = {f"model.layers.{n}.eh_proj.weight": tensors["model.embed_tokens.weight"][:4].clone()}
    save_file(tensors | mtp, folder / "model.safetensors", metadata={"format": "pt"})
    assert read_pretrained(folder).spec.router_scoring == "sigmoid"
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    with pytest.raises(ConfigError, match=f"model.layers.{n}.eh_proj.weight"):  # no MTP layer declared: not dropped
        read_pretrained(folder)
