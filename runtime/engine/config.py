"""Model shapes for the reference MoE engine (inference process): one frozen `ModelSpec` for four families.

`load_hf_config` reads a Hugging Face `config.json` (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V2) into a normalized
`ModelSpec`. Shape fields must be present in the file; behaviour fields that real configs sometimes omit
(`rms_norm_eps`, `rope_theta`, `norm_topk_prob`, ...) fall back to the transformers class defaults of the family.
Every refusal names the source, the field, what was expected and what was got.
Pure description: never allocates tensors, never reads anything but the one config file, never touches a hub.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any

from runtime.errors import ConfigError
from runtime.weights.format import dtype_from_name


class AttentionKind(Enum):
    GQA = "gqa"  # grouped-query attention, cache of K and V per kv head
    MLA = "mla"  # DeepSeek multi-head latent attention, cache of the compressed latent + rope key


class ModelFamily(StrEnum):  # the `model_type` values we parse; a StrEnum, so `spec.family == "mixtral"` holds
    QWEN3_MOE = "qwen3_moe"
    MIXTRAL = "mixtral"
    OLMOE = "olmoe"
    DEEPSEEK_V2 = "deepseek_v2"


_SUPPORTED = [f.value for f in ModelFamily]
_POSITIVE_INTS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "num_experts",
                  "top_k", "expert_intermediate", "max_position_embeddings")
_NON_NEGATIVE_INTS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "q_lora_rank",
                      "dense_intermediate", "num_shared_experts", "shared_intermediate")
_MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
_POSITIVE_FLOATS = ("routed_scaling_factor", "rms_norm_eps", "rope_theta")


def _is_int(v: object, *, or_float: bool = False) -> bool:
    return isinstance(v, int | float if or_float else int) and not isinstance(v, bool)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Normalized shapes and routing behaviour of one MoE model; validated on construction."""

    name: str
    family: str  # a ModelFamily (StrEnum); plain strings are converted
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # GQA: per-head q/k/v width; MLA: qk_nope_head_dim + qk_rope_head_dim
    attention: AttentionKind
    kv_lora_rank: int = 0  # MLA only (DeepSeek-V2), else 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    q_lora_rank: int = 0  # 0 = queries are not compressed
    num_experts: int
    top_k: int
    expert_intermediate: int
    moe_layers: tuple[int, ...]  # ascending indices of layers whose MLP is MoE; the rest are dense
    dense_intermediate: int  # intermediate size of the dense MLP layers (0 if the family has none)
    num_shared_experts: int = 0  # DeepSeek shared experts, run as one MLP of width shared_intermediate
    shared_intermediate: int = 0
    norm_topk_prob: bool  # renormalize the top-k routing weights to sum to 1
    qk_norm: bool  # RMSNorm on q and k (Qwen3: per head over head_dim; OLMoE: over the whole projection)
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    dtype: str = "bfloat16"  # compute/storage dtype of the engine; the config's torch_dtype is not used

    def __post_init__(self) -> None:
        where = f"ModelSpec {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"ModelSpec: field 'name' must be a non-empty str, got {self.name!r}")
        if self.family not in _SUPPORTED:
            raise ConfigError(f"{where}: field 'family' must be one of {_SUPPORTED}, got {self.family!r}")
        object.__setattr__(self, "family", ModelFamily(self.family))
        kinds = [k.value for k in AttentionKind]
        if not isinstance(self.attention, AttentionKind) and self.attention not in kinds:
            raise ConfigError(f"{where}: field 'attention' must be one of {kinds}, got {self.attention!r}")
        object.__setattr__(self, "attention", AttentionKind(self.attention))
        for f in _POSITIVE_INTS + _NON_NEGATIVE_INTS:
            v, low = getattr(self, f), 1 if f in _POSITIVE_INTS else 0
            if not _is_int(v) or v < low:
                raise ConfigError(f"{where}: field '{f}' must be an int >= {low}, got {v!r}")
        for f in _POSITIVE_FLOATS:
            v = getattr(self, f)
            if not _is_int(v, or_float=True) or not 0 < v < math.inf:  # NaN fails both comparisons
                raise ConfigError(f"{where}: field '{f}' must be a finite number > 0, got {v!r}")
            object.__setattr__(self, f, float(v))
        for f in ("norm_topk_prob", "qk_norm"):
            if not isinstance(getattr(self, f), bool):
                raise ConfigError(f"{where}: field '{f}' must be a bool, got {getattr(self, f)!r}")
        try:
            dtype_from_name(self.dtype)
        except ConfigError as e:
            raise ConfigError(f"{where}: field 'dtype': {e}") from None
        self._check_layout(where)

    def _check_layout(self, where: str) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{where}: field 'num_kv_heads' must divide num_heads ({self.num_heads}), "
                              f"got {self.num_kv_heads}")
        if self.top_k > self.num_experts:
            raise ConfigError(f"{where}: field 'top_k' must be an int in 1..num_experts ({self.num_experts}), "
                              f"got {self.top_k}")
        layers = self.moe_layers
        if not isinstance(layers, tuple | list) or not all(_is_int(i) for i in layers):
            raise ConfigError(f"{where}: field 'moe_layers' must be a tuple of ints, got {layers!r}")
        if sorted(set(layers)) != list(layers) or any(not 0 <= i < self.num_layers for i in layers):
            raise ConfigError(f"{where}: field 'moe_layers' must be ascending, unique and in 0..{self.num_layers - 1}"
                              f", got {tuple(layers)}")
        object.__setattr__(self, "moe_layers", tuple(layers))
        if len(layers) < self.num_layers and self.dense_intermediate == 0:
            raise ConfigError(f"{where}: field 'dense_intermediate' must be >= 1 because layers "
                              f"{self.dense_layers} are dense, got 0")
        if (self.num_shared_experts == 0) != (self.shared_intermediate == 0):
            raise ConfigError(f"{where}: fields 'num_shared_experts' ({self.num_shared_experts}) and "
                              f"'shared_intermediate' ({self.shared_intermediate}) must be both 0 or both >= 1")
        if self.attention is AttentionKind.GQA:
            for f in (*_MLA_FIELDS, "q_lora_rank"):
                if getattr(self, f):
                    raise ConfigError(f"{where}: field '{f}' is MLA-only and must be 0 with GQA attention, "
                                      f"got {getattr(self, f)}")
            return
        for f in _MLA_FIELDS:
            if getattr(self, f) == 0:
                raise ConfigError(f"{where}: field '{f}' must be >= 1 with MLA attention, got 0")
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise ConfigError(f"{where}: field 'head_dim' must equal qk_nope_head_dim + qk_rope_head_dim "
                              f"({self.qk_nope_head_dim + self.qk_rope_head_dim}) with MLA, got {self.head_dim}")

    @property
    def dtype_bytes(self) -> int:
        return dtype_from_name(self.dtype).itemsize

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert's gate, up and down projections."""
        return 3 * self.hidden_size * self.expert_intermediate * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token takes in one layer (MLA caches the compressed latent and the rope key)."""
        if self.attention is AttentionKind.MLA:
            return (self.kv_lora_rank + self.qk_rope_head_dim) * self.dtype_bytes
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.moe_layers)

    @property
    def qk_norm_per_head(self) -> bool:
        """Qwen3 norms each head over head_dim; OLMoE norms the whole q ([H*D]) and k ([KV*D]) projections."""
        return self.qk_norm and self.family is ModelFamily.QWEN3_MOE

    def truncated(self, num_layers: int) -> ModelSpec:
        """The first `num_layers` layers at unchanged shapes, named e.g. "qwen3-30b-a3b@2L"."""
        if not _is_int(num_layers) or not 1 <= num_layers <= self.num_layers:
            raise ConfigError(f"ModelSpec {self.name!r}: truncated(num_layers) must be an int in "
                              f"1..num_layers ({self.num_layers}), got {num_layers!r}")
        base = re.sub(r"@\d+L$", "", self.name)
        return dataclasses.replace(self, name=f"{base}@{num_layers}L", num_layers=num_layers,
                                   moe_layers=tuple(i for i in self.moe_layers if i < num_layers))

    def with_(self, **changes: Any) -> ModelSpec:
        """A copy with `changes` applied (validated like any new spec)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (enums as their values, moe_layers as a list)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.update(family=str(self.family), attention=self.attention.value, moe_layers=list(self.moe_layers))
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSpec:
        """Inverse of `to_dict`; unknown or missing keys are refused by name."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ConfigError(f"ModelSpec.from_dict: unknown field(s) {unknown}; expected only {sorted(fields)}")
        missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING]
        if missing:
            raise ConfigError(f"ModelSpec.from_dict: missing required field(s) {missing}")
        return cls(**dict(data))


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
        if not _is_int(v) or v < minimum or (maximum is not None and v > maximum[1]):
            raise self.fail(key, expected, v)
        return v

    def nullable_int(self, key: str, *, minimum: int = 1) -> int | None:
        """A required key whose null means "none" (e.g. q_lora_rank); None for null."""
        return None if self.raw(key) is None else self.get_int(key, minimum=minimum)

    def get_number(self, key: str, default: float) -> float:
        v = self.cfg.get(key)
        if v is None:
            return default
        if not _is_int(v, or_float=True) or not 0 < v < math.inf:  # NaN fails both comparisons
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
        if not isinstance(v, list) or not all(_is_int(i) and 0 <= i < upper for i in v):
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
    ex = _experts(r, "num_experts")
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


def _read_json(path_or_dir: str | os.PathLike[str]) -> tuple[dict[str, Any], str, str]:
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
        cfg, source, default_name = _read_json(path_or_dict)
    r = _Reader(cfg, source)
    model_type = r.raw("model_type")
    if model_type not in _SUPPORTED:
        raise ConfigError(f"{source}: field 'model_type' must be one of {_SUPPORTED}, got {model_type!r}")
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
