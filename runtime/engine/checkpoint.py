"""A local Hugging Face safetensors checkpoint, read one tensor at a time (inference process, load time).

Checks what a user's folder can get wrong before anything is built: no weights, an index naming a missing
file, a truncated or corrupt file (the header's byte ranges must fit in the file), a tensor with the wrong
shape. Tensors are memory-mapped and read one at a time, so loading never holds a second full copy of the
model; each is converted to the engine's dtype explicitly. Counts which tensors were used, so a checkpoint
tensor the engine would silently drop is refused. Never writes, never touches a hub.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch

from tierplan.runtime.errors import ConfigError

INDEX_NAME = "model.safetensors.index.json"


def _header_end(path: Path) -> int:
    """Bytes a safetensors file must have (8 + header + the largest data offset); refuses a bad header."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConfigError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ConfigError(f"{path}: truncated safetensors file (header of {n} bytes, file has {size})")
        try:
            meta = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{path}: corrupt safetensors header (not a JSON object)")
    ends = [v["data_offsets"][1] for k, v in meta.items() if k != "__metadata__" and isinstance(v, dict)
            and isinstance(v.get("data_offsets"), list) and len(v["data_offsets"]) == 2]
    need = 8 + n + max(ends, default=0)
    if size < need:
        raise ConfigError(f"{path}: truncated safetensors file ({size} bytes, its header needs {need})")
    return need


class Checkpoint:
    """The tensors of one folder's `*.safetensors` files (with or without an index)."""

    def __init__(self, folder: str | Path) -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            others = sorted(p.name for p in self.folder.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
            hint = f"; found {others} (convert them to safetensors)" if others else ""
            raise ConfigError(f"{self.folder}: no *.safetensors weight files{hint}")
        index = self.folder / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConfigError(f"{index}: not a safetensors index (need a 'weight_map' object): {e}") from None
            missing = sorted({v for v in weight_map.values() if not (self.folder / v).is_file()})
            if missing:
                raise ConfigError(f"{index}: names weight file(s) {missing} that are not in {self.folder}")
            files = sorted({self.folder / v for v in weight_map.values()})
        self._handles: dict[Path, Any] = {}
        self._where: dict[str, Path] = {}
        for f in files:
            _header_end(f)
            try:
                h = safe_open(f, framework="pt")
            except Exception as e:  # safetensors raises its own error type for damaged files
                raise ConfigError(f"{f}: cannot open as safetensors ({e})") from None
            self._handles[f] = h
            self._where.update({k: f for k in h.keys()})  # noqa: SIM118 - safe_open has no __iter__
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    @property
    def names(self) -> set[str]:
        return set(self._where)

    def dtype_of(self, name: str) -> str:
        return self._handles[self._where[name]].get_slice(name).get_dtype()

    def check(self, name: str, shape: tuple[int, ...]) -> Path:
        """Refuse a missing tensor or one of another shape (header only); the file holding it."""
        if name not in self._where:
            raise ConfigError(f"{self.folder}: tensor {name!r} not found in the checkpoint (config.json expects it)")
        path = self._where[name]
        got = tuple(self._handles[path].get_slice(name).get_shape())
        if got != tuple(shape):
            raise ConfigError(f"{path.name}: tensor {name!r} has shape {list(got)}, expected {list(shape)} "
                              f"from config.json")
        self.used.add(name)
        return path

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tensor `name`, checked against `shape`, converted to `dtype` (CPU)."""
        path = self.check(name, shape)
        return self._handles[path].get_tensor(name).to(dtype)

    def mark_used(self, name: str) -> None:
        self.used.add(name)

    def check_all_used(self, ignorable_suffixes: tuple[str, ...] = ()) -> None:
        """Refuse tensors the engine did not read (their effect on the output would be silently lost)."""
        left = sorted(n for n in self.names - self.used if not n.endswith(ignorable_suffixes))
        if left:
            more = f" and {len(left) - 5} more" if len(left) > 5 else ""
            raise ConfigError(f"{self.folder}: checkpoint tensor(s) {left[:5]}{more} are not used by the engine for "
                              "this config.json (e.g. biases with attention_bias false); refusing to drop them")

    def close(self) -> None:
        self._handles.clear()
