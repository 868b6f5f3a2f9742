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
# The messages that cross a process; protocol_service.py holds the sidecar <-> service ones (registration,
# telemetry batches, the records the service answers with), which the sidecar (agent/sidecar*.py) speaks.
AGENT_MAY_IMPORT = ("controller.protocol", "controller.protocol_service")


PREFIX = "tierplan."


def _raw_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _imports(path: Path) -> set[str]:
    """The module's imports with our `tierplan.` prefix taken off (so the rules read as the folders do)."""
    return {n.removeprefix(PREFIX) for n in _raw_imports(path)}


def _python_files() -> list[Path]:
    return sorted(p for folder in (*FORBIDDEN, "bench", "tests") for p in (ROOT / folder).rglob("*.py"))


def test_our_modules_are_imported_only_as_tierplan_dot_something() -> None:
    """A bare `import runtime` works only from the checkout's root and would load a second copy of the module
    beside `tierplan.runtime` (two classes of one name): every import of ours goes through `tierplan.`."""
    ours = (*FORBIDDEN, "bench")
    bad = [f"{path.relative_to(ROOT)} imports {name}" for path in _python_files() for name in _raw_imports(path)
           if name.split(".")[0] in ours]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package: str) -> None:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in _imports(path):
            if name.split(".")[0] in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
            if package == "agent" and name.startswith("controller") and name not in AGENT_MAY_IMPORT:
                bad.append(f"{path.relative_to(ROOT)} imports {name} (the agent may only use {AGENT_MAY_IMPORT})")
    assert not bad, "\n".join(bad)
