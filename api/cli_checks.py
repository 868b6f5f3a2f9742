"""Checks of what a user typed, for the `tierplan` commands (runs in the user's shell, before any work starts).

Each check refuses bad input with what was wrong, where (the option) and what was expected, as typer's usage
error (exit 2), or turns the runtime's own refusal (`ConfigError`, a protocol `ProtocolError`) into
`error: ...` on stderr and exit 2: a user never sees a traceback for their input. Nothing here changes
state, except that a missing `--workdir` folder is created (it would be anyway) to prove it can be.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.console import Console

MAX_SEED = (1 << 64) - 1  # torch generators take 64-bit seeds
PSEUDO_FILESYSTEMS = (Path("/proc"), Path("/sys"), Path("/dev"))

F = TypeVar("F", bound=Callable[..., Any])


def check_workdir(path: Path | None) -> Path | None:
    """typer callback for `--workdir`: a folder that is (or can be made) writable on a real filesystem."""
    if path is None:
        return None
    where = path.expanduser()
    resolved = where.resolve()
    for pseudo in PSEUDO_FILESYSTEMS:
        if resolved == pseudo or pseudo in resolved.parents:
            raise typer.BadParameter(f"{path} is under {pseudo}, a kernel pseudo-filesystem; expected a folder on a "
                                     "real disk (NVMe files are written there)", param_hint="--workdir")
    if where.exists() and not where.is_dir():
        raise typer.BadParameter(f"{path} is a file; expected a folder (it is created if missing)",
                                 param_hint="--workdir")
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise typer.BadParameter(f"{path} cannot be created ({exc.strerror}); expected a folder you can write",
                                 param_hint="--workdir") from None
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as exc:
        raise typer.BadParameter(f"{path} is not writable ({exc.strerror}); expected a folder you can write",
                                 param_hint="--workdir") from None
    return where


def check_device(value: Any) -> Any:
    """typer callback for `--device`: cuda only where torch sees a CUDA device."""
    if getattr(value, "value", value) == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise typer.BadParameter("cuda: this machine has no CUDA device torch can use (torch.cuda.is_available() "
                                     f"is False, torch {torch.__version__}); expected --device cpu here",
                                     param_hint="--device")
    return value


def user_errors(console: Callable[[], Console]) -> Callable[[F], F]:
    """Decorate a command: the runtime's refusals of the user's input print `error: ...` and exit 2."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            from tierplan.controller.protocol import ProtocolError
            from tierplan.runtime.errors import ConfigError

            try:
                return fn(*args, **kwargs)
            except (ConfigError, ProtocolError) as exc:
                console().print(f"error: {exc}", markup=False, highlight=False)
                raise typer.Exit(2) from None

        return run  # type: ignore[return-value]

    return wrap
