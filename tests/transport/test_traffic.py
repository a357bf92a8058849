"""Traffic counters (issue 29, item 4): bytes per peer and per host link, exactly.

Over real TCP the payload counts equal what the application sent and received, the wire
counts equal the encoded frames (``encode_data``) byte for byte while nothing else moves
(eager connections, heartbeats far apart), a ring all-reduce moves exactly
``2(n-1)/n * S`` per rank to its one neighbour, and ``by_host`` splits the peers by
host key (``host_ids``: pretend hosts in one process).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from netdist.collectives import Group
from netdist.errors import ConfigError, PeerLostError
from netdist.transport import InProcessTransport, Transport
from netdist.transport.host_identity import host_key
from netdist.transport.local_tcp import create_local_tcp_group
from netdist.transport.traffic import PeerTraffic, Traffic, TrafficCounter
from netdist.wire import PREFIX_SIZE, encode_data
from tests.progress.jobs import jobs_of

QUIET = {"heartbeat_interval": 60.0}
"""No heartbeat within a test: the wire counts of a window are then exact."""

MESSAGES = [np.zeros(0, np.float32), np.arange(2, dtype=np.float32),
            np.arange(1000, dtype=np.uint8), np.ones((100, 175), np.float64),
            np.ones(300_000, np.uint8)]
"""Empty, tiny, small, just over the 64 KiB joined-frame limit, and chunked sizes."""

TAG = 7


def frame_bytes(message: np.ndarray, tag: int = TAG) -> int:
    """What one data frame carrying ``message`` puts on the wire: prefix, header, payload."""
    head = encode_data(message, tag=tag)[0]
    assert len(head) > PREFIX_SIZE  # a fixed 16-byte prefix, then the msgpack header
    return len(head) + message.nbytes


# -- the snapshot arithmetic (pure) ------------------------------------------------------

def test_peer_traffic_adds_and_subtracts_field_by_field() -> None:
    a = PeerTraffic(10, 1, 20, 2, 50, 60)
    b = PeerTraffic(1, 1, 2, 1, 5, 6)
    assert a + b == PeerTraffic(11, 2, 22, 3, 55, 66)
    assert a - b == PeerTraffic(9, 0, 18, 1, 45, 54)
    assert a + PeerTraffic() == a


def test_counter_snapshot_is_frozen() -> None:
    counter = TrafficCounter()
    counter.sent_bytes += 5
    counter.sent_messages += 1
    counter.wire_received_bytes += 3
    snap = counter.snapshot()
    counter.sent_bytes += 5
    assert snap == PeerTraffic(sent_bytes=5, sent_messages=1, wire_received_bytes=3)


def test_traffic_groups_peers_by_host_and_subtracts() -> None:
    keys = (b"A", b"A", b"B", b"B", b"C")
    after = Traffic(0, {1: PeerTraffic(1, 1), 2: PeerTraffic(20, 2), 3: PeerTraffic(300, 3),
                        4: PeerTraffic(4000, 4)}, keys)
    before = Traffic(0, {1: PeerTraffic(1, 1), 2: PeerTraffic(10, 1)}, keys)
    assert after.total == PeerTraffic(4321, 10)
    assert after.own_host == PeerTraffic(1, 1)
    assert dict(after.by_host) == {b"B": PeerTraffic(320, 5), b"C": PeerTraffic(4000, 4)}
    assert after.ranks_on(b"B") == (2, 3) and after.ranks_on(b"?") == ()
    window = after - before
    assert dict(window.peers) == {1: PeerTraffic(), 2: PeerTraffic(10, 1),
                                  3: PeerTraffic(300, 3), 4: PeerTraffic(4000, 4)}
    assert window.by_host[b"B"] == PeerTraffic(310, 4)
    text = after.describe()
    assert text.splitlines()[0] == f"rank 0 total: {after.total.describe()}"
    assert "link to host of ranks 2, 3: sent 320 B in 5 msgs" in text
    with pytest.raises(ValueError, match="rank 1's traffic from rank 0's"):
        after - Traffic(1, {}, keys)


def test_unknown_host_keys_leave_the_host_view_empty() -> None:
    traffic = Traffic(1, {0: PeerTraffic(8, 1)})
    assert traffic.total == PeerTraffic(8, 1)
    assert dict(traffic.by_host) == {} and traffic.own_host == PeerTraffic()
    with pytest.raises(TypeError):
        traffic.peers[0] = PeerTraffic()  # type: ignore[index]


# -- over real TCP -----------------------------------------------------------------------

async def test_exact_payload_and_wire_counts_over_tcp(tcp_group: Any) -> None:
    a, b = await tcp_group(2, **QUIET)
    before_a, before_b = a.traffic(), b.traffic()
    posted = asyncio.ensure_future(b.recv(0, tag=TAG, out=np.empty(0, np.float32)))
    for message in MESSAGES:
        await a.send(1, message, tag=TAG)
    await posted  # the first landed in a posted buffer, the rest were held unexpected
    for message in MESSAGES[1:]:
        got = await b.recv(0, tag=TAG)
        assert got.nbytes == message.nbytes
    payload = sum(m.nbytes for m in MESSAGES)
    wire = sum(frame_bytes(m) for m in MESSAGES)
    sent, got = (a.traffic() - before_a).peers[1], (b.traffic() - before_b).peers[0]
    assert sent == PeerTraffic(sent_bytes=payload, sent_messages=len(MESSAGES),
                               wire_sent_bytes=wire)
    assert got == PeerTraffic(received_bytes=payload, received_messages=len(MESSAGES),
                              wire_received_bytes=wire)
    assert wire - payload >= len(MESSAGES) * PREFIX_SIZE


async def test_wire_counts_include_the_handshake(tcp_group: Any) -> None:
    a, b = await tcp_group(2, **QUIET)
    # eager: each side's handshake frames are already counted, and mirror each other
    ta, tb = a.traffic().peers[1], b.traffic().peers[0]
    assert ta.sent_messages == ta.received_messages == 0
    assert ta.wire_sent_bytes > 0 and ta.wire_received_bytes > 0
    assert (ta.wire_sent_bytes, ta.wire_received_bytes) == (tb.wire_received_bytes,
                                                            tb.wire_sent_bytes)


async def test_windows_add_up_and_a_lost_peer_keeps_its_counts(tcp_group: Any) -> None:
    a, b = await tcp_group(2, **QUIET)
    start = a.traffic()
    await a.send(1, b"x" * 100)
    await b.recv(0)
    middle = a.traffic()
    await b.send(0, b"y" * 40)
    await a.recv(1)
    end = a.traffic()
    first, second = (middle - start).peers[1], (end - middle).peers[1]
    assert (first.sent_bytes, first.received_bytes) == (100, 0)
    assert (second.sent_bytes, second.received_bytes) == (0, 40)
    assert (end - start).peers[1] == first + second
    await b.aclose()
    with pytest.raises(PeerLostError):
        await a.recv(1, timeout=5.0)
    kept = a.traffic().peers[1]
    assert (kept.sent_bytes, kept.received_bytes) == (end.peers[1].sent_bytes,
                                                      end.peers[1].received_bytes)
    assert kept.wire_received_bytes > end.peers[1].wire_received_bytes  # b's goodbye


async def test_a_peer_never_connected_reads_zero(tcp_group: Any) -> None:
    a, b, c = await tcp_group(3, connect="lazy", **QUIET)
    await a.send(1, b"abc")
    await b.recv(0)
    traffic = a.traffic()
    assert traffic.peers[2] == PeerTraffic()
    assert traffic.peers[1].sent_bytes == 3 and set(traffic.peers) == {1, 2}


async def test_ring_all_reduce_moves_two_n_minus_one_over_n_per_rank() -> None:
    n, size = 4, 4 * 1024 * 1024  # bytes; the ring's chunks and segments divide it evenly
    transports = await create_local_tcp_group(n, timeout=60.0, connect_timeout=30.0, **QUIET)
    groups = [Group(t, shared_memory=False) for t in transports]
    try:
        data = [np.full(size // 4, t.rank + 1, np.float32) for t in transports]
        await asyncio.gather(*(g.all_reduce(d) for g, d in zip(groups, data)))  # connects
        before = [t.traffic() for t in transports]
        await asyncio.gather(*(g.all_reduce(d) for g, d in zip(groups, data)))
        assert all(d[0] == 10 * n for d in data)  # (1+2+3+4) * 4: two sums of the sums
        ring = 2 * (n - 1) * size // n
        for t, b in zip(transports, before):
            window = t.traffic() - b
            nxt, prev = (t.rank + 1) % n, (t.rank - 1) % n
            assert window.total.sent_bytes == window.total.received_bytes == ring
            assert window.peers[nxt].sent_bytes == ring
            assert window.peers[prev].received_bytes == ring
            assert window.peers[nxt].sent_messages == window.peers[prev].received_messages
            assert window.total.wire_sent_bytes >= ring + window.total.sent_messages * PREFIX_SIZE
        # what the ranks sent is what the ranks received, on the wire too
        totals = [t.traffic().total for t in transports]
        assert sum(x.wire_sent_bytes for x in totals) == sum(x.wire_received_bytes for x in totals)
    finally:
        await asyncio.gather(*(g.aclose() for g in groups))
        await asyncio.gather(*(t.aclose() for t in transports))


async def test_by_host_splits_peers_by_host_key(tcp_group: Any) -> None:
    ranks = await tcp_group(4, host_ids=["a", "a", "b", "b"], **QUIET)
    keys = ranks[0].host_keys()
    assert keys == (host_key("a"), host_key("a"), host_key("b"), host_key("b"))
    before = [t.traffic() for t in ranks]
    for dst, size in ((1, 100), (2, 200), (3, 300)):
        await ranks[0].send(dst, np.zeros(size, np.uint8))
        await ranks[dst].recv(0)
    zero = ranks[0].traffic() - before[0]
    assert list(zero.by_host) == [host_key("b")] and zero.ranks_on(host_key("b")) == (2, 3)
    assert zero.by_host[host_key("b")].sent_bytes == 500
    assert zero.by_host[host_key("b")].sent_messages == 2
    assert zero.own_host.sent_bytes == 100
    two = ranks[2].traffic() - before[2]
    assert two.by_host[host_key("a")].received_bytes == 200
    assert two.own_host == PeerTraffic()


def test_host_id_stands_in_for_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NETDIST_HOST_ID", "h7")
    from_env = host_key()
    monkeypatch.delenv("NETDIST_HOST_ID")
    assert host_key("h7") == from_env != host_key()
    assert host_key("") == host_key()


async def test_host_ids_must_match_the_group_size() -> None:
    with pytest.raises(ConfigError, match="2 host_ids for 3 ranks"):
        await create_local_tcp_group(3, host_ids=["a", "b"])


# -- other transports and the blocking API -----------------------------------------------

async def test_in_process_counts_payload_and_no_wire() -> None:
    a, b, c = InProcessTransport.create_group(3, timeout=5.0)
    assert a.traffic().total == PeerTraffic()
    for message in MESSAGES:
        await a.send(2, message, tag=TAG)
    await c.recv(0, tag=TAG, out=np.empty(0, np.float32))
    payload = sum(m.nbytes for m in MESSAGES)
    assert a.traffic().peers == {1: PeerTraffic(), 2: PeerTraffic(payload, len(MESSAGES))}
    # every message has arrived (held or landed), so all of them count on arrival
    assert c.traffic().peers[0] == PeerTraffic(received_bytes=payload,
                                               received_messages=len(MESSAGES))
    assert a.traffic().own_host == a.traffic().total and dict(a.traffic().by_host) == {}


class _Silent(Transport):
    """A transport that counts nothing: the base class's default."""

    def __init__(self) -> None:
        self.rank, self.world_size, self.timeout = 1, 3, 1.0

    async def send(self, dst: int, data: Any, *, tag: int = 0,
                   timeout: float | None = None) -> None:
        raise NotImplementedError

    async def recv(self, src: int, *, tag: int = 0, out: np.ndarray | None = None,
                   timeout: float | None = None) -> np.ndarray:
        raise NotImplementedError

    async def barrier(self, *, timeout: float | None = None) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        pass


def test_the_default_reports_zeros_for_every_peer() -> None:
    traffic = _Silent().traffic()
    assert traffic.rank == 1 and dict(traffic.peers) == {0: PeerTraffic(), 2: PeerTraffic()}
    assert traffic.host_keys is None


def test_blocking_api_reads_the_counters() -> None:
    with jobs_of(2, **QUIET) as (zero, one):
        before = zero.transport.traffic()
        zero.transport.send(1, np.ones(1000, np.float32))
        one.transport.recv(0)
        window = zero.transport.traffic() - before
        assert isinstance(window, Traffic)
        assert window.peers[1].sent_bytes == 4000 and window.peers[1].sent_messages == 1
