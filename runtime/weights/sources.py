"""Expert weight sources: synthetic weights at a model's real shapes, or a local safetensors checkpoint.

Runs in the inference process at start-up (filling stores), never on the hot path. No hub access: a
checkpoint is a local path the user gives.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Protocol

import torch

from tierplan.runtime.errors import ConfigError
from tierplan.runtime.weights.format import ExpertFormat, dtype_from_name


class ExpertSource(Protocol):
    format: ExpertFormat
    num_layers: int
    num_experts: int

    def fill(self, layer: int, expert: int, out: torch.Tensor) -> None:
        """Write the expert's packed record into `out` [>= format.num_bytes] uint8 (CPU)."""
        ...


class SyntheticExpertSource:
    """Deterministic random weights: N(0, 0.02) for floats, uniform bytes for integer (packed) dtypes."""

    def __init__(self, fmt: ExpertFormat, num_layers: int, num_experts: int, seed: int = 0) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
            raise ConfigError(f"seed: expected an int in 0..2**64-1 (a torch generator seed), got {seed!r}")
        self.format, self.num_layers, self.num_experts, self.seed = fmt, num_layers, num_experts, seed

    def fill(self, layer: int, expert: int, out: torch.Tensor) -> None:
        # Folded to 64 bits (the generator's seed range); seeds that fit already draw what they always drew.
        g = torch.Generator().manual_seed(((self.seed * 1_000_003 + layer) * 1_000_003 + expert) % (1 << 64))
        tensors = {}
        for t in self.format.tensors:
            dt = dtype_from_name(t.dtype)
            if dt.is_floating_point:
                tensors[t.name] = (torch.randn(t.shape, generator=g) * 0.02).to(dt)
            else:
                raw = torch.randint(0, 256, (t.num_bytes,), generator=g, dtype=torch.uint8)
                tensors[t.name] = raw.view(dt).view(t.shape)
        self.format.pack(tensors, out)


class SafetensorsExpertSource:
    """Experts read from a local safetensors checkpoint (one file or a folder with an index json).

    `name_template` locates a tensor, e.g. "model.layers.{layer}.mlp.experts.{expert}.{name}.weight";
    `layer_ids` maps our dense layer index to the checkpoint's layer number (MoE layers may be sparse).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        fmt: ExpertFormat,
        num_experts: int,
        layer_ids: list[int],
        name_template: str = "model.layers.{layer}.mlp.experts.{expert}.{name}.weight",
    ) -> None:
        from safetensors import safe_open

        self.format, self.num_experts, self.layer_ids = fmt, num_experts, layer_ids
        self.num_layers = len(layer_ids)
        self.name_template = name_template
        root = Path(path)
        files = sorted(root.glob("*.safetensors")) if root.is_dir() else [root]
        if not files or not all(f.is_file() for f in files):
            raise ConfigError(f"safetensors checkpoint not found at {root}")
        index_path = root / "model.safetensors.index.json" if root.is_dir() else None
        self._where: dict[str, Path] = {}
        if index_path is not None and index_path.is_file():
            weight_map = json.loads(index_path.read_text())["weight_map"]
            self._where = {k: root / v for k, v in weight_map.items()}
        else:
            for f in files:
                with safe_open(f, framework="pt") as h:
                    self._where.update({k: f for k in h.keys()})  # noqa: SIM118 - safe_open has no __iter__
        self._open = safe_open
        for t in fmt.tensors:  # fail now, not halfway through filling a store
            key = name_template.format(layer=layer_ids[0], expert=0, name=t.name)
            if key not in self._where:
                raise ConfigError(f"tensor {key!r} not in checkpoint {root} (name_template={name_template!r})")

    def fill(self, layer: int, expert: int, out: torch.Tensor) -> None:
        tensors = {}
        for t in self.format.tensors:
            key = self.name_template.format(layer=self.layer_ids[layer], expert=expert, name=t.name)
            if key not in self._where:
                raise ConfigError(f"tensor {key!r} missing from the checkpoint")
            with self._open(self._where[key], framework="pt") as h:
                tensors[t.name] = h.get_tensor(key)
        self.format.pack(tensors, out)
