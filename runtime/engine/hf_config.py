"""Reading a Hugging Face `config.json` into the engine's `ModelSpec` (inference process, at build time).

`load_hf_config` takes a config.json file, a folder holding one, or the dict itself, for Qwen3-MoE, Mixtral,
OLMoE and DeepSeek-V2: shape fields must be present; behaviour fields that real configs sometimes omit
(`rms_norm_eps`, `rope_theta`, `norm_topk_prob`, ...) fall back to the transformers class defaults of the
family. Every refusal names the source, the field, what was expected and what was got. Pure description:
never allocates tensors, never reads anything but the one config file, never touches a hub.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tierplan.runtime.engine.config import (
    SUPPORTED_FAMILIES,
    AttentionKind,
    ModelFamily,
    ModelSpec,
    is_int,
)
from tierplan.runtime.errors import ConfigError


class _Reader:
    """Typed access to one config dict; errors name `source` and the field."""

    def __init__(self, cfg: Mapping[str, Any], source: str, prefix: str = "") -> None:
        self.cfg, self.source, self.prefix = cfg, source, prefix

    def fail(self, key: str, expected: str, got: object) -> ConfigError:
        return ConfigError(f"{self.source}: field '{self.prefix}{key}' must be {expected}, got {got!r}")

    def raw(self, key: str) -> Any:
        if key not in self.cfg:
            raise ConfigError(f"{self.source}: missing required field '{self.prefix}{key}'")
        return self.cfg[key]

    def get_int(self, key: str, default: int | None = None, *, minimum: int = 1,
                maximum: tuple[str, int] | None = None) -> int:
        """The int at `key` (missing -> `default`, or an error when there is none); `maximum` = (name, value)."""
        if key not in self.cfg and default is not None:
            return default
        v = self.raw(key)
        expected = f"an int in {minimum}..{maximum[0]} ({maximum[1]})" if maximum else f"an int >= {minimum}"
        if not is_int(v) or v < minimum or (maximum is not None and v > maximum[1]):
            raise self.fail(key, expected, v)
        return v

    def nullable_int(self, key: str, *, minimum: int = 1) -> int | None:
        """A required key whose null means "none" (e.g. q_lora_rank); None for null."""
        return None if self.raw(key) is None else self.get_int(key, minimum=minimum)

    def get_number(self, key: str, default: float) -> float:
        v = self.cfg.get(key)
        if v is None:
            return default
        if not is_int(v, or_float=True) or not 0 < v < math.inf:  # NaN fails both comparisons
            raise self.fail(key, "a finite number > 0", v)
        return float(v)

    def get_bool(self, key: str, default: bool) -> bool:
        if (v := self.cfg.get(key)) is not None and not isinstance(v, bool):
            raise self.fail(key, "true or false", v)
        return default if v is None else v

    def get_str(self, key: str, default: str) -> str:
        v = self.cfg.get(key, default)
        if not isinstance(v, str):
            raise self.fail(key, "a string", v)
        return v

    def int_list(self, key: str, upper: int) -> list[int]:
        v = self.cfg.get(key) or []
        if not isinstance(v, list) or not all(is_int(i) and 0 <= i < upper for i in v):
            raise self.fail(key, f"a list of layer indices in 0..{upper - 1}", v)
        return v


# transformers class defaults, used when a config.json omits the field: (rms_norm_eps, rope_theta, max_positions)
_FAMILY_DEFAULTS: dict[ModelFamily, tuple[float, float, int]] = {
    ModelFamily.QWEN3_MOE: (1e-6, 10000.0, 32768),
    ModelFamily.MIXTRAL: (1e-5, 1e6, 4096 * 32),
    ModelFamily.OLMOE: (1e-5, 10000.0, 4096),
    ModelFamily.DEEPSEEK_V2: (1e-6, 10000.0, 2048),
}


def _common(r: _Reader, family: ModelFamily) -> dict[str, Any]:
    """Fields every family spells the same way."""
    eps, theta, max_pos = _FAMILY_DEFAULTS[family]
    heads = r.get_int("num_attention_heads")
    kv_heads = r.nullable_int("num_key_value_heads")
    kv_heads = heads if kv_heads is None else kv_heads  # null means multi-head attention, as in transformers
    if heads % kv_heads:
        raise r.fail("num_key_value_heads", f"a divisor of num_attention_heads ({heads})", kv_heads)
    rope = r.cfg.get("rope_parameters")  # transformers >= 5 nests rope_theta here
    if "rope_theta" not in r.cfg and isinstance(rope, Mapping):
        theta = _Reader(rope, r.source, "rope_parameters.").get_number("rope_theta", theta)
    return dict(family=family, vocab_size=r.get_int("vocab_size"), hidden_size=r.get_int("hidden_size"),
                num_layers=r.get_int("num_hidden_layers"), num_heads=heads, num_kv_heads=kv_heads,
                rms_norm_eps=r.get_number("rms_norm_eps", eps), rope_theta=r.get_number("rope_theta", theta),
                max_position_embeddings=r.get_int("max_position_embeddings", max_pos))


def _gqa(r: _Reader, c: dict[str, Any]) -> dict[str, Any]:
    if r.cfg.get("head_dim") is not None:
        return dict(attention=AttentionKind.GQA, head_dim=r.get_int("head_dim"))
    if c["hidden_size"] % c["num_heads"]:
        raise ConfigError(f"{r.source}: field 'hidden_size' ({c['hidden_size']}) must be divisible by "
                          f"'num_attention_heads' ({c['num_heads']}) when 'head_dim' is absent")
    return dict(attention=AttentionKind.GQA, head_dim=c["hidden_size"] // c["num_heads"])


def _experts(r: _Reader, count_key: str) -> dict[str, int]:
    return dict(num_experts=(n := r.get_int(count_key)), top_k=r.get_int("num_experts_per_tok", maximum=(count_key, n)))


def _dense_intermediate(r: _Reader, c: dict[str, Any], moe_layers: list[int]) -> int:
    """intermediate_size, required only when some layer is dense."""
    if len(moe_layers) < c["num_layers"] or "intermediate_size" in r.cfg:
        return r.get_int("intermediate_size")
    return 0


def _qwen3_moe(r: _Reader, c: dict[str, Any]) -> dict[str, Any]:
    ex = _experts(r, "num_experts" if "num_experts" in r.cfg else "num_local_experts")  # transformers 5: the latter
    step = r.get_int("decoder_sparse_step", 1)
    mlp_only = set(r.int_list("mlp_only_layers", c["num_layers"]))
    moe = [i for i in range(c["num_layers"]) if i not in mlp_only and (i + 1) % step == 0]
    return dict(**_gqa(r, c), **ex, expert_intermediate=r.get_int("moe_intermediate_size"), moe_layers=tuple(moe),
                dense_intermediate=_dense_intermediate(r, c, moe), norm_topk_prob=r.get_bool("norm_topk_prob", False),
                qk_norm=True)


def _all_moe(r: _Reader, c: dict[str, Any]) -> dict[str, Any]:
    """Mixtral and OLMoE: every layer MoE, intermediate_size is the expert width. Mixtral always renormalizes
    its top-k softmax and has no q/k norm; OLMoE reads norm_topk_prob and norms q and k."""
    mixtral = c["family"] is ModelFamily.MIXTRAL
    return dict(**_gqa(r, c), **_experts(r, "num_local_experts" if mixtral else "num_experts"),
                expert_intermediate=r.get_int("intermediate_size"), moe_layers=tuple(range(c["num_layers"])),
                dense_intermediate=0, norm_topk_prob=mixtral or r.get_bool("norm_topk_prob", False),
                qk_norm=not mixtral)


def _deepseek_v2(r: _Reader, c: dict[str, Any]) -> dict[str, Any]:
    for key, want in (("topk_method", "greedy"), ("scoring_func", "softmax")):
        got = r.get_str(key, want)
        if got != want:
            raise r.fail(key, f"{want!r} (the only {key} supported yet; group-limited routing is not)", got)
    ex = _experts(r, "n_routed_experts")
    first_dense = r.get_int("first_k_dense_replace", 0, minimum=0)
    freq = r.get_int("moe_layer_freq", 1)
    moe = [i for i in range(c["num_layers"]) if i >= first_dense and i % freq == 0]
    moe_inter = r.get_int("moe_intermediate_size")
    num_shared = r.nullable_int("n_shared_experts", minimum=0)
    q_lora = r.nullable_int("q_lora_rank")  # null: queries are not compressed
    nope, rope = r.get_int("qk_nope_head_dim"), r.get_int("qk_rope_head_dim")
    return dict(attention=AttentionKind.MLA, head_dim=nope + rope, kv_lora_rank=r.get_int("kv_lora_rank"),
                qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=r.get_int("v_head_dim"),
                q_lora_rank=q_lora or 0,
                **ex, expert_intermediate=moe_inter, moe_layers=tuple(moe),
                dense_intermediate=_dense_intermediate(r, c, moe), num_shared_experts=num_shared or 0,
                shared_intermediate=(num_shared or 0) * moe_inter, norm_topk_prob=r.get_bool("norm_topk_prob", False),
                qk_norm=False, routed_scaling_factor=r.get_number("routed_scaling_factor", 1.0))


_PARSERS: dict[ModelFamily, Callable[[_Reader, dict[str, Any]], dict[str, Any]]] = {
    ModelFamily.QWEN3_MOE: _qwen3_moe,
    ModelFamily.MIXTRAL: _all_moe,
    ModelFamily.OLMOE: _all_moe,
    ModelFamily.DEEPSEEK_V2: _deepseek_v2,
}


def read_json(path_or_dir: str | os.PathLike[str]) -> tuple[dict[str, Any], str, str]:
    """(config dict, source label, default name) from a config.json file or a folder holding one."""
    path = Path(path_or_dir)
    if path.is_dir():
        path = path / "config.json"
    source = f"config.json ({path})"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:  # missing or unreadable
        what = "no such file" if isinstance(e, FileNotFoundError) else f"cannot be read ({e.strerror})"
        raise ConfigError(f"{source}: {what} (expected a config.json or a folder holding one)") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{source}: byte {e.object[e.start]:#04x} at offset {e.start} is not UTF-8") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}: not valid JSON at line {e.lineno} column {e.colno}: {e.msg}") from e
    if not isinstance(cfg, dict):
        raise ConfigError(f"{source}: expected a JSON object at the top level, got {type(cfg).__name__}")
    return cfg, source, path.resolve().parent.name


def load_hf_config(path_or_dict: str | os.PathLike[str] | Mapping[str, Any], name: str | None = None) -> ModelSpec:
    """Parse a Hugging Face config.json (a file, a folder holding one, or the dict itself) into a ModelSpec."""
    if isinstance(path_or_dict, Mapping):
        cfg, source = path_or_dict, f"config dict ({name})" if name else "config dict"
        default_name = str(cfg.get("_name_or_path") or cfg.get("model_type") or "model").rstrip("/").split("/")[-1]
    else:
        cfg, source, default_name = read_json(path_or_dict)
    r = _Reader(cfg, source)
    model_type = r.raw("model_type")
    if model_type not in SUPPORTED_FAMILIES:
        raise ConfigError(f"{source}: field 'model_type' must be one of {SUPPORTED_FAMILIES}, got {model_type!r}")
    family = ModelFamily(model_type)
    c = _common(r, family)
    fields = {**c, **_PARSERS[family](r, c)}
    if not fields["moe_layers"]:
        raise ConfigError(f"{source}: no MoE layer among the {c['num_layers']} layers (mlp_only_layers, "
                          "decoder_sparse_step or first_k_dense_replace make every layer dense): expected at least one")
    try:
        return ModelSpec(name=name or default_name, **fields)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from e
