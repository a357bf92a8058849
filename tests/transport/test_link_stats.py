"""The kernel's view of a connection (``netdist.transport.link_stats``) and what the
transport decides from it: the liveness window on lossy links, delivery at close."""

from __future__ import annotations

import socket
import sys

import numpy as np
import pytest

from netdist.errors import UndeliveredError
from netdist.transport.link_stats import (
    KERNEL_GIVE_UP_MS,
    LOSSY_LINK_FACTOR,
    LinkWatch,
    TcpStats,
    cap_retransmit_backoff,
    tcp_stats,
    unsent_bytes,
)
from netdist.transport.local_tcp import create_local_tcp_group

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="TCP_INFO and SIOCOUTQ are Linux's")


def _stats(*, retransmits: int = 0, total_retrans: int = 0, ooo: int = 0) -> TcpStats:
    return TcpStats(retransmits=retransmits, backoff=0, last_ack_recv=0.0,
                    total_retrans=total_retrans, bytes_acked=0, bytes_received=0,
                    rcv_ooopack=ooo)


BASE = 10.0


def test_a_clean_link_keeps_the_plain_window() -> None:
    watch = LinkWatch()
    for tick in range(40):
        watch.observe(_stats(), now=tick * 0.5, heard_at=min(tick * 0.5, 5.0))
    assert not watch.lossy(BASE)
    assert watch.window(BASE) == BASE


@pytest.mark.parametrize("evidence", ["retransmitting", "retransmitted", "out_of_order"])
def test_losses_while_the_peer_talks_stretch_the_window(evidence: str) -> None:
    watch = LinkWatch()
    watch.observe(_stats(), now=0.0, heard_at=0.0)
    lossy = {"retransmitting": _stats(retransmits=1), "retransmitted": _stats(total_retrans=1),
             "out_of_order": _stats(ooo=1)}[evidence]
    watch.observe(lossy, now=1.0, heard_at=1.0)
    watch.observe(_stats(total_retrans=1, ooo=1), now=1.5, heard_at=1.5)  # heard after it
    assert watch.lossy(BASE)
    assert watch.window(BASE) == BASE * LOSSY_LINK_FACTOR
    # silent from 1.5 on: the loss is still within BASE of the last word
    watch.observe(_stats(total_retrans=1, ooo=1), now=20.0, heard_at=1.5)
    assert watch.window(BASE) == BASE * LOSSY_LINK_FACTOR


def test_losses_only_after_the_peer_went_quiet_do_not_stretch() -> None:
    """A partition or a stopped peer on a clean link: this side's heartbeats are
    retransmitted, but only after the silence began, so the peer is named on time."""
    watch = LinkWatch()
    watch.observe(_stats(), now=0.0, heard_at=0.0)
    for tick in range(1, 30):
        watch.observe(_stats(retransmits=1, total_retrans=tick), now=tick * 0.5, heard_at=0.0)
    assert not watch.lossy(BASE)
    assert watch.window(BASE) == BASE


def test_an_old_loss_does_not_stretch_a_later_silence() -> None:
    watch = LinkWatch()
    watch.observe(_stats(), now=0.0, heard_at=0.0)
    watch.observe(_stats(total_retrans=1), now=1.0, heard_at=1.0)
    watch.observe(_stats(total_retrans=1), now=20.0, heard_at=20.0)
    assert watch.lossy(BASE)  # lost within the stretched window before the last word
    watch.observe(_stats(total_retrans=1), now=40.0, heard_at=40.0)  # quiet link since
    assert not watch.lossy(BASE)


def test_unknown_counters_keep_the_plain_window() -> None:
    watch = LinkWatch()
    watch.observe(None, now=1.0, heard_at=1.0)
    assert watch.window(BASE) == BASE


@linux_only
def test_the_kernel_counts_what_a_real_connection_moved() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    try:
        client.sendall(b"x" * 100_000)
        received = 0
        while received < 100_000:
            received += len(server.recv(1 << 20))
        stats = tcp_stats(client)
        assert stats is not None
        assert stats.bytes_acked is not None and stats.bytes_acked >= 100_000
        assert stats.retransmits == 0
        assert unsent_bytes(client) == 0
        if cap_retransmit_backoff(client):  # the kernel took the cap: retries are timed
            assert client.getsockopt(socket.IPPROTO_TCP, 44) == 1000  # TCP_RTO_MAX_MS
            assert client.getsockopt(socket.IPPROTO_TCP,
                                     socket.TCP_USER_TIMEOUT) == KERNEL_GIVE_UP_MS
    finally:
        for sock in (client, server, listener):
            sock.close()
    assert tcp_stats(client) is None  # closed: unknown, not an error
    assert unsent_bytes(client) is None


@linux_only
async def test_a_close_that_cannot_deliver_names_the_peer_and_the_bytes_left() -> None:
    """The receiver stops reading and its window closes: the sender's send returned (the
    bytes are with its kernel), but its clean close cannot hand them over, and says so
    instead of returning as if they had arrived."""
    sender, receiver = await create_local_tcp_group(2, heartbeat_interval=0.1,
                                                    heartbeat_misses=5, timeout=30.0)
    try:
        await sender.send(1, np.zeros(4, np.uint8))
        await receiver.recv(0)
        inbound = receiver._connections[0]
        assert inbound is not None and inbound.transport is not None
        inbound.transport.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        inbound.transport.pause_reading()  # a receiver that stopped reading...
        assert receiver._monitor_task is not None
        receiver._monitor_task.cancel()  # ...without declaring the sender dead meanwhile
        payload = 2 * 1024 * 1024  # fits the sender's socket buffer: the send returns
        await sender.send(1, np.ones(payload, np.uint8))
        with pytest.raises(UndeliveredError) as raised:
            await sender.aclose()
        left = raised.value.undelivered[1]
        assert 0 < left <= payload + 4096
        assert f"rank 1: {left} bytes not acknowledged" in str(raised.value)
        await sender.aclose()  # idempotent: the error was reported once
    finally:
        await sender.aclose()
        await receiver.aclose()
