"""Packaging: the design's folders install as `tierplan.<folder>` and nothing else reaches the top level.

An inference engineer installs tierplan into the environment that runs vLLM; a generic top-level `api` or
`runtime` there would shadow, or be shadowed by, someone else's. These tests build the real wheel and install it
into a fresh venv.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
FOLDERS = ("runtime", "agent", "controller", "api", "bench")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_listed_packages_are_exactly_the_trees_folders_with_an_init() -> None:
    on_disk = {"tierplan." + ".".join(p.parent.relative_to(ROOT).parts)
               for folder in FOLDERS for p in (ROOT / folder).rglob("__init__.py")
               if "__pycache__" not in p.parts}
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    assert listed == on_disk, f"missing from pyproject: {sorted(on_disk - listed)}; stale: {sorted(listed - on_disk)}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # --no-build-isolation: the build backend is the one this venv has (no index needed)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, text=True, timeout=300)
    (whl,) = out.glob("tierplan-*.whl")
    return whl


def test_the_wheel_has_one_top_level_name_and_its_package_data(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"tierplan"}, tops
    assert "tierplan/__init__.py" not in names  # a namespace package: tierplan.* plugins may add to it
    for data in ("tierplan/api/ui/index.html", "tierplan/api/db/migrations/script.py.mako",
                 "tierplan/api/db/migrations/versions/0001_initial.py"):
        assert any(n == data or n.startswith(data.rsplit("/", 1)[0] + "/") for n in names), data
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "tierplan = tierplan.api.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_in_a_venv_with_only_tierplan_installed_import_api_fails(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # this venv's pip installs the wheel into the fresh venv's site-packages (the fresh venv has no pip)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", site,
                    str(wheel)], check=True, capture_output=True, text=True, timeout=300)
    probe = ("import importlib.util as u; "
             "print([n for n in ('api', 'runtime', 'agent', 'controller', 'bench') if u.find_spec(n)]); "
             "print(u.find_spec('tierplan.api.cli') is not None)")
    got = subprocess.run([str(python), "-c", probe], cwd=tmp_path, check=True, capture_output=True, text=True)
    assert got.stdout.split("\n")[:2] == ["[]", "True"], got.stdout
    failed = subprocess.run([str(python), "-c", "import api"], cwd=tmp_path, capture_output=True, text=True)
    assert failed.returncode != 0 and "No module named 'api'" in failed.stderr
