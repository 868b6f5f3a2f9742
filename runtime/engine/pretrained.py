"""Build a reference engine from a local Hugging Face checkpoint folder (inference process, load time).

`read_pretrained` checks the folder (config keys through the family adapter, weight files, every tensor's name
and shape from the headers alone) before anything is allocated; `load_pretrained` then streams the routed
experts one at a time from the memory-mapped files into the engine's pinned or NVMe store (no second full copy
in memory) and puts the dense weights on the device, converted to the engine's dtype: the config's unless
the caller asks for another. Never downloads: the folder is a path the user gives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tierplan.runtime.device import Device
from tierplan.runtime.engine.checkpoint import Checkpoint
from tierplan.runtime.engine.config import ModelSpec
from tierplan.runtime.engine.families import family_for
from tierplan.runtime.engine.families.base import Family
from tierplan.runtime.engine.hf_config import load_hf_config
from tierplan.runtime.engine.hf_config import read_json as read_config_json
from tierplan.runtime.engine.weights import DenseWeights, LayerWeights, _attn_shapes, expert_format
from tierplan.runtime.errors import ConfigError
from tierplan.runtime.weights.format import ExpertFormat, dtype_from_name

if TYPE_CHECKING:
    from tierplan.runtime.engine.engine import EngineConfig, ReferenceEngine

ENGINE_DTYPES = ("float32", "bfloat16", "float16")
_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


@dataclass
class PretrainedModel:
    """A checked checkpoint folder: its spec (dtype included), family, config and open weight files."""

    folder: Path
    spec: ModelSpec
    family: Family
    config: dict[str, Any]
    checkpoint: Checkpoint
    eos_token_ids: tuple[int, ...]

    @property
    def attention_bias(self) -> bool:
        return bool(self.config.get("attention_bias", False))

    @property
    def tied(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))


def _config_dtype(cfg: dict[str, Any], ckpt: Checkpoint, source: str) -> str:
    """The config's dtype (transformers 5 `dtype`, 4 `torch_dtype`), else the embedding tensor's."""
    for key in ("dtype", "torch_dtype"):
        if cfg.get(key) is not None:
            if cfg[key] not in ENGINE_DTYPES:
                raise ConfigError(f"{source}: field '{key}' must be one of {list(ENGINE_DTYPES)}, got {cfg[key]!r}")
            return cfg[key]
    st = ckpt.dtype_of("model.embed_tokens.weight") if "model.embed_tokens.weight" in ckpt else "F32"
    return _ST_DTYPES.get(st, "float32")


def _eos_ids(folder: Path, cfg: dict[str, Any]) -> tuple[int, ...]:
    """eos ids of generation_config.json (what transformers' generate stops at), else of config.json."""
    gen = folder / "generation_config.json"
    eos = cfg.get("eos_token_id")
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id", eos)
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            raise ConfigError(f"{gen}: not a valid JSON object ({e})") from None
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool))


def _expected(model: PretrainedModel) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every dense tensor the engine reads: our name -> (checkpoint name, shape)."""
    spec, fam = model.spec, model.family
    h, v = spec.hidden_size, spec.vocab_size
    out = {"embed": ("model.embed_tokens.weight", (v, h)), "final_norm": ("model.norm.weight", (h,))}
    if not model.tied:
        out["lm_head"] = ("lm_head.weight", (v, h))
    attn = _attn_shapes(spec)
    moe = set(spec.moe_layers)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        names = fam.layer_names(i, i in moe) | {"input_norm": p + "input_layernorm.weight",
                                                "post_attn_norm": p + "post_attention_layernorm.weight"}
        names |= {f"attn.{k}": f"{p}self_attn.{k}.weight" for k in attn}
        names |= {f"attn.{k}.bias": f"{p}self_attn.{k}.bias" for k in fam.bias_projections}
        want = {"input_norm": (h,), "post_attn_norm": (h,)} | {f"attn.{k}": s for k, s in attn.items()}
        if model.attention_bias:
            want |= {f"attn.{k}.bias": (attn[k][0],) for k in fam.bias_projections if k in attn}
        if i in moe:
            want["router"] = (spec.num_experts, h)
            if fam.router_bias:
                names["router_bias"] = names["router"].removesuffix(".weight") + ".e_score_correction_bias"
                want["router_bias"] = (spec.num_experts,)
            if spec.num_shared_experts:
                s = spec.shared_intermediate
                want |= {"shared.gate_proj": (s, h), "shared.up_proj": (s, h), "shared.down_proj": (h, s)}
        else:
            d = spec.dense_intermediate
            want |= {"dense.gate_proj": (d, h), "dense.up_proj": (d, h), "dense.down_proj": (h, d)}
        for k, s in want.items():
            out[f"layers.{i}.{k}"] = (names[k], s)
    return out


def _check_experts(model: PretrainedModel, fmt: ExpertFormat) -> None:
    """Every routed expert's tensors present at the right shape (headers only), before any store is built."""
    shapes = [t.shape for t in fmt.tensors]
    for layer in model.spec.moe_layers:
        for e in range(model.spec.num_experts):
            for name, shape in zip(model.family.expert_names(layer, e), shapes, strict=True):
                model.checkpoint.check(name, shape)


def read_pretrained(folder: str | Path, dtype: str | None = None) -> PretrainedModel:
    """Check a checkpoint folder (config, weight files, every tensor's name and shape); nothing allocated."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{folder}: not a folder (expected a checkpoint folder with config.json and *.safetensors)")
    try:
        (folder / "config.json").read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{folder}: no config.json (expected a Hugging Face checkpoint folder)") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{folder / 'config.json'}: not UTF-8 text (byte {e.start})") from None
    cfg, source, _ = read_config_json(folder)  # refuses bad JSON
    family = family_for(cfg.get("model_type"), source)
    changes = family.validate(cfg, source)
    # The shape parser reads the file itself (errors name it), or the family's normalized copy (DeepSeek).
    spec = load_hf_config(family.normalize(cfg) if family.normalize is not None else folder, name=folder.resolve().name)
    if dtype is not None and dtype not in ENGINE_DTYPES:
        raise ConfigError(f"dtype must be one of {list(ENGINE_DTYPES)}, got {dtype!r}")
    ckpt = Checkpoint(folder)
    spec = spec.with_(dtype=dtype or _config_dtype(cfg, ckpt, source), checkpoint=str(folder.resolve()), **changes)
    model = PretrainedModel(folder, spec, family, cfg, ckpt, _eos_ids(folder, cfg))
    for name, shape in _expected(model).values():
        ckpt.check(name, shape)
    if model.tied and "lm_head.weight" in ckpt:
        ckpt.mark_used("lm_head.weight")  # transformers ties it to the embedding whatever the file holds
    _check_experts(model, expert_format(spec))
    if family.skipped_layers is not None:  # transformers does not build them either (greedy decoding skips MTP)
        n = spec.num_layers
        extra = tuple(f"model.layers.{i}." for i in range(n, n + family.skipped_layers(cfg)))
        for name in [m for m in ckpt.names if m.startswith(extra)] if extra else ():
            ckpt.mark_used(name)
    ckpt.check_all_used(family.ignorable_tensors)
    return model


def load_dense(model: PretrainedModel, device: torch.device) -> DenseWeights:
    """The dense weights on `device` in the spec's dtype (one tensor read at a time)."""
    dt = dtype_from_name(model.spec.dtype)
    fam = model.family
    fix = fam.fix_tensor if fam.fix_when is None or fam.fix_when(model.config) else None
    loaded: dict[str, torch.Tensor] = {}
    for ours, (name, shape) in _expected(model).items():
        fp32 = model.family.router_fp32 and ours.endswith((".router", ".router_bias"))
        t = model.checkpoint.get(name, shape, torch.float32 if fp32 else dt)
        loaded[ours] = (fix(ours, t, model.spec) if fix is not None else t).contiguous().to(device)
    w = DenseWeights(loaded["embed"], loaded["final_norm"], loaded["lm_head"] if not model.tied else loaded["embed"])
    for i in range(model.spec.num_layers):
        p = f"layers.{i}."

        def part(group: str, p: str = p) -> dict[str, torch.Tensor] | None:
            d = {k[len(p + group) + 1 :]: t for k, t in loaded.items() if k.startswith(f"{p}{group}.")}
            return d or None

        w.layers.append(LayerWeights(loaded[p + "input_norm"], loaded[p + "post_attn_norm"], part("attn") or {},
                                     loaded.get(p + "router"), part("shared"), part("dense"),
                                     loaded.get(p + "router_bias")))
    return w


class CheckpointExpertSource:
    """Routed experts read from the checkpoint one at a time and packed into store records (ExpertSource)."""

    def __init__(self, model: PretrainedModel, fmt: ExpertFormat) -> None:
        self.model, self.format = model, fmt
        self.num_layers, self.num_experts = model.spec.num_moe_layers, model.spec.num_experts
        self._dtype = dtype_from_name(model.spec.dtype)

    def fill(self, layer: int, expert: int, out: torch.Tensor) -> None:
        names = self.model.family.expert_names(self.model.spec.moe_layers[layer], expert)
        tensors = {t.name: self.model.checkpoint.get(n, t.shape, self._dtype)
                   for t, n in zip(self.format.tensors, names, strict=True)}
        self.format.pack(tensors, out)


@dataclass
class CheckpointWeights:
    """What the engine builds from a checkpoint instead of synthetic weights."""

    dense: DenseWeights
    experts: CheckpointExpertSource


def engine_config_for(spec: ModelSpec, cfg: EngineConfig) -> EngineConfig:
    """`cfg`, with the paged decode kernel and CUDA graphs off for a sliding window (they attend to everything)."""
    return replace(cfg, decode_kernel=False, decode_graphs=False) if spec.sliding_window else cfg


def checkpoint_weights(spec: ModelSpec, device: Device, cfg: EngineConfig) -> CheckpointWeights:
    """Dense weights on the device and the expert source of the checkpoint `spec.checkpoint` (ReferenceEngine)."""
    model = read_pretrained(spec.checkpoint, spec.dtype)
    if model.spec != spec:
        diff = sorted(k for k, v in spec.to_dict().items() if model.spec.to_dict()[k] != v)
        raise ConfigError(f"ModelSpec {spec.name!r} differs from its checkpoint {spec.checkpoint} in field(s) {diff} "
                          "(a checkpoint runs whole, at its own shapes)")
    if cfg.experts_on_device:
        raise ConfigError("EngineConfig.experts_on_device draws synthetic experts; it cannot load a checkpoint")
    if spec.sliding_window and device.is_cuda and (cfg.decode_kernel is not False or cfg.decode_graphs is not False):
        raise ConfigError(f"{spec.name}: sliding_window={spec.sliding_window} needs EngineConfig(decode_kernel=False, "
                          "decode_graphs=False) on CUDA (the paged decode kernel attends to the whole context); "
                          "from_pretrained and tierplan generate set them")
    return CheckpointWeights(load_dense(model, device.torch_device), CheckpointExpertSource(model, expert_format(spec)))


def load_pretrained(folder: str | Path | PretrainedModel, device: Device, cfg: EngineConfig,
                    dtype: str | None = None) -> ReferenceEngine:
    """A ReferenceEngine running the checkpoint in `folder`; experts streamed into the configured store."""
    from tierplan.runtime.engine.engine import ReferenceEngine

    model = folder if isinstance(folder, PretrainedModel) else read_pretrained(folder, dtype)
    return ReferenceEngine(model.spec, device, engine_config_for(model.spec, cfg))
