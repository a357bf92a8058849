"""The one place where OS and asyncio errors become ``netdist.errors`` exceptions.

netdist promises that no OS or asyncio exception (``ConnectionResetError``,
``BrokenPipeError``, ``socket.gaierror``, ``asyncio.IncompleteReadError``...) reaches a
caller: the transport translates them where it meets the socket. This module is that
translation, so every site names the failure the same way and raises the same type
(as httpcore's ``_exceptions.map_exceptions`` does for its own transport):

* ``kind_of`` sorts an OS error into an ``OsErrorKind`` (``OS_ERROR_KINDS``: by type,
  then by ``errno``). Sites that act on what happened (retry a refused connect, listen on
  all interfaces when an address is not local, refuse strangers when out of descriptors,
  say "refused" rather than "unreachable") ask ``kind_of``; nothing else tests ``errno``.
* ``transport_error`` builds the exception for what the transport was doing (a
  ``Stage``): resolving, listening or connecting fail with ``ConnectError``; an
  established connection fails with ``PeerLostError`` once the peer's rank is known
  (``ConnectError`` before the handshake named it). The message names *what* was being
  done ("rank 1 reaching the coordinator") and *where* ("node0:29400", "rank 2"),
  then the OS error as ``Type: message``. A ``ConnectError``'s ``__cause__`` is the OS
  error, so callers can still ask ``kind_of(error.__cause__)``.
* ``lost_reason`` is the one-line account of a lost connection that ``FrameConnection``
  records (its failure factory builds a fresh exception per waiter from it):
  ``"rank 2 closed the connection (EOF)"`` or
  ``"connection to rank 2 was lost (ConnectionResetError: [Errno 104] ...)"``.
* ``map_os_errors`` is the context-manager form, for a block whose OS errors need no
  special handling.

netdist does not use TLS; an ``ssl.SSLError`` is an ``OSError`` and is named as one.
Bounded waits of netdist's own (``asyncio.timeout`` around a receive, a handshake, a
barrier) are not OS errors: they raise ``NetdistTimeoutError`` where they wait.
"""

from __future__ import annotations

import enum
import errno
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from netdist.errors import ConnectError, PeerLostError, TransportError

__all__ = [
    "OS_ERRORS",
    "OS_ERROR_KINDS",
    "OsErrorKind",
    "Stage",
    "kind_of",
    "describe",
    "lost_reason",
    "transport_error",
    "map_os_errors",
]

OS_ERRORS: tuple[type[BaseException], ...] = (OSError, EOFError)
"""What the transport translates: ``OSError`` (every ``ConnectionError``, ``TimeoutError``,
``socket.gaierror``, ``ssl.SSLError``) and ``EOFError`` (``asyncio.IncompleteReadError``)."""


class OsErrorKind(enum.Enum):
    """What an OS error means to the transport; the value says it in words."""

    EOF = "the peer closed the connection"
    REFUSED = "nothing listens at the address"
    RESET = "the peer reset or aborted the connection"
    TIMED_OUT = "the network did not answer in time"
    UNRESOLVED = "the host name does not resolve"
    ADDRESS_NOT_LOCAL = "the address is not one of this host's interfaces"
    ADDRESS_IN_USE = "the port is already taken"
    OUT_OF_DESCRIPTORS = "the process or system is out of file descriptors"
    OTHER = "another OS error"


OS_ERROR_KINDS: tuple[tuple[type[BaseException], int | None, OsErrorKind], ...] = (
    (EOFError, None, OsErrorKind.EOF),  # asyncio.IncompleteReadError
    (ConnectionRefusedError, None, OsErrorKind.REFUSED),
    (ConnectionResetError, None, OsErrorKind.RESET),
    (ConnectionAbortedError, None, OsErrorKind.RESET),
    (BrokenPipeError, None, OsErrorKind.RESET),
    (TimeoutError, None, OsErrorKind.TIMED_OUT),  # also ETIMEDOUT (TCP_USER_TIMEOUT)
    (socket.gaierror, None, OsErrorKind.UNRESOLVED),
    (OSError, errno.EADDRNOTAVAIL, OsErrorKind.ADDRESS_NOT_LOCAL),
    (OSError, errno.EADDRINUSE, OsErrorKind.ADDRESS_IN_USE),
    (OSError, errno.EMFILE, OsErrorKind.OUT_OF_DESCRIPTORS),
    (OSError, errno.ENFILE, OsErrorKind.OUT_OF_DESCRIPTORS),
)
"""``(type, errno or None, kind)``, first match wins; ``None`` matches any errno.

``OSError(errno.ECONNRESET, ...)`` and the like are already made as the matching
subclass (``ConnectionResetError``, ``BrokenPipeError`` for ``EPIPE``, ``TimeoutError``
for ``ETIMEDOUT``...), so only errnos without a subclass of their own need a row."""


class Stage(enum.Enum):
    """What the transport was doing when the OS error came; picks type and wording."""

    RESOLVE = "cannot resolve"
    LISTEN = "cannot listen on"
    CONNECT = "cannot connect to"
    STREAM = "was lost"
    """An established (or handshaking) connection failed."""


def kind_of(exc: BaseException | None) -> OsErrorKind:
    """What ``exc`` means to the transport; ``None`` (asyncio's ``connection_lost`` for a
    clean close) is ``EOF``, an exception that is not an OS error ``OTHER``."""
    if exc is None:
        return OsErrorKind.EOF
    code = getattr(exc, "errno", None)
    for type_, number, kind in OS_ERROR_KINDS:
        if isinstance(exc, type_) and (number is None or code == number):
            return kind
    return OsErrorKind.OTHER


def describe(exc: BaseException) -> str:
    """``"ConnectionResetError: [Errno 104] Connection reset by peer"``: type and text."""
    return f"{type(exc).__name__}: {exc}"


def lost_reason(exc: BaseException | None, where: str, detail: str = "") -> str:
    """Why the connection to ``where`` ended: ``"<where> closed the connection (EOF)"``
    when the peer closed it (``exc`` is ``None`` or an EOF), else ``"connection to
    <where> was lost (<Type>: <message>)"``; ``detail`` (how far a frame had landed)
    follows either."""
    if exc is None or kind_of(exc) is OsErrorKind.EOF:
        return f"{where} closed the connection (EOF){detail}"
    return f"connection to {where} was lost ({describe(exc)}){detail}"


def transport_error(exc: BaseException | None, what: str, where: str, stage: Stage, *,
                    rank: int | None = None, detail: str = "") -> TransportError:
    """The ``netdist.errors`` exception for ``exc``, met while doing ``what`` to ``where``.

    ``RESOLVE`` / ``LISTEN`` / ``CONNECT``: ``ConnectError("<what>: <stage.value>
    <where><detail>: <Type>: <message>")``, e.g. ``"...: cannot connect to node0:29400
    (3 attempts): ConnectionRefusedError: ..."`` (``exc`` may be ``None`` when no attempt
    was made: the message then ends after ``detail``). ``STREAM``: ``lost_reason`` after
    ``"<what>: "``; a ``PeerLostError`` naming ``rank`` when it is known, else a
    ``ConnectError``. ``exc`` is the result's ``__cause__`` either way.
    """
    if stage is Stage.STREAM:
        reason = lost_reason(exc, where, detail)
        message = f"{what}: {reason}" if what else reason
        error: TransportError = (ConnectError(message) if rank is None
                                 else PeerLostError(rank, message))
    else:
        shown = "" if exc is None else f": {describe(exc)}"
        error = ConnectError(f"{what}: {stage.value} {where}{detail}{shown}")
    error.__cause__ = exc
    return error


@contextmanager
def map_os_errors(what: str, where: str, stage: Stage, *,
                  rank: int | None = None) -> Iterator[None]:
    """Run the block, raising ``transport_error`` for any ``OS_ERRORS`` it raises."""
    try:
        yield
    except OS_ERRORS as exc:
        raise transport_error(exc, what, where, stage, rank=rank) from exc
