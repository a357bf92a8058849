"""Every collective test runs twice: payloads through shared memory between ranks on one
host (the default), and over TCP alone (``NETDIST_SHM=0``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, params=["shm", "tcp"])
def data_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Sets ``NETDIST_SHM`` for groups made in the test and for the processes it starts."""
    monkeypatch.setenv("NETDIST_SHM", "1" if request.param == "shm" else "0")
    yield request.param
