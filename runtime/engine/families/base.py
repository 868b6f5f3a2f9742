"""What a checkpoint family adapter is: config keys it reads, keys that do not change inference, tensor names.

Runs in the inference process at load time (`runtime/engine/pretrained.py`). Every key of a family's
`config.json` is in exactly one of three sets: `implemented` (read into the `ModelSpec` or by the loader,
with unsupported values refused by name), `inert` (does not change greedy inference: training-only, metadata)
or `refused` (not supported: refused whenever it is set). A key in none of them is refused too: nothing is
silently ignored. Pure description and checks: never reads a tensor, never touches a hub.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tierplan.runtime.engine.config import ModelSpec
from tierplan.runtime.errors import ConfigError

# Keys every family's transformers config carries that do not change what greedy inference computes.
COMMON_INERT = frozenset({
    "_name_or_path", "architectures", "transformers_version", "initializer_range", "use_cache", "attention_dropout",
    "output_router_logits", "router_aux_loss_coef", "bos_token_id", "pad_token_id", "id2label", "label2id",
    "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "output_attentions", "output_hidden_states",
    "return_dict", "auto_map", "tokenizer_class", "torchscript", "use_return_dict", "sep_token_id",
})
# Keys every family reads (ModelSpec shapes, or the loader: dtype, tied embeddings, eos for `tierplan generate`).
COMMON_IMPLEMENTED = frozenset({
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling", "hidden_act",
    "tie_word_embeddings", "dtype", "torch_dtype", "eos_token_id", "num_experts_per_tok",
})
COMMON_REFUSED = frozenset({"quantization_config", "pretraining_tp"})
_ROPE_KEYS = frozenset({"rope_type", "rope_theta", "type"})


# (layer, is_moe) -> {our name: checkpoint tensor name} for "router", "shared.*", "dense.*"
LayerNames = Callable[[int, bool], dict[str, str]]
ExpertNames = Callable[[int, int], tuple[str, str, str]]  # (layer, expert) -> gate, up, down tensor names
ConfigCheck = Callable[[Mapping[str, Any], str], dict[str, Any]]  # -> ModelSpec changes
TensorFix = Callable[[str, torch.Tensor, ModelSpec], torch.Tensor]  # (our name, tensor, spec) -> tensor


@dataclass(frozen=True)
class Family:
    model_type: str
    implemented: frozenset[str]
    inert: frozenset[str]
    refused: frozenset[str]
    check: ConfigCheck  # value checks (refusals name the key) and the ModelSpec fields load_hf_config leaves out
    layer_names: LayerNames
    expert_names: ExpertNames
    fix_tensor: TensorFix | None = None  # e.g. DeepSeek's interleaved rope rows
    fix_when: Callable[[Mapping[str, Any]], bool] | None = None  # config -> apply fix_tensor (None: always)
    router_bias: bool = False  # MoE routers carry `{router}.e_score_correction_bias` [E] (DeepSeek-V3)
    skipped_layers: Callable[[Mapping[str, Any]], int] | None = None  # config -> extra trailing layers (MTP) not run
    bias_projections: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")  # biased if attention_bias
    router_fp32: bool = False  # the router weight stays float32 and routes float32 rows (transformers' DeepSeek)
    normalize: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # the config as load_hf_config reads it
    ignorable_tensors: tuple[str, ...] = field(default=("rotary_emb.inv_freq",))  # name suffixes, made from config

    @property
    def all_keys(self) -> frozenset[str]:
        return self.implemented | self.inert | self.refused

    def validate(self, cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
        """Refuse unknown or refused keys by name, then run the family's value checks; the ModelSpec changes."""
        unknown = sorted(set(cfg) - self.all_keys)
        if unknown:
            raise ConfigError(f"{source}: config key(s) {unknown} are not supported for model_type "
                              f"{self.model_type!r} (the engine would silently ignore them); expected only "
                              f"keys transformers' {self.model_type} config knows")
        refused = sorted(k for k in self.refused if _is_set(k, cfg.get(k)))
        if refused:
            raise ConfigError(f"{source}: config key(s) {refused} are not supported for model_type "
                              f"{self.model_type!r} (got {[cfg[k] for k in refused]})")
        check_common(cfg, source, rope=not self.model_type.startswith("deepseek"))  # DeepSeek checks its own yarn
        return self.check(cfg, source)


def _is_set(key: str, value: object) -> bool:
    if key == "pretraining_tp":  # 1 = no tensor-parallel split of the linear layers at training time
        return value not in (None, 1)
    return value not in (None, {}, [], False)


def fail(source: str, key: str, expected: str, got: object) -> ConfigError:
    return ConfigError(f"{source}: field '{key}' must be {expected}, got {got!r}")


def check_common(cfg: Mapping[str, Any], source: str, rope: bool = True) -> None:
    """hidden_act (SwiGLU's silu only) and, if `rope`, the default rotary embedding only."""
    for key in ("attention_bias", "tie_word_embeddings", "use_sliding_window"):
        if cfg.get(key) is not None and not isinstance(cfg[key], bool):
            raise fail(source, key, "true or false", cfg[key])
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise fail(source, "hidden_act", "'silu' (the only activation the engine implements)", act)
    for key in ("rope_parameters", "rope_scaling") if rope else ():
        rope = cfg.get(key)
        if rope is None:
            continue
        if not isinstance(rope, Mapping):
            raise fail(source, key, "an object or null", rope)
        extra = sorted(set(rope) - _ROPE_KEYS)
        kind = rope.get("rope_type", rope.get("type", "default"))
        if extra or kind != "default":
            raise ConfigError(f"{source}: field '{key}' must describe the default rotary embedding (rope_type "
                              f"'default', rope_theta); got rope_type {kind!r}"
                              + (f" and unsupported key(s) {extra}" if extra else ""))


def swiglu_expert_names(i: int, e: int) -> tuple[str, str, str]:
    """(gate, up, down) tensor names of expert `e` in layer `i` where a family keeps them at
    `mlp.experts.{e}.{gate,up,down}_proj` (Qwen3-MoE, OLMoE, DeepSeek)."""
    p = f"model.layers.{i}.mlp.experts.{e}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def mlp_names(moe_prefix: str, router: str, shared: str | None = None) -> LayerNames:
    """Names of a layer's MLP side: the router (MoE layers, plus shared experts where the family has them) or
    a dense SwiGLU MLP at `mlp.{gate,up,down}_proj`. Attention and norms are named alike in every family."""

    def names(i: int, moe: bool) -> dict[str, str]:
        p = f"model.layers.{i}."
        if not moe:
            return {f"dense.{n}": f"{p}mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
        out = {"router": f"{p}{moe_prefix}.{router}.weight"}
        if shared is not None:
            out |= {f"shared.{n}": f"{p}{moe_prefix}.{shared}.{n}.weight" for n in ("gate_proj", "up_proj",
                                                                                    "down_proj")}
        return out

    return names


def sliding_window(cfg: Mapping[str, Any], source: str, enabled: bool = True) -> int:
    """The config's sliding window in tokens (0 = none), checked."""
    w = cfg.get("sliding_window")
    if w is None or not enabled:
        return 0
    if not isinstance(w, int) or isinstance(w, bool) or w < 1:
        raise fail(source, "sliding_window", "an int >= 1 or null", w)
    return w
