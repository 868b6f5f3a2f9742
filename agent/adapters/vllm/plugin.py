"""Hooks tierplan into vLLM's model loading (every vLLM process that loads the plugin; binds where a model loads).

`install()` wraps vLLM's model loaders' `load_model` so that, when the target model has been loaded and its
weights processed, and before vLLM compiles or warms it up, `on_model_loaded` checks the rank's
`AgentRegistration` as the sidecar will see it (a setting the protocol refuses, such as a group with a space,
is found here, once, not at every step), binds the router capture and builds the rank's `VllmAgent` (kept on
the model as `_tierplan_agent`). Both are idempotent: a loader already wrapped is left alone (vLLM may load
plugins more than once per process) and a model already bound is not bound twice. A model without MoE layers, a draft
model, a registration the protocol refuses, or a failure of ours leaves vLLM as it was, with one warning in
vLLM's log that says why: the engine must never fail to serve because of us. A bad `TIERPLAN_VLLM_*`
setting is the one thing that stops vLLM (`refuse`: one line at ERROR, raised as the `SettingsError`).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from tierplan.agent.adapters.vllm.settings import SettingsError, VllmPluginSettings

logger = logging.getLogger("vllm.tierplan")  # under vLLM's logger: its handlers and level
MARK = "__tierplan_wrapped__"
AGENT_ATTR = "_tierplan_agent"


def refuse(exc: SettingsError) -> SettingsError:
    """Log a bad setting's one line at ERROR; the short exception to raise (`from None`: no traceback of ours)."""
    line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    logger.error("%s", line)
    return SettingsError(line)


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
            try:
                settings = VllmPluginSettings.from_env(os.environ)
            except SettingsError as exc:  # vLLM stops; the one line names the variable
                raise refuse(exc) from None
            if settings.enabled:
                on_model_loaded(model, vllm_config, settings)
        return model

    setattr(load_and_bind, MARK, True)
    return load_and_bind


def on_model_loaded(model: Any, vllm_config: Any, settings: VllmPluginSettings) -> Any:
    """Check the registration, bind the capture and build the agent; returns the agent, or None (the reason
    is logged once)."""
    if getattr(model, AGENT_ATTR, None) is not None:
        return getattr(model, AGENT_ATTR)
    try:
        from tierplan.agent.adapters.vllm.capture import RouterCapture
        from tierplan.agent.adapters.vllm.link import VllmAgent
        from tierplan.agent.adapters.vllm.registration import build_registration
        from tierplan.agent.sidecar import default_socket_path

        num_layers = int(vllm_config.model_config.get_total_num_hidden_layers())
        max_tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
        capture = RouterCapture.survey(model, num_layers, max_tokens, vllm_config)
        if capture is None:
            logger.warning("tierplan: %s has no MoE layer; nothing to capture, the plugin stays idle",
                           vllm_config.model_config.model)
            return None
        rank = _rank(vllm_config)
        dp_rank, dp_size = _data_parallel(vllm_config)
        try:
            settings = settings.for_engine(dp_rank, dp_size, default_socket_path(settings.agent_id))
        except SettingsError as exc:
            logger.error("%s; vLLM serves without tierplan", exc)
            return None
        try:  # what the sidecar would refuse at the first step; vLLM's KV block count is not known yet
            build_registration(capture.shape, vllm_config, settings, rank)
        except ValidationError as exc:
            logger.warning("tierplan: the agent's registration is refused (%s); vLLM serves without tierplan",
                           _first_error(exc))
            return None
        capture.attach(model)
        agent = VllmAgent(capture, vllm_config, settings, rank=rank)
    except Exception:  # never the engine's failure
        logger.exception("tierplan: could not bind to the model; vLLM serves without tierplan")
        return None
    setattr(model, AGENT_ATTR, agent)
    if capture.bound_layers == 0:
        logger.warning("tierplan: no MoE layer of %s can carry the capture (%s); windows carry step and KV "
                       "numbers only", vllm_config.model_config.model, dict(capture.unbound))
    logger.info("tierplan: capture bound to %d of %d MoE layers (unbound: %s); agent %s -> %s",
                capture.bound_layers, len(capture.shape.moe_layers), dict(capture.unbound) or "none",
                settings.agent_id, agent.socket_path)
    return agent


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    msg = " ".join(str(err["msg"]).split())
    if not err["loc"]:  # a check across fields: its message names them
        return f"{exc.title}: {msg}"
    return f"{exc.title}.{'.'.join(str(p) for p in err['loc'])}={err.get('input')!r}: {msg}"


def _rank(vllm_config: Any) -> int:
    return int(getattr(vllm_config.parallel_config, "rank", 0) or 0)


def _data_parallel(vllm_config: Any) -> tuple[int, int]:
    """(this engine's data-parallel rank, the number of data-parallel engines)."""
    pc = vllm_config.parallel_config
    return int(getattr(pc, "data_parallel_rank", 0) or 0), int(getattr(pc, "data_parallel_size", 1) or 1)
