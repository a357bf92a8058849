"""``init()``: the one-line process bootstrap for a TCP job.

::

    async with netdist.init() as transport:          # reads NETDIST_* / RANK / ...
        await transport.send(1, array, tag=0)

Rank 0 hosts the rendezvous coordinator; every rank connects to every other one; leaving
the block closes the transport (BYE to every peer; leaving on an exception aborts it, so
peers are told which rank went away first, see ``TcpTransport.abort``).

A failure to join ends, in the user's script, in the user's own line and one line naming
the ``netdist.errors`` exception, whose message says what to check: the traceback through
netdist's internals and the OS errors behind it are cut (``cut_for_user``) unless
``NETDIST_DEBUG=1``. Errors raised inside the ``async with`` block are left as they are.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from types import TracebackType

from netdist.config import DistributedConfig, parse_switch
from netdist.errors import ConfigError, NetdistError
from netdist.transport.tcp import TcpTransport

__all__ = ["init"]

DEBUG_VARIABLE = "NETDIST_DEBUG"
"""The on/off switch (``netdist.config.parse_switch``) that keeps full tracebacks."""


def debugging() -> bool:
    """True when ``NETDIST_DEBUG`` is on (read at each failure). A value that is neither
    on nor off counts as on: while reporting one error, show more rather than raise
    another."""
    try:
        return parse_switch(os.environ, DEBUG_VARIABLE, False)
    except ConfigError:
        return True


def cut_for_user(exc: NetdistError) -> None:
    """Strip ``exc`` of the traceback and chained exceptions it gathered inside netdist,
    unless ``NETDIST_DEBUG=1``.

    Call it in an ``except`` block of the function the user called, then re-raise with a
    bare ``raise``: a re-raise adds no traceback entry for the frame it runs in, so the
    traceback Python prints holds the user's frames only, and then one line,
    ``netdist.errors.ConnectError: <message>``. The message itself says what happened
    and what to check; the internals are one ``NETDIST_DEBUG=1`` away. No global hook
    is installed (``sys.excepthook`` stays the user's).
    """
    if debugging():
        return
    exc.__traceback__ = None
    exc.__cause__ = None
    exc.__suppress_context__ = True


def init(config: DistributedConfig | None = None,
         **overrides: object) -> contextlib.AbstractAsyncContextManager[TcpTransport]:
    """Join the job described by ``config``; ``async with`` it for a connected
    ``TcpTransport``.

    With ``config`` None the configuration comes from ``DistributedConfig.from_env``
    (``overrides`` win over the environment); with a config, ``overrides`` are applied
    to it. A world size of 1 opens no sockets. Errors while joining are raised as
    ``netdist.errors`` (``ConnectError``, ``AuthenticationError``, ``RendezvousError``,
    ``RendezvousTimeoutError``, ``NetdistTimeoutError``, ``ConfigError``) from the
    ``async with`` line, their traceback cut to the caller's frames unless
    ``NETDIST_DEBUG=1`` (``cut_for_user``); the transport is closed when the block
    exits, even by an exception or cancellation.
    """
    return _Joining(_join(config, overrides))


class _Joining(contextlib.AbstractAsyncContextManager[TcpTransport]):
    """What ``init()`` returns: ``_join`` entered from the user's ``async with``, so that
    a joining error can leave ``__aenter__`` with a traceback cut to the user's frames
    (an ``asynccontextmanager`` alone would add its own frames above the user's)."""

    def __init__(self, joining: contextlib.AbstractAsyncContextManager[TcpTransport]) -> None:
        self._joining = joining

    async def __aenter__(self) -> TcpTransport:
        try:
            return await self._joining.__aenter__()
        except NetdistError as exc:
            cut_for_user(exc)
            raise  # a bare re-raise: this frame stays out of the traceback

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> bool | None:
        return await self._joining.__aexit__(exc_type, exc, tb)


@contextlib.asynccontextmanager
async def _join(config: DistributedConfig | None,
                overrides: dict[str, object]) -> AsyncIterator[TcpTransport]:
    """``init()``'s body: connect, yield, abort on an exception, always close."""
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
