"""Bad input at the `tierplan` command line: exit 2 and a message naming what, where and what was expected;
never a traceback. Each case is one a new user tried."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import tierplan.api.cli_checks as cli_checks
from tierplan.api.cli import app
from tierplan.runtime.engine.presets import PRESETS

runner = CliRunner()


def refused(args: list[str], *says: str) -> str:
    r = runner.invoke(app, args)
    out = " ".join(re.sub("[│╭╮╰╯─]", " ", r.output).split())  # rich wraps and boxes long lines: compare words
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
    for s in says:
        assert s in out, out
    return out


def config_file(tmp_path: Path, **changes: object) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**PRESETS["tiny"], **changes}))
    return path


def test_a_workdir_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    for cmd in (["check", "tiers", "--moves", "5"], ["check", "exact"], ["check", "slots"], ["demo"]):
        refused([*cmd, "--workdir", str(tmp_path / "f")], "--workdir", "is a file; expected a folder")


def test_a_workdir_under_proc() -> None:
    refused(["check", "tiers", "--moves", "5", "--workdir", "/proc/tierplan"], "--workdir",
            "is under /proc, a kernel pseudo-filesystem; expected a folder on a real disk")


def test_a_read_only_workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:  # root writes through mode bits: make the probe see what a user would
        def denied(*args: object, **kwargs: object) -> None:
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(cli_checks.tempfile, "TemporaryFile", denied)
    try:
        refused(["check", "tiers", "--moves", "5", "--workdir", str(ro)], "--workdir",
                "is not writable (Permission denied); expected a folder you can write")
    finally:
        ro.chmod(0o755)


def test_a_seed_beyond_64_bits() -> None:
    refused(["check", "slots", "--seed", str(1 << 64)], "--seed", "18446744073709551615")


def test_config_and_preset_together_are_refused(tmp_path: Path) -> None:
    refused(["check", "exact", "--config", str(config_file(tmp_path)), "--preset", "tiny"],
            "--config", "--preset", "name two models; expected one of them")


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"hidden_size": 63}, "hidden_size=63 x expert_intermediate=32 x 2 bytes = 4032 bytes per gate projection"),
        ({"mlp_only_layers": [0, 1]}, "no MoE layer among the 2 layers"),
        ({"rms_norm_eps": float("nan")}, "field 'rms_norm_eps' must be a finite number > 0, got nan"),
        ({"rope_theta": float("inf")}, "field 'rope_theta' must be a finite number > 0, got inf"),
        ({"hidden_size": 16384, "moe_intermediate_size": 16384, "num_experts": 1024, "num_hidden_layers": 96},
         "GiB of host memory (dense weights"),
    ],
    ids=["hidden-63", "all-dense", "nan-eps", "inf-theta", "too-big"],
)
def test_bad_model_configs(tmp_path: Path, changes: dict[str, object], says: str) -> None:
    out = refused(["check", "exact", "--config", str(config_file(tmp_path, **changes)), "--workdir",
                   str(tmp_path / "w")], "error: ", says)
    assert not any((tmp_path / "w").rglob("*.tpnvme")), out  # refused before allocating anything


def test_a_config_with_a_byte_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(json.dumps(PRESETS["tiny"]).encode()[:-1] + b', "note": "\xff"}')
    refused(["check", "exact", "--config", str(path)], f"config.json ({path})", "byte 0xff at offset", "is not UTF-8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("cmd", [["bench", "engine", "--quick"], ["bench", "substrate", "--quick"],
                                 ["check", "exact"]])
def test_cuda_on_a_machine_without_it(tmp_path: Path, cmd: list[str]) -> None:
    refused([*cmd, "--device", "cuda"], "--device", "no CUDA device", "expected --device cpu here")
