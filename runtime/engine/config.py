"""Model shapes for the reference MoE engine (inference process): one frozen `ModelSpec` for four families.

`runtime/engine/hf_config.py` reads a Hugging Face `config.json` (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V2) into a
normalized `ModelSpec`. Shape fields must be present in the file; behaviour fields that real configs sometimes omit
(`rms_norm_eps`, `rope_theta`, `norm_topk_prob`, ...) fall back to the transformers class defaults of the family.
Every refusal names the source, the field, what was expected and what was got.
Pure description: never allocates tensors, never reads anything but the one config file, never touches a hub.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Any

from tierplan.runtime.engine.spec_checkpoint import check_checkpoint_fields
from tierplan.runtime.errors import ConfigError
from tierplan.runtime.weights.format import dtype_from_name


class AttentionKind(Enum):
    GQA = "gqa"  # grouped-query attention, cache of K and V per kv head
    MLA = "mla"  # DeepSeek multi-head latent attention, cache of the compressed latent + rope key


class ModelFamily(StrEnum):  # the `model_type` values we parse; a StrEnum, so `spec.family == "mixtral"` holds
    QWEN3_MOE = "qwen3_moe"
    MIXTRAL = "mixtral"
    OLMOE = "olmoe"
    DEEPSEEK_V2 = "deepseek_v2"


SUPPORTED_FAMILIES = [f.value for f in ModelFamily]
_POSITIVE_INTS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "num_experts",
                  "top_k", "expert_intermediate", "max_position_embeddings")
_NON_NEGATIVE_INTS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "q_lora_rank",
                      "dense_intermediate", "num_shared_experts", "shared_intermediate")
_MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
_POSITIVE_FLOATS = ("routed_scaling_factor", "rms_norm_eps", "rope_theta")


def is_int(v: object, *, or_float: bool = False) -> bool:
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
    # Set from a checkpoint's config (runtime/engine/families/, checked in spec_checkpoint.py); defaults: no effect.
    sliding_window: int = 0  # GQA: a query sees the last `sliding_window` positions (itself included); 0 = all
    clip_qkv: float = 0.0  # OLMoE: q, k, v clamped to [-clip_qkv, clip_qkv] after projection; 0 = none
    rope_scaling: tuple[tuple[str, float], ...] = ()  # MLA yarn: (key, value) pairs of rope_parameters
    num_expert_groups: int = 0  # DeepSeek group-limited routing: experts in G groups, top-k within the best
    topk_groups: int = 0  # `topk_groups` of them (both 0: no groups)
    router_scoring: str = "softmax"  # "softmax" or "sigmoid" (DeepSeek-V3: biased choice, groups by top-2 sum)
    checkpoint: str = ""  # the checkpoint folder the engine loads weights from (pretrained.py); "" = synthetic

    def __post_init__(self) -> None:
        where = f"ModelSpec {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"ModelSpec: field 'name' must be a non-empty str, got {self.name!r}")
        if self.family not in SUPPORTED_FAMILIES:
            raise ConfigError(f"{where}: field 'family' must be one of {SUPPORTED_FAMILIES}, got {self.family!r}")
        object.__setattr__(self, "family", ModelFamily(self.family))
        kinds = [k.value for k in AttentionKind]
        if not isinstance(self.attention, AttentionKind) and self.attention not in kinds:
            raise ConfigError(f"{where}: field 'attention' must be one of {kinds}, got {self.attention!r}")
        object.__setattr__(self, "attention", AttentionKind(self.attention))
        for f in _POSITIVE_INTS + _NON_NEGATIVE_INTS:
            v, low = getattr(self, f), 1 if f in _POSITIVE_INTS else 0
            if not is_int(v) or v < low:
                raise ConfigError(f"{where}: field '{f}' must be an int >= {low}, got {v!r}")
        for f in _POSITIVE_FLOATS:
            v = getattr(self, f)
            if not is_int(v, or_float=True) or not 0 < v < math.inf:  # NaN fails both comparisons
                raise ConfigError(f"{where}: field '{f}' must be a finite number > 0, got {v!r}")
            object.__setattr__(self, f, float(v))
        check_checkpoint_fields(self, where)
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
        if not isinstance(layers, tuple | list) or not all(is_int(i) for i in layers):
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
        if not is_int(num_layers) or not 1 <= num_layers <= self.num_layers:
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
