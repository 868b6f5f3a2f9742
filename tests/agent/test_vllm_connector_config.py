"""The KV connector's settings (`kv_connector_extra_config`) and the KvLimits interface: unknown keys and bad values
refused by name, the plan source slot. No vLLM needed: runs in the main `make test`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierplan.agent.adapters.vllm import kv_limits
from tierplan.agent.adapters.vllm.connector_config import ConnectorSettings
from tierplan.agent.adapters.vllm.kv_limits import KvLimits, KvLimitsSource, current_source, prefix_hash, set_source


def test_defaults_and_a_full_config() -> None:
    assert ConnectorSettings.parse(None) == ConnectorSettings()
    s = ConnectorSettings.parse({"cpu_blocks": 8, "nvme_blocks": 16, "nvme_dir": "/x", "direct_io": False})
    assert (s.cpu_blocks, s.nvme_blocks, s.direct_io) == (8, 16, False)
    path = s.nvme_file("eng", 1)
    assert path is not None and path.parent == Path("/x") and "eng-rank1" in path.name
    assert ConnectorSettings().nvme_file("eng", 0) is None


def test_an_unknown_key_is_refused_by_name_with_the_known_ones() -> None:
    with pytest.raises(ValueError) as err:
        ConnectorSettings.parse({"cpu_blocks": 4, "cpu_block": 4, "retain": True})
    msg = str(err.value)
    assert "kv_transfer_config.kv_connector_extra_config: unknown key(s) 'cpu_block', 'retain'" in msg
    assert "known keys: cpu_blocks, direct_io, nvme_blocks, nvme_dir" in msg


@pytest.mark.parametrize(("extra", "needle"), [
    ({"cpu_blocks": -1}, "cpu_blocks: Input should be greater than or equal to 0 (got -1)"),
    ({"cpu_blocks": "8"}, "cpu_blocks: Input should be a valid integer (got '8')"),
    ({"direct_io": 1}, "direct_io: Input should be a valid boolean (got 1)"),
    ({"nvme_blocks": 4}, "nvme_blocks=4 needs nvme_dir"),
])
def test_bad_values_are_refused_with_where_and_what(extra: dict, needle: str) -> None:
    with pytest.raises(ValueError, match="kv_connector_extra_config for TierplanConnector") as err:
        ConnectorSettings.parse(extra)
    assert needle in str(err.value)


def test_not_a_dict_is_refused() -> None:
    with pytest.raises(ValueError, match="expected a dict, got list"):
        ConnectorSettings.parse([("cpu_blocks", 1)])


@pytest.mark.parametrize(("kwargs", "needle"), [
    (dict(plan_version=-1, cpu_blocks=1, nvme_blocks=1), "KvLimits.plan_version: expected an int >= 0, got -1"),
    (dict(plan_version=1, cpu_blocks=True, nvme_blocks=1), "KvLimits.cpu_blocks"),
    (dict(plan_version=1, cpu_blocks=1, nvme_blocks=1, retention=["a"]), "expected a tuple of prefix hashes"),
    (dict(plan_version=1, cpu_blocks=1, nvme_blocks=1, retention=("a", "")), "must be non-empty str"),
    (dict(plan_version=1, cpu_blocks=1, nvme_blocks=1, retention=("a", "b", "a")), "'a' is listed twice"),
])
def test_bad_limits_are_refused(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match="KvLimits") as err:
        KvLimits(**kwargs)
    assert needle in str(err.value)


def test_the_source_slot_holds_one_source_and_refuses_other_objects() -> None:
    class Src:
        def kv_limits(self) -> KvLimits | None:
            return None

        def report_kv(self, hits: dict, misses: dict, blocks: dict) -> None:
            return None

    assert isinstance(Src(), KvLimitsSource)
    try:
        src = Src()
        set_source(src)
        assert current_source() is src
        with pytest.raises(TypeError, match="object has no kv_limits"):
            set_source(object())  # type: ignore[arg-type]
        assert current_source() is src  # the refusal changed nothing
    finally:
        set_source(None)
    assert kv_limits.current_source() is None


def test_prefix_hash_is_the_hex_of_vllms_block_hash() -> None:
    assert prefix_hash(b"\x00\xab") == "00ab"
