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
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from netdist.config import DistributedConfig
from netdist.errors import ConfigError, ConnectError
from netdist.transport.tcp import TcpTransport

__all__ = ["create_local_tcp_group", "local_tcp_group"]


async def create_local_tcp_group(n: int, *, host_ids: Sequence[str | None] | None = None,
                                 **config_overrides: Any) -> list[TcpTransport]:
    """Connect ``n`` ``TcpTransport`` ranks over 127.0.0.1; rank i at index i.

    ``config_overrides`` are ``DistributedConfig`` fields (``timeout``,
    ``heartbeat_interval``, ``limits``, ...). A random job id and token are used unless
    given. ``host_ids`` gives each rank its ``DistributedConfig.host_id``, so ranks of this
    one process can act as several hosts (``["a", "a", "b", "b"]``: two hosts). The
    caller closes the transports (or use ``local_tcp_group``). The ranks connect as
    tasks of one ``asyncio.TaskGroup``: rank 0 first (it runs the coordinator), the
    others once its address is known. If any rank fails to connect,
    the others are cancelled, every transport that did connect is closed and the first
    error is raised as itself (not as an ``ExceptionGroup``); cancelling the caller
    cleans up the same way. ``n < 1`` and a ``host_ids`` of another length are a
    ``ConfigError``.
    """
    if n < 1:
        raise ConfigError(f"create_local_tcp_group: n must be >= 1, got {n}")
    if host_ids is not None and len(host_ids) != n:
        raise ConfigError(f"create_local_tcp_group: {len(host_ids)} host_ids for {n} ranks")
    if host_ids is not None and "host_id" in config_overrides:
        raise ConfigError("create_local_tcp_group: give host_ids or host_id, not both")

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

    def config_for(rank: int) -> DistributedConfig:
        config = DistributedConfig(rank=rank, **settings)
        return config if host_ids is None else config.replace(host_id=host_ids[rank])

    if n == 1:
        return [await TcpTransport.connect(config_for(0))]
    ready: asyncio.Future[tuple[str, int]] = asyncio.get_running_loop().create_future()
    connected: dict[int, TcpTransport] = {}

    def on_ready(address: tuple[str, int]) -> None:
        if not ready.done():
            ready.set_result(address)

    async def join_coordinator(config: DistributedConfig) -> None:
        connected[0] = await TcpTransport.connect(config, on_coordinator_ready=on_ready)
        if not ready.done():  # defensive: rank 0 always reports its coordinator first
            ready.set_exception(ConnectError(
                f"create_local_tcp_group: rank 0 connected without reporting its "
                f"coordinator's address, so ranks 1..{n - 1} have nothing to join"))

    async def join(config: DistributedConfig) -> None:
        connected[config.rank] = await TcpTransport.connect(config)

    first_error: BaseException | None = None
    try:
        async with asyncio.TaskGroup() as ranks:
            ranks.create_task(join_coordinator(config_for(0)))
            settings["coordinator"] = await ready  # rank 0 failing first cancels this wait
            for rank in range(1, n):
                ranks.create_task(join(config_for(rank)))
    except BaseExceptionGroup as failures:
        first_error = _first_error(failures)
    except BaseException:
        await _aclose_all(connected.values())
        raise
    finally:
        if not ready.done():
            ready.cancel()
    if first_error is not None:
        await _aclose_all(connected.values())
        raise first_error
    return [connected[rank] for rank in range(n)]


def _first_error(failures: BaseExceptionGroup[BaseException]) -> BaseException:
    """The exception that failed the group first (``TaskGroup`` lists them in order)."""
    error: BaseException = failures
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


async def _aclose_all(transports: Iterable[TcpTransport]) -> None:
    """Close every transport; one that fails to close does not stop the others."""
    await asyncio.gather(*(t.aclose() for t in list(transports)), return_exceptions=True)


@contextlib.asynccontextmanager
async def local_tcp_group(n: int, *, host_ids: Sequence[str | None] | None = None,
                          **config_overrides: Any) -> AsyncIterator[list[TcpTransport]]:
    """``async with local_tcp_group(4) as transports:`` -- closed on exit, even on error."""
    transports = await create_local_tcp_group(n, host_ids=host_ids, **config_overrides)
    try:
        yield transports
    finally:
        await asyncio.gather(*(t.aclose() for t in transports), return_exceptions=True)
