"""Fixtures of the checkpoint-loading tests: one tiny transformers checkpoint per family, built once per run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.runtime.pretrained.hf_tiny import FAMILIES, build_checkpoint, hf_model


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family -> folder of a float32 checkpoint (config.json, model.safetensors, tokenizer.json)."""
    root = tmp_path_factory.mktemp("hf")
    return {f: build_checkpoint(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="session")
def references(checkpoints: dict[str, Path]) -> dict[str, Any]:
    """family -> the transformers float32 model of that checkpoint (eager attention)."""
    return {f: hf_model(d) for f, d in checkpoints.items()}
