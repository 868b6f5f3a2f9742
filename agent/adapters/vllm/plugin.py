"""Hooks tierplan into vLLM's model loading (every vLLM process that loads the plugin; binds where a model loads).

`install(settings)` wraps vLLM's model loaders' `load_model` so that, when the target model has been loaded and
its weights processed, and before vLLM compiles or warms it up, `on_model_loaded` binds the router capture
and builds the rank's `VllmAgent` (kept on the model as `_tierplan_agent`). Both are idempotent: a loader
already wrapped is left alone (vLLM may load plugins more than once per process) and a model already bound
is not bound twice. A model without MoE layers, a draft model, or a failure of ours leaves vLLM as it was,
with a warning in vLLM's log that says why: the engine must never fail to serve because of us.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

from tierplan.agent.adapters.vllm.settings import VllmPluginSettings

logger = logging.getLogger("vllm.tierplan")  # under vLLM's logger: its handlers and level
MARK = "__tierplan_wrapped__"
AGENT_ATTR = "_tierplan_agent"


def _loader_classes() -> list[type]:
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    out, todo = [], [BaseModelLoader]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def install() -> int:
    """Wrap every loader class that defines its own `load_model`; returns how many were newly wrapped. The
    settings are read when a model loads (each engine start in a process may have its own)."""
    wrapped = 0
    for cls in _loader_classes():
        fn = cls.__dict__.get("load_model")
        if fn is None or getattr(fn, MARK, False):
            continue
        cls.load_model = _wrap(fn)  # type: ignore[attr-defined]
        wrapped += 1
    return wrapped


def _wrap(load_model: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(load_model)
    def load_and_bind(self: Any, *args: Any, **kwargs: Any) -> Any:
        model = load_model(self, *args, **kwargs)
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        model_config = kwargs.get("model_config", args[1] if len(args) > 1 else None)
        if vllm_config is not None and model_config is vllm_config.model_config:  # not a draft model
            settings = VllmPluginSettings.from_env(os.environ)  # SettingsError: vLLM stops, the message names it
            if settings.enabled:
                on_model_loaded(model, vllm_config, settings)
        return model

    setattr(load_and_bind, MARK, True)
    return load_and_bind


def on_model_loaded(model: Any, vllm_config: Any, settings: VllmPluginSettings) -> Any:
    """Bind the capture and build the agent; returns the agent, or None (the reason is logged)."""
    if getattr(model, AGENT_ATTR, None) is not None:
        return getattr(model, AGENT_ATTR)
    try:
        from tierplan.agent.adapters.vllm.capture import RouterCapture
        from tierplan.agent.adapters.vllm.link import VllmAgent

        num_layers = int(vllm_config.model_config.get_total_num_hidden_layers())
        max_tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
        capture = RouterCapture.bind(model, num_layers, max_tokens)
        if capture is None:
            logger.warning("tierplan: %s has no MoE layer with a BaseRouter; nothing to capture, the plugin stays "
                           "idle", vllm_config.model_config.model)
            return None
        agent = VllmAgent(capture, vllm_config, settings, rank=_rank(vllm_config))
    except Exception:  # never the engine's failure
        logger.exception("tierplan: could not bind to the model; vLLM serves without tierplan")
        return None
    setattr(model, AGENT_ATTR, agent)
    logger.info("tierplan: capture bound to %d MoE layers (unbound: %s); agent %s -> %s",
                len(capture.shape.moe_layers), dict(capture.unbound) or "none", settings.agent_id, agent.socket_path)
    return agent


def _rank(vllm_config: Any) -> int:
    return int(getattr(vllm_config.parallel_config, "rank", 0) or 0)
