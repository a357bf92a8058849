"""``create_local_tcp_group``: n real TCP ranks in one loop, started as one TaskGroup.

A failure of any rank is raised as itself (never an ``ExceptionGroup``), the other ranks
are cancelled or closed, and no task outlives the call.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from netdist.config import DistributedConfig
from netdist.errors import ConfigError, ConnectError
from netdist.transport.local_tcp import create_local_tcp_group
from netdist.transport.tcp import TcpTransport

CONNECT_SECONDS = 10.0


def _other_tasks() -> set[asyncio.Task[Any]]:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}


async def test_ranks_connect_in_rank_order_and_talk() -> None:
    transports = await create_local_tcp_group(3, connect_timeout=CONNECT_SECONDS)
    try:
        assert [t.rank for t in transports] == [0, 1, 2]
        assert {t.world_size for t in transports} == {3}
        await transports[2].send(0, b"hello", tag=5)
        assert bytes(await transports[0].recv(2, tag=5)) == b"hello"
    finally:
        await asyncio.gather(*(t.aclose() for t in transports))
    assert _other_tasks() == set()


async def test_rank_0_failing_before_its_coordinator_is_up_is_raised_as_itself() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConnectError, match=f"cannot listen on 127.0.0.1:{port}"):
            await create_local_tcp_group(2, coordinator=("127.0.0.1", port),
                                         connect_timeout=CONNECT_SECONDS)
    assert _other_tasks() == set()


async def test_a_later_rank_failing_cancels_the_others_and_is_raised_as_itself(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real_connect = TcpTransport.connect
    attempted: list[int] = []

    async def connect(cls: type[TcpTransport], config: DistributedConfig,
                      **kwargs: Any) -> TcpTransport:
        attempted.append(config.rank)
        if config.rank == 2:
            raise ConnectError("rank 2 could not reach anyone (injected)")
        return await real_connect(config, **kwargs)

    monkeypatch.setattr(TcpTransport, "connect", classmethod(connect))
    with pytest.raises(ConnectError, match=r"^rank 2 could not reach anyone \(injected\)$"):
        await create_local_tcp_group(3, connect_timeout=CONNECT_SECONDS)
    assert sorted(attempted) == [0, 1, 2]
    assert _other_tasks() == set()


async def test_no_ranks_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="create_local_tcp_group: n must be >= 1, got 0"):
        await create_local_tcp_group(0)
