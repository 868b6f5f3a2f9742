"""The dependency rules of ARCHITECTURE.md, checked on every module's imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
FORBIDDEN = {
    "runtime": ("agent", "controller", "api", "bench"),  # mechanism never looks up
    "controller": ("torch", "runtime", "agent", "api"),  # decisions: pure Python, no torch
    "agent": ("api", "bench"),
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package: str) -> None:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in _imports(path):
            if name.split(".")[0] in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
            if package == "agent" and name.startswith("controller") and name != "controller.protocol":
                bad.append(f"{path.relative_to(ROOT)} imports {name} (the agent may only use controller.protocol)")
    assert not bad, "\n".join(bad)
