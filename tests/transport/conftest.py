"""Fixtures shared by the transport tests: groups of transports of either kind.

``make_group`` runs the conformance suite over the in-process transport and over TCP
with both connection modes (``tcp``: connections on first use, the default;
``tcp-eager``: the full mesh at start-up). ``tcp_group`` builds eager TCP groups: the
TCP-specific tests there reach into a connection right after start-up
(``_connections[peer]``); lazy connection is tested in ``test_lazy_connect.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from netdist.config import ConnectMode
from netdist.transport import InProcessTransport, Transport
from netdist.transport.local_tcp import create_local_tcp_group

GroupFactory = Callable[..., Awaitable[list[Transport]]]

TEST_TIMEOUT = 10.0
"""Default per-operation timeout in these tests: generous, but no test can hang."""


@pytest.fixture(params=["inprocess", "tcp", "tcp-eager"])
def kind(request: pytest.FixtureRequest) -> str:
    """Which transport implementation a conformance test runs against."""
    return request.param


@pytest.fixture
async def make_group(kind: str) -> AsyncIterator[GroupFactory]:
    """``await make_group(n, timeout=...)`` -> n connected transports, closed afterwards."""
    created: list[Transport] = []

    async def make(n: int, *, timeout: float = TEST_TIMEOUT, **overrides: Any) -> list[Transport]:
        if kind == "inprocess":
            group: list[Transport] = list(InProcessTransport.create_group(n, timeout=timeout))
        else:
            if kind == "tcp-eager":
                overrides.setdefault("connect", ConnectMode.EAGER)
            group = list(await create_local_tcp_group(
                n, timeout=timeout, connect_timeout=TEST_TIMEOUT, **overrides))
        created.extend(group)
        return group

    yield make
    for transport in created:
        await transport.aclose()


@pytest.fixture
async def tcp_group() -> AsyncIterator[Callable[..., Awaitable[list[Any]]]]:
    """Like ``make_group`` but always TCP (for TCP-specific tests)."""
    created: list[Any] = []

    async def make(n: int, **overrides: Any) -> list[Any]:
        settings: dict[str, Any] = {"timeout": TEST_TIMEOUT, "connect_timeout": TEST_TIMEOUT,
                                    "connect": ConnectMode.EAGER}
        settings.update(overrides)
        group = await create_local_tcp_group(n, **settings)
        created.extend(group)
        return group

    yield make
    for transport in created:
        await transport.aclose()

