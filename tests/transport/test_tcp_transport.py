"""TcpTransport specifics: large transfers, interrupted frames, heartbeats, init()."""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
import pytest

from netdist.config import DistributedConfig
from netdist.errors import (
    ConnectError,
    NetdistTimeoutError,
    PeerLostError,
)
from netdist.transport import TcpTransport, init
from netdist.wire import encode_data
from tests.ranks import start_until_blocked


@pytest.mark.slow
async def test_64_mib_transfer_lands_exactly_in_out(tcp_group):
    a, b = await tcp_group(2)
    data = np.random.default_rng(0).standard_normal(16 * 1024 * 1024).astype(np.float32)
    out = np.zeros_like(data)
    pending = await start_until_blocked(b.recv(0, tag=3, out=out))
    await a.send(1, data, tag=3)
    assert await pending is out
    np.testing.assert_array_equal(out, data)
    # and the reverse direction, unexpected (no receive posted yet)
    await b.send(0, data[::-1].copy(), tag=4)
    back = await a.recv(1, tag=4)
    np.testing.assert_array_equal(back, data[::-1])


async def test_large_unexpected_messages_are_kept_in_order(tcp_group):
    a, b = await tcp_group(2)
    arrays = [np.full(300_000, i, np.float64) for i in range(4)]
    for arr in arrays:
        await a.send(1, arr, tag=2)
    out = np.empty(300_000)
    for i in range(4):
        got = await b.recv(0, tag=2, out=out if i % 2 else None)
        assert float(got[0]) == float(got[-1]) == i


async def test_connect_exposes_addresses(tcp_group):
    group = await tcp_group(3)
    for t in group:
        assert t.listen_address is not None and t.listen_address[0] == "127.0.0.1"
        assert [a.port for a in t.peer_addresses] == [g.listen_address[1] for g in group]
        assert "TcpTransport rank" in repr(t)


async def test_world_size_one_opens_no_sockets():
    config = DistributedConfig(rank=0, world_size=1, coordinator=("127.0.0.1", 1))
    async with init(config) as transport:
        assert isinstance(transport, TcpTransport)
        assert transport.listen_address is None
        await transport.barrier(timeout=1.0)
    assert transport.closed


async def test_init_reads_the_environment(monkeypatch):
    for name in ("NETDIST_RANK", "NETDIST_WORLD_SIZE", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETDIST_RANK", "0")
    monkeypatch.setenv("NETDIST_WORLD_SIZE", "1")
    monkeypatch.setenv("NETDIST_TIMEOUT", "3.5")
    async with init(job_id="from-env") as transport:
        assert (transport.rank, transport.world_size) == (0, 1)
        assert transport.timeout == 3.5
        assert transport.config.job_id == "from-env"


async def test_unreachable_coordinator_is_a_connect_error_within_the_timeout():
    import socket
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = DistributedConfig(rank=1, world_size=2, coordinator=("127.0.0.1", port),
                               token="t" * 32, connect_timeout=0.4)
    started = time.monotonic()
    with pytest.raises(ConnectError, match=f"127.0.0.1:{port}"):
        await TcpTransport.connect(config)
    assert time.monotonic() - started < 3.0


async def test_send_timeout_mid_frame_drops_the_connection(tcp_group):
    a, b = await tcp_group(2)
    b._connections[0].transport.pause_reading()  # b stops reading: a's frame stalls
    big = np.ones(64 * 1024 * 1024 // 8, np.float64)
    with pytest.raises(NetdistTimeoutError,
                       match=r"send to rank 1 \(tag 9\) timed out after .* payload bytes "
                             r"written; connection dropped"):
        await a.send(1, big, tag=9, timeout=0.3)
    with pytest.raises(PeerLostError, match="timed out") as later:
        await a.send(1, b"x", tag=0)
    assert later.value.rank == 1
    b._connections[0].transport.resume_reading()
    # b never takes the partial frame as data: its receive fails instead
    with pytest.raises(PeerLostError, match=r"rank 0 closed the connection \(EOF\) after "
                                            r"\d+ of 67108864 payload bytes \(tag 9\)"):
        await b.recv(0, tag=9, timeout=5.0)


async def test_recv_timeout_mid_frame_drops_the_connection(tcp_group):
    a, b = await tcp_group(2)
    head, payload = encode_data(np.arange(1024, dtype=np.float32), tag=4)
    # write the header and half the payload by hand, as a sender that then stalls
    a._connections[1].transport.write(bytes(head) + bytes(payload[:2048]))
    out = np.zeros(1024, np.float32)
    with pytest.raises(NetdistTimeoutError, match=r"recv from rank 0 \(tag 4\)"):
        await b.recv(0, tag=4, out=out, timeout=0.3)
    with pytest.raises(PeerLostError, match=r"gave up after 2048 of 4096 payload bytes "
                                            r"\(tag 4\)") as info:
        await b.recv(0, tag=5, timeout=5.0)
    assert info.value.rank == 0
    with pytest.raises(PeerLostError):
        await a.recv(1, tag=5, timeout=5.0)


async def test_cancelled_send_mid_frame_drops_the_connection(tcp_group):
    a, b = await tcp_group(2)
    b._connections[0].transport.pause_reading()
    task = asyncio.create_task(a.send(1, np.ones(8 * 1024 * 1024), tag=1, timeout=5.0))
    while a._connections[1].transport.get_write_buffer_size() == 0 and not task.done():
        await asyncio.sleep(0.01)  # until the frame is partly out
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(PeerLostError, match="was cancelled after"):
        await a.recv(1, timeout=5.0)


async def test_eof_in_the_middle_of_a_payload_names_the_progress(tcp_group):
    a, b = await tcp_group(2)
    head, payload = encode_data(np.zeros(1024, np.uint8), tag=17)
    conn = a._connections[1]
    conn.transport.write(bytes(head) + bytes(payload[:100]))
    conn.transport.close()
    with pytest.raises(PeerLostError,
                       match=r"rank 0 closed the connection \(EOF\) after 100 of 1024 "
                             r"payload bytes \(tag 17\)"):
        await b.recv(0, tag=17, timeout=5.0)


async def test_garbage_from_a_connected_peer_is_a_protocol_violation(tcp_group, caplog):
    a, b, c = await tcp_group(3)
    a._connections[1].transport.write(b"this is not a frame at all......")
    with caplog.at_level(logging.WARNING, logger="netdist.transport"):
        with pytest.raises(PeerLostError, match="rank 0 violated the protocol: bad magic"):
            await b.recv(0, timeout=5.0)
    assert "protocol violation from rank 0" in caplog.text
    await a.send(2, b"still fine", tag=1)
    assert bytes(await c.recv(0, tag=1)) == b"still fine"


async def test_bye_is_reported_as_an_orderly_close(tcp_group):
    a, b = await tcp_group(2)
    await b.aclose()
    with pytest.raises(PeerLostError, match=r"^rank 1 closed its transport \(left the job\) "
                                            r"before this rank's recv on tag 0$"):
        await a.recv(1, timeout=5.0)


async def test_idle_connections_stay_alive_on_heartbeats(tcp_group):
    a, b = await tcp_group(2, heartbeat_interval=0.1, heartbeat_misses=3)
    await asyncio.sleep(1.0)  # idle for ten heartbeat intervals (the scenario, not a sync)
    await a.send(1, b"ping", tag=1)
    assert bytes(await b.recv(0, tag=1)) == b"ping"


async def test_a_blocked_loop_does_not_declare_peers_dead(tcp_group):
    a, b = await tcp_group(2, heartbeat_interval=0.05, heartbeat_misses=2)
    deadline = time.perf_counter() + 0.5
    while time.perf_counter() < deadline:  # CPU-bound work holding the event loop
        np.dot(np.ones(1000), np.ones(1000))
    await a.send(1, b"after compute", tag=1)
    assert bytes(await b.recv(0, tag=1)) == b"after compute"
    await b.send(0, b"reply", tag=1)
    assert bytes(await a.recv(1, tag=1)) == b"reply"


async def test_a_silent_peer_is_declared_lost(tcp_group, caplog):
    a, b = await tcp_group(2, heartbeat_interval=0.1, heartbeat_misses=2)
    b._monitor_task.cancel()  # b stays connected but never sends another byte
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="netdist.transport"):
        with pytest.raises(PeerLostError, match=r"rank 1 sent nothing for .*presumed dead"):
            await a.recv(1, timeout=10.0)
    assert time.monotonic() - started < 5.0
    assert "rank 0 lost rank 1" in caplog.text
