"""Fixtures of the observability tests: skip with the reason when the distribution's Prometheus is missing."""

from __future__ import annotations

import pytest

from tests.api.obs.prom import prometheus_binary


@pytest.fixture(scope="session")
def prometheus_bin() -> str:
    binary = prometheus_binary()
    if binary is None:
        pytest.skip("no prometheus binary (Debian package `prometheus`; .ci/system-deps.sh installs it as root)")
    return binary
