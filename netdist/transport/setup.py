"""``init()``: the one-line process bootstrap for a TCP job.

::

    async with netdist.init() as transport:          # reads NETDIST_* / RANK / ...
        await transport.send(1, array, tag=0)

Rank 0 hosts the rendezvous coordinator; every rank connects to every other one; leaving
the block closes the transport (BYE to every peer; leaving on an exception aborts it, so
peers are told which rank went away first, see ``TcpTransport.abort``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from netdist.config import DistributedConfig
from netdist.transport.tcp import TcpTransport

__all__ = ["init"]


@contextlib.asynccontextmanager
async def init(config: DistributedConfig | None = None,
               **overrides: object) -> AsyncIterator[TcpTransport]:
    """Join the job described by ``config`` and yield a connected ``TcpTransport``.

    With ``config`` None the configuration comes from ``DistributedConfig.from_env``
    (``overrides`` win over the environment); with a config, ``overrides`` are applied
    to it. A world size of 1 opens no sockets. Errors while joining are raised as
    ``netdist.errors`` (``ConnectError``, ``AuthenticationError``, ``RendezvousError``,
    ``RendezvousTimeoutError``, ``NetdistTimeoutError``, ``ConfigError``); the transport
    is closed when the block exits, even by an exception or cancellation.
    """
    if config is None:
        config = DistributedConfig.from_env(None, **overrides)
    elif overrides:
        config = config.replace(**overrides)
    transport = await TcpTransport.connect(config)
    try:
        yield transport
    except GeneratorExit:
        raise
    except BaseException as exc:
        await transport.abort(exc)  # peers learn why this rank left, and whom to blame
        raise
    finally:
        await transport.aclose()
