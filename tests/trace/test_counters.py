"""Counters and their Prometheus endpoint (issue 33): exact, per peer, served over HTTP.

- ``counters(transport)``: payload bytes and messages per peer equal what was sent, wire
  bytes equal the transport's own count, the rank a collective ended waiting for gets the
  wait, the flight recorder's collectives and dumps are counted, TCP link statistics are
  read where the kernel has them; a progress-thread ``Job``'s blocking transport works
  too.
- ``format_prometheus``: text format 0.0.4, parsed back here line by line with exact
  values.
- ``MetricsServer``: ``GET /metrics`` over a real socket, 404 / 405 / 431 / 408, at most
  one request per connection, closed cleanly; ``NETDIST_METRICS_*`` settings.

Every network wait is bounded (``OP`` seconds, or the server's own limits).
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from netdist.collectives import Group
from netdist.config import ConnectMode
from netdist.errors import ConfigError
from netdist.trace import metrics_server
from netdist.trace.counters import Counters, PeerCounters, counters
from netdist.trace.metrics_server import (
    MAX_REQUEST_BYTES,
    MetricsServer,
    start_metrics_from_env,
    start_metrics_server,
)
from netdist.trace.prometheus import CONTENT_TYPE, MetricsSettings, format_prometheus
from netdist.transport import InProcessTransport
from netdist.transport.local_tcp import create_local_tcp_group
from netdist.transport.tcp import TcpTransport
from tests.ranks import free_port, start_until_blocked

OP = 10.0
"""Bound on every operation and network wait of these tests."""

QUIET = {"heartbeat_interval": 60.0, "timeout": OP, "connect_timeout": OP,
         "connect": ConnectMode.EAGER}
"""No heartbeat within a test (wire counts stay still), full mesh at start."""

TAG = 5
LINUX = sys.platform.startswith("linux")


@pytest.fixture
async def pair() -> AsyncIterator[list[TcpTransport]]:
    transports = await create_local_tcp_group(2, **QUIET)
    try:
        yield transports
    finally:
        for transport in transports:
            await transport.aclose()


# -- a small parser of the text format (what a scraper does) -----------------------------

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(?:,|$)')


def parse_prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``text``, keyed by ``(name, sorted labels)``; checks the format's
    rules as it goes: a final line feed, each metric's HELP then TYPE once before its
    samples, all of a metric's samples together, counters named ``*_total``."""
    assert text.endswith("\n")
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    helped: set[str] = set()
    typed: dict[str, str] = {}
    finished: set[str] = set()
    current = None
    for line in text[:-1].split("\n"):
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert name not in helped and name not in typed
            helped.add(name)
            if current is not None:
                finished.add(current)
            current = name
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name == current and name not in typed
            assert kind in ("counter", "gauge")
            assert (kind == "counter") == name.endswith("_total")
            typed[name] = kind
            continue
        match = _SAMPLE.match(line)
        assert match, line
        name, labels_text, value = match.groups()
        assert name == current and name in typed and name not in finished, line
        labels = tuple(sorted(_LABEL.findall(labels_text or "")))
        key = (name, labels)
        assert key not in samples
        samples[key] = float(value)
    return samples


def peer_sample(name: str, rank: int, peer: int) -> tuple[str, tuple[tuple[str, str], ...]]:
    return (name, (("peer", str(peer)), ("rank", str(rank))))


def rank_sample(name: str, rank: int) -> tuple[str, tuple[tuple[str, str], ...]]:
    return (name, (("rank", str(rank)),))


# -- counters over real TCP --------------------------------------------------------------

async def test_payload_and_wire_counts_are_exact_per_peer(pair: list[TcpTransport]) -> None:
    a, b = pair
    before_a, before_b = counters(a), counters(b)
    messages = [np.arange(10, dtype=np.float32), np.ones(70_000, np.uint8),
                np.zeros(0, np.int64)]
    for message in messages:
        await a.send(1, message, tag=TAG, timeout=OP)
    for message in messages:
        got = await b.recv(0, tag=TAG, timeout=OP)
        assert got.nbytes == message.nbytes
    await b.send(0, np.arange(3, dtype=np.int16), tag=TAG, timeout=OP)
    await a.recv(1, tag=TAG, timeout=OP)
    payload = sum(m.nbytes for m in messages)

    after_a, after_b = counters(a), counters(b)
    traffic_a = a.traffic().peers[1]
    sent = after_a.peers[1]
    assert (sent.sent_bytes - before_a.peers[1].sent_bytes,
            sent.sent_messages - before_a.peers[1].sent_messages) == (payload, 3)
    assert (sent.received_bytes - before_a.peers[1].received_bytes,
            sent.received_messages - before_a.peers[1].received_messages) == (6, 1)
    got = after_b.peers[0]
    assert (got.received_bytes - before_b.peers[0].received_bytes,
            got.received_messages - before_b.peers[0].received_messages) == (payload, 3)
    # wire bytes are the transport's own counts, frames and handshake included
    assert (sent.wire_sent_bytes, sent.wire_received_bytes) == (
        traffic_a.wire_sent_bytes, traffic_a.wire_received_bytes)
    assert sent.wire_sent_bytes - before_a.peers[1].wire_sent_bytes > payload
    assert (after_a.rank, after_a.world_size, list(after_a.peers)) == (0, 2, [1])
    assert after_a.total == PeerCounters(
        -1, sent.sent_bytes, sent.sent_messages, sent.received_bytes, sent.received_messages,
        sent.wire_sent_bytes, sent.wire_received_bytes, 0, 0.0, sent.stalls, False)
    if LINUX:  # the kernel's tcp_info: loopback does not lose segments
        assert sent.stalls is not None and sent.stalls >= 0
        assert a.link_stats()[1] is not None


async def test_waits_go_to_the_peer_that_arrived_late(pair: list[TcpTransport]) -> None:
    a, b = pair
    groups = [Group(a, shared_memory=False), Group(b, shared_memory=False)]
    go = asyncio.Event()

    async def late() -> np.ndarray:
        await go.wait()
        return await groups[1].all_reduce(np.ones(4, np.float32))

    try:
        early = await start_until_blocked(groups[0].all_reduce(np.ones(4, np.float32)))
        assert counters(a).peers[1].collective_waits == 0  # still in the call
        late_task = asyncio.ensure_future(late())
        go.set()
        async with asyncio.timeout(OP):
            results = await asyncio.gather(early, late_task)
    finally:
        for group in groups:
            await group.aclose()
    assert all(np.array_equal(r, np.full(4, 2, np.float32)) for r in results)
    waited = counters(a)
    assert waited.peers[1].collective_waits == 1  # rank 0 ended waiting for rank 1
    assert waited.peers[1].wait_seconds > 0
    assert waited.peers[1].wait_seconds == pytest.approx(a.recorder.wait_ns[1] / 1e9)
    assert waited.collectives == 1 and waited.total.collective_waits == 1
    text = parse_prometheus(format_prometheus(waited))
    assert text[peer_sample("netdist_collective_waits_total", 0, 1)] == 1
    assert text[peer_sample("netdist_wait_seconds_total", 0, 1)] == waited.peers[1].wait_seconds
    assert text[rank_sample("netdist_collectives_total", 0)] == 1


async def test_dumps_tracing_and_in_process_transports(tmp_path: Path) -> None:
    transports = InProcessTransport.create_group(3, timeout=OP)
    try:
        first = counters(transports[0])
        assert (first.flight_dumps, first.tracing, first.collectives) == (0, False, 0)
        assert first.peers == {1: PeerCounters(1), 2: PeerCounters(2)}  # stalls unknown
        recorder = transports[0].recorder
        assert recorder.dump("api", directory=tmp_path) is not None
        recorder.start_trace(tmp_path / "trace")
        now = counters(transports[0])
        assert (now.flight_dumps, now.tracing) == (1, True)
        recorder.stop_trace()
        text = parse_prometheus(format_prometheus(now))
        assert text[rank_sample("netdist_flight_dumps_total", 0)] == 1
        assert text[rank_sample("netdist_tracing", 0)] == 1
        assert text[rank_sample("netdist_world_size", 0)] == 3
        assert not any(name == "netdist_link_stalls_total" for name, _ in text)
    finally:
        for transport in transports:
            await transport.aclose()


def test_counters_of_a_blocking_job() -> None:
    from tests.progress.jobs import jobs_of

    with jobs_of(2) as jobs:
        jobs[0].transport.send(1, np.arange(5, dtype=np.int32), tag=TAG)
        jobs[1].transport.recv(0, tag=TAG)
        sent, got = counters(jobs[0].transport), counters(jobs[1].transport)
    assert (sent.rank, sent.peers[1].sent_bytes, sent.peers[1].sent_messages) == (0, 20, 1)
    assert (got.rank, got.peers[0].received_bytes) == (1, 20)


# -- the text format (pure) --------------------------------------------------------------

def test_prometheus_text_is_exact() -> None:
    snapshot = Counters(
        rank=3, world_size=4, peers={
            0: PeerCounters(0, 100, 2, 50, 1, 180, 90, 7, 1.25, 3, False),
            1: PeerCounters(1, stalls=None, lost=True),
            2: PeerCounters(2, sent_bytes=2**40, wait_seconds=1e-7, stalls=0)},
        collectives=9, flight_dumps=2, tracing=False)
    text = format_prometheus(snapshot)
    assert text.startswith(
        "# HELP netdist_sent_bytes_total Payload bytes of data messages sent to the peer.\n"
        "# TYPE netdist_sent_bytes_total counter\n"
        'netdist_sent_bytes_total{rank="3",peer="0"} 100\n')
    samples = parse_prometheus(text)
    expected_peer = {
        "netdist_sent_bytes_total": (100, 0, 2**40),
        "netdist_sent_messages_total": (2, 0, 0),
        "netdist_received_bytes_total": (50, 0, 0),
        "netdist_received_messages_total": (1, 0, 0),
        "netdist_wire_sent_bytes_total": (180, 0, 0),
        "netdist_wire_received_bytes_total": (90, 0, 0),
        "netdist_collective_waits_total": (7, 0, 0),
        "netdist_wait_seconds_total": (1.25, 0, 1e-7),
        "netdist_link_stalls_total": (3, None, 0),
        "netdist_peer_lost": (0, 1, 0),
    }
    for name, values in expected_peer.items():
        for peer, value in enumerate(values):
            key = peer_sample(name, 3, peer)
            assert samples.get(key) == value, key
    assert samples[rank_sample("netdist_collectives_total", 3)] == 9
    assert samples[rank_sample("netdist_flight_dumps_total", 3)] == 2
    assert samples[rank_sample("netdist_tracing", 3)] == 0
    assert samples[rank_sample("netdist_world_size", 3)] == 4
    assert len(samples) == 10 * 3 - 1 + 4
    assert "1e-07" in text and str(2**40) in text  # exact, not rounded


def test_a_one_rank_job_has_only_rank_metrics() -> None:
    samples = parse_prometheus(format_prometheus(Counters(0, 1, {})))
    assert set(samples) == {rank_sample(name, 0) for name in (
        "netdist_collectives_total", "netdist_flight_dumps_total", "netdist_tracing",
        "netdist_world_size")}


def test_metrics_settings_from_the_environment() -> None:
    assert MetricsSettings.from_env({}) == MetricsSettings(None, "127.0.0.1")
    assert MetricsSettings.from_env({"NETDIST_METRICS_PORT": " 0 "}).port == 0
    custom = MetricsSettings.from_env({"NETDIST_METRICS_PORT": "9400",
                                       "NETDIST_METRICS_HOST": "0.0.0.0"})
    assert custom == MetricsSettings(9400, "0.0.0.0")
    assert (custom.port_for(0), custom.port_for(3), MetricsSettings(0).port_for(3)) == (
        9400, 9403, 0)
    for bad in ("abc", "-1", "65536", "1.5", "inf"):
        with pytest.raises(ConfigError, match="NETDIST_METRICS_PORT"):
            MetricsSettings.from_env({"NETDIST_METRICS_PORT": bad})
    with pytest.raises(ValueError, match="off"):
        MetricsSettings().port_for(0)


# -- the HTTP endpoint -------------------------------------------------------------------

def http_get(url: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one request (any status), bounded."""
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=OP) as answer:
            return answer.status, dict(answer.headers), answer.read()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, dict(error.headers), error.read()


def raw_exchange(address: tuple[str, int], request: bytes) -> bytes:
    """Send ``request`` on a fresh connection and read until the server closes it."""
    with socket.create_connection(address, timeout=OP) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


async def test_metrics_are_served_over_http(pair: list[TcpTransport]) -> None:
    a, _ = pair
    await a.send(1, np.arange(8, dtype=np.float64), tag=TAG, timeout=OP)
    server = await start_metrics_server(a, "127.0.0.1", 0)
    try:
        assert server.address[0] == "127.0.0.1" and server.address[1] > 0
        status, headers, body = await asyncio.to_thread(http_get, server.url)
        assert status == 200
        assert headers["Content-Type"] == CONTENT_TYPE
        assert headers["Connection"] == "close"
        assert int(headers["Content-Length"]) == len(body)
        samples = parse_prometheus(body.decode("utf-8"))
        assert samples[peer_sample("netdist_sent_bytes_total", 0, 1)] == 64
        assert samples[peer_sample("netdist_sent_messages_total", 0, 1)] == 1
        assert body.decode() == format_prometheus(counters(a))  # nothing moved since

        query = await asyncio.to_thread(http_get, server.url + "?x=1")
        assert query[0] == 200
        head = await asyncio.to_thread(http_get, server.url, "HEAD")
        assert head[0] == 200 and head[2] == b"" and int(head[1]["Content-Length"]) > 0
        missing = await asyncio.to_thread(
            http_get, f"http://127.0.0.1:{server.address[1]}/other")
        assert missing[0] == 404
        posted = await asyncio.to_thread(http_get, server.url, "POST")
        assert posted[0] == 405 and posted[1]["Allow"] == "GET, HEAD"
        garbage = await asyncio.to_thread(raw_exchange, server.address, b"HELLO\r\n\r\n")
        assert garbage.startswith(b"HTTP/1.1 400 ")
        huge = b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * (4 * MAX_REQUEST_BYTES)
        refused = await asyncio.to_thread(raw_exchange, server.address, huge)
        assert refused.startswith(b"HTTP/1.1 431 ")
        # one request per connection: a second one on it is never read
        two = b"GET /metrics HTTP/1.1\r\n\r\nGET /other HTTP/1.1\r\n\r\n"
        answer = await asyncio.to_thread(raw_exchange, server.address, two)
        assert answer.count(b"HTTP/1.1 ") == 1 and answer.startswith(b"HTTP/1.1 200 ")
        assert server.requests == 8
    finally:
        await server.aclose()
    with pytest.raises(OSError):
        await asyncio.to_thread(socket.create_connection, server.address, 2.0)
    await server.aclose()  # idempotent


async def test_a_silent_client_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_server, "READ_SECONDS", 0.2)
    transport = InProcessTransport.create_group(1, timeout=OP)[0]
    server = await start_metrics_server(transport)
    try:
        def silent() -> bytes:
            with socket.create_connection(server.address, timeout=OP) as sock:
                return sock.recv(65536)  # sends nothing: the server answers, then closes

        answer = await asyncio.to_thread(silent)
        assert answer.startswith(b"HTTP/1.1 408 ")

        # a client that connects and sends half a request is cut off the same way
        def half() -> bytes:
            with socket.create_connection(server.address, timeout=OP) as sock:
                sock.sendall(b"GET /metr")
                return sock.recv(65536)

        assert (await asyncio.to_thread(half)).startswith(b"HTTP/1.1 408 ")
    finally:
        await server.aclose()
        await transport.aclose()


async def test_closing_drops_open_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    transport = InProcessTransport.create_group(1, timeout=OP)[0]
    server = await start_metrics_server(transport)
    reader, writer = await asyncio.open_connection(*server.address)
    try:
        writer.write(b"GET /metr")  # half a request: the server is waiting for the rest
        await writer.drain()
        async with asyncio.timeout(OP):
            while not server._clients:
                await asyncio.sleep(0.01)
            await server.aclose()
            try:  # closed, no answer (reset when the half request was still unread)
                assert await reader.read() == b""
            except ConnectionResetError:
                pass
    finally:
        writer.close()
        await transport.aclose()


async def test_started_from_the_environment(pair: list[TcpTransport],
                                            caplog: pytest.LogCaptureFixture) -> None:
    a, b = pair
    assert await start_metrics_from_env(a, {}) is None
    with pytest.raises(ConfigError, match="NETDIST_METRICS_PORT='x'"):
        await start_metrics_from_env(a, {"NETDIST_METRICS_PORT": "x"})
    caplog.set_level(logging.INFO, logger="netdist.trace")
    server = await start_metrics_from_env(a, {"NETDIST_METRICS_PORT": "0"})
    assert isinstance(server, MetricsServer)
    try:
        assert f"rank 0 serves metrics at {server.url}" in caplog.text
        assert server.address[0] == "127.0.0.1"
        # a base port: rank 1 is the second rank of this host, so it takes base + 1;
        # that port is taken here, which costs the metrics, not the rank
        base = server.address[1] - 1
        taken = await start_metrics_from_env(b, {"NETDIST_METRICS_PORT": str(base)})
        assert taken is None
        assert f"rank 1 could not serve metrics on 127.0.0.1:{base + 1}" in caplog.text
    finally:
        await server.aclose()


async def test_many_clients_at_once_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_server, "MAX_CLIENTS", 2)
    transport = InProcessTransport.create_group(1, timeout=OP)[0]
    server = await start_metrics_server(transport)
    held: list[Any] = []
    try:
        for _ in range(2):  # two clients hold both slots with half a request
            reader, writer = await asyncio.open_connection(*server.address)
            writer.write(b"GET /")
            held.append((reader, writer))
        async with asyncio.timeout(OP):
            while len(server._clients) < 2:
                await asyncio.sleep(0.01)
            reader, writer = await asyncio.open_connection(*server.address)
            held.append((reader, writer))
            writer.write(b"GET /metrics HTTP/1.1\r\n\r\n")
            try:  # a third is closed unanswered (reset if its request was unread)
                assert await reader.read() == b""
            except ConnectionResetError:
                pass
            for reader, writer in held[:2]:
                writer.write(b"metrics HTTP/1.1\r\n\r\n")
                assert (await reader.read()).startswith(b"HTTP/1.1 200 ")
    finally:
        for _, writer in held:
            writer.close()
        await server.aclose()
        await transport.aclose()
