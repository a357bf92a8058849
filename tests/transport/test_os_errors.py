"""netdist.transport.os_errors: each OS error kind becomes one netdist exception type,
with a message naming what was being done and where."""

from __future__ import annotations

import asyncio
import errno
import socket
import ssl

import pytest

from netdist.errors import ConnectError, PeerLostError, TransportError
from netdist.transport.os_errors import (
    OS_ERRORS,
    OsErrorKind,
    Stage,
    kind_of,
    lost_reason,
    map_os_errors,
    transport_error,
)

RESET = ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
REFUSED = ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
PIPE = BrokenPipeError(errno.EPIPE, "Broken pipe")
ABORTED = ConnectionAbortedError(errno.ECONNABORTED, "Software caused connection abort")
TIMED_OUT = TimeoutError(errno.ETIMEDOUT, "Connection timed out")
UNRESOLVED = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
NOT_LOCAL = OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")
IN_USE = OSError(errno.EADDRINUSE, "Address already in use")
NO_FDS = OSError(errno.EMFILE, "Too many open files")
NO_SYSTEM_FDS = OSError(errno.ENFILE, "Too many open files in system")
UNREACHABLE = OSError(errno.EHOSTUNREACH, "No route to host")
INCOMPLETE = asyncio.IncompleteReadError(b"ab", 10)
TLS = ssl.SSLError(1, "bad record mac")


@pytest.mark.parametrize(("exc", "kind"), [
    (None, OsErrorKind.EOF),
    (INCOMPLETE, OsErrorKind.EOF),
    (REFUSED, OsErrorKind.REFUSED),
    (OSError(errno.ECONNREFUSED, "refused"), OsErrorKind.REFUSED),  # made as the subclass
    (RESET, OsErrorKind.RESET),
    (PIPE, OsErrorKind.RESET),
    (ABORTED, OsErrorKind.RESET),
    (TIMED_OUT, OsErrorKind.TIMED_OUT),
    (TimeoutError("connect timed out"), OsErrorKind.TIMED_OUT),
    (UNRESOLVED, OsErrorKind.UNRESOLVED),
    (NOT_LOCAL, OsErrorKind.ADDRESS_NOT_LOCAL),
    (IN_USE, OsErrorKind.ADDRESS_IN_USE),
    (NO_FDS, OsErrorKind.OUT_OF_DESCRIPTORS),
    (NO_SYSTEM_FDS, OsErrorKind.OUT_OF_DESCRIPTORS),
    (UNREACHABLE, OsErrorKind.OTHER),
    (TLS, OsErrorKind.OTHER),
    (RuntimeError("not an OS error"), OsErrorKind.OTHER),
])
def test_kind_of(exc: BaseException | None, kind: OsErrorKind) -> None:
    assert kind_of(exc) is kind


WHAT = "rank 1 reaching the coordinator"
WHERE = "node0:29400"

# (exc, stage, rank, detail, exact type, exact message)
CASES: list[tuple[BaseException | None, Stage, int | None, str, type[TransportError], str]] = [
    (REFUSED, Stage.CONNECT, None, " (3 attempts)", ConnectError,
     f"{WHAT}: cannot connect to {WHERE} (3 attempts): "
     "ConnectionRefusedError: [Errno 111] Connection refused"),
    (TimeoutError("connect timed out"), Stage.CONNECT, None, " (1 attempt)", ConnectError,
     f"{WHAT}: cannot connect to {WHERE} (1 attempt): TimeoutError: connect timed out"),
    (UNREACHABLE, Stage.CONNECT, None, "", ConnectError,
     f"{WHAT}: cannot connect to {WHERE}: OSError: [Errno 113] No route to host"),
    (None, Stage.CONNECT, None, " (1 attempt)", ConnectError,
     f"{WHAT}: cannot connect to {WHERE} (1 attempt)"),  # no time left for an attempt
    (UNRESOLVED, Stage.RESOLVE, None, "", ConnectError,
     f"{WHAT}: cannot resolve {WHERE}: gaierror: [Errno -2] Name or service not known"),
    (IN_USE, Stage.LISTEN, None, "", ConnectError,
     f"{WHAT}: cannot listen on {WHERE}: OSError: [Errno 98] Address already in use"),
    (NOT_LOCAL, Stage.LISTEN, None, "", ConnectError,
     f"{WHAT}: cannot listen on {WHERE}: OSError: [Errno 99] Cannot assign requested "
     "address"),
    (RESET, Stage.STREAM, 2, "", PeerLostError,
     f"{WHAT}: connection to {WHERE} was lost (ConnectionResetError: [Errno 104] "
     "Connection reset by peer)"),
    (PIPE, Stage.STREAM, 2, "", PeerLostError,
     f"{WHAT}: connection to {WHERE} was lost (BrokenPipeError: [Errno 32] Broken pipe)"),
    (TIMED_OUT, Stage.STREAM, 2, "", PeerLostError,
     f"{WHAT}: connection to {WHERE} was lost (TimeoutError: [Errno 110] Connection "
     "timed out)"),
    (TLS, Stage.STREAM, 2, "", PeerLostError,
     f"{WHAT}: connection to {WHERE} was lost (SSLError: bad record mac)"),
    (INCOMPLETE, Stage.STREAM, 2, " after 2 of 10 payload bytes (tag 7)", PeerLostError,
     f"{WHAT}: {WHERE} closed the connection (EOF) after 2 of 10 payload bytes (tag 7)"),
    (None, Stage.STREAM, 2, "", PeerLostError, f"{WHAT}: {WHERE} closed the connection (EOF)"),
    (RESET, Stage.STREAM, None, "", ConnectError,  # before the handshake named the peer
     f"{WHAT}: connection to {WHERE} was lost (ConnectionResetError: [Errno 104] "
     "Connection reset by peer)"),
]


@pytest.mark.parametrize(("exc", "stage", "rank", "detail", "type_", "message"), CASES)
def test_transport_error(exc: BaseException | None, stage: Stage, rank: int | None,
                         detail: str, type_: type[TransportError], message: str) -> None:
    error = transport_error(exc, WHAT, WHERE, stage, rank=rank, detail=detail)
    assert type(error) is type_
    assert str(error) == message
    assert WHAT in str(error) and WHERE in str(error)
    assert error.__cause__ is exc  # callers still ask kind_of(error.__cause__)
    if isinstance(error, PeerLostError):
        assert error.rank == rank and error.origin_rank == rank


RAISED = [case for case in CASES if case[0] is not None and not case[3]]
"""The cases a block can raise (an OS error, no detail)."""


@pytest.mark.parametrize(("exc", "stage", "rank", "detail", "type_", "message"), RAISED)
def test_map_os_errors(exc: BaseException, stage: Stage, rank: int | None,
                       detail: str, type_: type[TransportError], message: str) -> None:
    assert isinstance(exc, OS_ERRORS)
    with pytest.raises(type_) as raised:
        with map_os_errors(WHAT, WHERE, stage, rank=rank):
            raise exc
    assert str(raised.value) == message
    assert raised.value.__cause__ is exc


def test_map_os_errors_leaves_other_exceptions_alone() -> None:
    with pytest.raises(ValueError, match="not an OS error"):
        with map_os_errors(WHAT, WHERE, Stage.STREAM):
            raise ValueError("not an OS error")
    with map_os_errors(WHAT, WHERE, Stage.STREAM):
        pass  # nothing raised, nothing mapped


def test_lost_reasons_are_the_ones_connections_record() -> None:
    # the wording tests/transport/test_multiprocess.py and test_blame*.py look for
    assert lost_reason(None, "rank 2") == "rank 2 closed the connection (EOF)"
    assert lost_reason(RESET, "rank 2", " after 5 of 9 payload bytes (tag 3)") == (
        "connection to rank 2 was lost (ConnectionResetError: [Errno 104] Connection "
        "reset by peer) after 5 of 9 payload bytes (tag 3)")
