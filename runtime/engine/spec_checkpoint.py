"""Validation of the `ModelSpec` fields only a checkpoint's config sets (inference process, spec construction).

sliding_window, clip_qkv, rope_scaling (yarn), the routing groups and the router's scoring: set by the family adapters
(runtime/engine/families/); their defaults change nothing. Kept apart from config.py so that file stays small.
Pure checks: never reads anything.
"""

from __future__ import annotations

import math
from typing import Any

from tierplan.runtime.errors import ConfigError

# softmax: top-k of the softmax; sigmoid: DeepSeek-V3's noaux_tc (routing.py)
ROUTER_SCORINGS = ("softmax", "sigmoid")


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_checkpoint_fields(spec: Any, where: str) -> None:
    """Refuse bad values by field name; normalizes rope_scaling to a tuple of (str, value) pairs."""
    w, clip = spec.sliding_window, spec.clip_qkv
    if not _int(w) or w < 0 or not isinstance(clip, int | float) or isinstance(clip, bool) or not 0 <= clip < math.inf:
        raise ConfigError(f"{where}: fields 'sliding_window' (int >= 0) and 'clip_qkv' (finite number >= 0), "
                          f"got {w!r} and {clip!r}")
    try:
        object.__setattr__(spec, "rope_scaling", tuple((str(k), float(v)) for k, v in spec.rope_scaling))
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: field 'rope_scaling' must be (key, number) pairs, got {spec.rope_scaling!r}") \
            from None
    g, tg = spec.num_expert_groups, spec.topk_groups
    if not (_int(g) and _int(tg)) or (g == 0) != (tg == 0) or (g and (spec.num_experts % g or not 1 <= tg <= g)):
        raise ConfigError(f"{where}: fields 'num_expert_groups' ({g!r}) and 'topk_groups' ({tg!r}) must be both 0, "
                          f"or num_expert_groups must divide num_experts ({spec.num_experts}) and topk_groups "
                          f"be in 1..num_expert_groups")
    if spec.router_scoring not in ROUTER_SCORINGS:
        raise ConfigError(f"{where}: field 'router_scoring' must be one of {list(ROUTER_SCORINGS)}, "
                          f"got {spec.router_scoring!r}")
    if spec.router_scoring == "sigmoid" and not g:
        raise ConfigError(f"{where}: router_scoring 'sigmoid' (DeepSeek-V3) needs num_expert_groups >= 1")
