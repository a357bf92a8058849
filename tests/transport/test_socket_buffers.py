"""What ``tune_socket`` sets on a peer socket, read back with ``getsockopt``: the receive
buffer is left to the kernel's autotuning, the send buffer is set only where that gives
more than autotuning could (``send_buffer_request``); see docs/multihost.md, "Keeping
the link full"."""

from __future__ import annotations

import socket
import sys

import pytest

from netdist.transport import connection
from netdist.transport.connection import (
    SOCKET_BUFFER_BYTES,
    send_buffer_request,
    tune_socket,
)

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the kernel's buffer sysctls and doubling are Linux's")
MIB = 1024 * 1024


def test_send_buffer_request_asks_only_where_it_beats_autotuning() -> None:
    # this machine's kind: wmem_max 4 MiB grants 8 MiB, autotuning stops at 4 MiB
    assert send_buffer_request(4 * MIB, 4 * MIB) == SOCKET_BUFFER_BYTES
    # the kernel's defaults: a request gets 2 x 212992, autotuning reaches 4 MiB
    assert send_buffer_request(212992, 4 * MIB) is None
    # tcp_wmem raised for long links: autotuning reaches further than any request
    assert send_buffer_request(64 * MIB, 64 * MIB) is None
    assert send_buffer_request(64 * MIB, 8 * MIB) is None  # equal: autotuning adapts
    # not Linux: ask, as before
    assert send_buffer_request(None, 4 * MIB) == SOCKET_BUFFER_BYTES
    assert send_buffer_request(4 * MIB, None) == SOCKET_BUFFER_BYTES


@linux_only
@pytest.mark.parametrize("wmem_max, tcp_wmem_max, explicit", [
    (4 * MIB, 4 * MIB, True), (212992, 4 * MIB, False)])
def test_tune_socket_sets_what_the_sysctls_call_for(
        monkeypatch: pytest.MonkeyPatch, wmem_max: int, tcp_wmem_max: int,
        explicit: bool) -> None:
    sysctls = {connection._WMEM_MAX: wmem_max, connection._TCP_WMEM: tcp_wmem_max}
    monkeypatch.setattr(connection, "read_sysctl", sysctls.__getitem__)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as plain, \
            socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tuned:
        tune_socket(tuned)
        assert tuned.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        # SO_RCVBUF untouched: the kernel's initial tcp_rmem[1], autotuning left on
        assert (tuned.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
                == plain.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))
        sndbuf = tuned.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        if explicit:
            with open("/proc/sys/net/core/wmem_max") as handle:
                granted = 2 * min(SOCKET_BUFFER_BYTES, int(handle.read()))
            assert sndbuf == granted  # the kernel doubles the request, capped by wmem_max
        else:
            assert sndbuf == plain.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)


@linux_only
def test_tune_socket_reads_this_machines_sysctls() -> None:
    """Unpatched: what this machine's sysctls give, computed independently."""
    with open("/proc/sys/net/core/wmem_max") as handle:
        wmem_max = int(handle.read())
    with open("/proc/sys/net/ipv4/tcp_wmem") as handle:
        tcp_wmem_max = int(handle.read().split()[-1])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as plain, \
            socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tuned:
        tune_socket(tuned)
        granted = 2 * min(SOCKET_BUFFER_BYTES, wmem_max)
        expected = granted if granted > tcp_wmem_max else \
            plain.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        assert tuned.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == expected
        assert (tuned.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
                == plain.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))


@linux_only
def test_accepted_sockets_inherit_the_listeners_tuning() -> None:
    """``start_listener`` tunes the listening socket; an accepted one has its send
    buffer."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        tune_socket(server)
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(10.0)
        with socket.create_connection(server.getsockname(), timeout=10.0):
            accepted, _ = server.accept()
            with accepted:
                assert (accepted.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
                        == server.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))
