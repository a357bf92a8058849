"""Real TCP transports for n ranks inside one event loop (tests and single-host demos).

``create_local_tcp_group(n)`` runs the whole start-up -- coordinator on a free port,
rendezvous, handshakes, full mesh -- over 127.0.0.1, so collectives can be tested over
real sockets without spawning processes. ``local_tcp_group(n)`` is the context manager
form that closes every transport on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator
from typing import Any

from netdist.config import DistributedConfig
from netdist.transport.tcp import TcpTransport

__all__ = ["create_local_tcp_group", "local_tcp_group"]


async def create_local_tcp_group(n: int, **config_overrides: Any) -> list[TcpTransport]:
    """Connect ``n`` ``TcpTransport`` ranks over 127.0.0.1; rank i at index i.

    ``config_overrides`` are ``DistributedConfig`` fields (``timeout``,
    ``heartbeat_interval``, ``limits``, ...). A random job id and token are used unless
    given. The caller closes the transports (or use ``local_tcp_group``). If any rank
    fails to connect, the others are closed and the first error is raised.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    settings: dict[str, Any] = {
        "job_id": f"local-{secrets.token_hex(4)}",
        "token": secrets.token_hex(16),
        "coordinator": ("127.0.0.1", 0),
        "listen_host": "127.0.0.1",
        "advertise_addr": "127.0.0.1",
        "timeout": 30.0,
        "connect_timeout": 30.0,
    }
    settings.update(config_overrides)
    settings["world_size"] = n
    if n == 1:
        return [await TcpTransport.connect(DistributedConfig(rank=0, **settings))]
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[tuple[str, int]] = loop.create_future()

    def on_ready(address: tuple[str, int]) -> None:
        if not ready.done():
            ready.set_result(address)

    tasks: list[asyncio.Task[TcpTransport]] = [loop.create_task(TcpTransport.connect(
        DistributedConfig(rank=0, **settings), on_coordinator_ready=on_ready))]
    try:
        first: list[asyncio.Future[Any]] = [tasks[0], ready]
        await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            await tasks[0]  # rank 0 failed before its coordinator was up: raise that
            raise RuntimeError("rank 0 connected without starting a coordinator")
        settings["coordinator"] = ready.result()
        tasks.extend(loop.create_task(TcpTransport.connect(
            DistributedConfig(rank=rank, **settings))) for rank in range(1, n))
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            error = task.exception() if task.done() and not task.cancelled() else None
            if error is not None:
                raise error
        return [t.result() for t in tasks]
    except BaseException:
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, TcpTransport):
                await result.aclose()
        raise
    finally:
        if not ready.done():
            ready.cancel()


@contextlib.asynccontextmanager
async def local_tcp_group(n: int, **config_overrides: Any) -> AsyncIterator[list[TcpTransport]]:
    """``async with local_tcp_group(4) as transports:`` -- closed on exit, even on error."""
    transports = await create_local_tcp_group(n, **config_overrides)
    try:
        yield transports
    finally:
        await asyncio.gather(*(t.aclose() for t in transports), return_exceptions=True)
