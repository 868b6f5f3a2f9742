"""Checkpoint family adapters (inference process, load time): one module per Hugging Face `model_type`.

`family_for` looks one up; an unsupported `model_type` is refused by name. Nothing is built at import.
"""

from __future__ import annotations

import importlib

from tierplan.runtime.engine.families.base import Family
from tierplan.runtime.errors import ConfigError

SUPPORTED = ("qwen3_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3")


def family_for(model_type: object, source: str) -> Family:
    if model_type not in SUPPORTED:
        raise ConfigError(f"{source}: model_type {model_type!r} is not supported for loading a checkpoint; "
                          f"expected one of {list(SUPPORTED)}")
    return importlib.import_module(f"tierplan.runtime.engine.families.{model_type}").FAMILY
