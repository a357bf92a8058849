"""Authentication and hostile input: strangers, garbage, wrong tokens and job ids."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

from netdist.config import DistributedConfig, WireLimits
from netdist.errors import (
    AuthenticationError,
    ConfigError,
    RendezvousTimeoutError,
)
from netdist.transport import TcpTransport
from netdist.transport.connection import (
    FrameConnection,
    check_listen_security,
    open_connection,
    run_handshake,
)
from netdist.wire import ClientHandshake, HandshakeIdentity


async def dial(port: int, identity: HandshakeIdentity, expect_rank: int) -> None:
    """Connect to a rank's listener and run the client handshake as ``identity``."""
    loop = asyncio.get_running_loop()
    conn = await open_connection(
        "127.0.0.1", port, lambda: FrameConnection(WireLimits(), label="test peer"),
        deadline=loop.time() + 5.0, what="test dial", retry=False)
    handshake = ClientHandshake(identity, expect_role="rank", expect_rank=expect_rank,
                                peer_label=f"127.0.0.1:{port}")
    try:
        await run_handshake(conn, handshake, deadline=loop.time() + 5.0,
                            what="test handshake", first=handshake.initiate())
    finally:
        conn.close(send_bye=False)
        await conn.wait_closed(1.0)


async def assert_group_works(group) -> None:
    for src in range(len(group)):
        dst = (src + 1) % len(group)
        await group[src].send(dst, np.array([src, dst]), tag=77)
        assert (await group[dst].recv(src, tag=77, timeout=5.0)).tolist() == [src, dst]


async def test_wrong_token_is_refused_on_both_sides(tcp_group, caplog):
    group = await tcp_group(3)
    rank0 = group[0]
    stranger = HandshakeIdentity(rank0.config.job_id, 2, 3, "not-the-token")
    with caplog.at_level(logging.WARNING, logger="netdist.transport"):
        with pytest.raises(AuthenticationError, match="token mismatch"):
            await dial(rank0.listen_address[1], stranger, expect_rank=0)
        await assert_group_works(group)
    assert "rank 0 dropped connection from 127.0.0.1" in caplog.text
    assert "token mismatch" in caplog.text


async def test_wrong_job_id_is_refused_on_both_sides(tcp_group, caplog):
    group = await tcp_group(2)
    rank0 = group[0]
    stranger = HandshakeIdentity("some-other-job", 1, 2, rank0.config.token)
    with caplog.at_level(logging.WARNING, logger="netdist.transport"):
        with pytest.raises(AuthenticationError,
                           match=r"refused rank 1: job id 'some-other-job' != 'local-"):
            await dial(rank0.listen_address[1], stranger, expect_rank=0)
        await assert_group_works(group)
    assert "rank 0 rejected connection from 127.0.0.1" in caplog.text
    assert "job id 'some-other-job'" in caplog.text


async def test_duplicate_rank_connection_is_refused(tcp_group, caplog):
    group = await tcp_group(2)
    rank0 = group[0]
    impostor = HandshakeIdentity(rank0.config.job_id, 1, 2, rank0.config.token)
    with caplog.at_level(logging.WARNING, logger="netdist.transport"):
        with pytest.raises(AuthenticationError, match="duplicate connection from rank 1"):
            await dial(rank0.listen_address[1], impostor, expect_rank=0)
    await assert_group_works(group)


async def test_lower_rank_may_not_connect_upwards(tcp_group):
    group = await tcp_group(3)
    rank1 = group[1]
    lower = HandshakeIdentity(rank1.config.job_id, 0, 3, rank1.config.token)
    with pytest.raises(AuthenticationError, match="must accept a connection from rank 1"):
        await dial(rank1.listen_address[1], lower, expect_rank=1)
    await assert_group_works(group)


async def raw_exchange(port: int, payload: bytes) -> bytes:
    """Send raw bytes to ``port``; return whatever comes back before the server hangs up."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(payload)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 5.0)
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except ConnectionError:
            pass


async def test_garbage_on_a_rank_port_is_dropped_without_disturbing_the_job(tcp_group, caplog):
    group = await tcp_group(3)
    with caplog.at_level(logging.WARNING, logger="netdist.transport"):
        for target in group:
            reply = await raw_exchange(target.listen_address[1],
                                       b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert reply == b""  # no frame is ever sent to a stranger who fails the magic
        await assert_group_works(group)
    assert "bad magic" in caplog.text


async def test_random_bytes_with_valid_magic_are_dropped(tcp_group):
    group = await tcp_group(2)
    frame = b"ND\x01\x01" + (2**31).to_bytes(4, "little") + bytes(8)  # HELLO, huge header
    assert await raw_exchange(group[0].listen_address[1], frame) == b""
    await assert_group_works(group)


async def test_a_silent_stranger_is_dropped_after_the_connect_timeout(tcp_group):
    group = await tcp_group(2, connect_timeout=1.0)
    reader, writer = await asyncio.open_connection("127.0.0.1", group[0].listen_address[1])
    try:
        assert await asyncio.wait_for(reader.read(), 5.0) == b""
    finally:
        writer.close()
        await writer.wait_closed()
    await assert_group_works(group)


async def test_wrong_token_in_a_whole_job(caplog):
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[tuple[str, int]] = loop.create_future()
    base = dict(world_size=2, job_id="tokens", connect_timeout=1.5, timeout=5.0)
    rank0 = asyncio.create_task(TcpTransport.connect(
        DistributedConfig(rank=0, coordinator=("127.0.0.1", 0), token="right-token-0123", **base),
        on_coordinator_ready=ready.set_result))
    address = await asyncio.wait_for(ready, 5.0)
    with caplog.at_level(logging.WARNING, logger="netdist.transport"):
        with pytest.raises(AuthenticationError, match="token mismatch"):
            await TcpTransport.connect(
                DistributedConfig(rank=1, coordinator=address, token="a-wrong-token-0123", **base))
        with pytest.raises(RendezvousTimeoutError, match="rank 1 never arrived") as info:
            await asyncio.wait_for(rank0, 10.0)
    assert info.value.missing == (1,)


async def test_no_token_on_loopback_is_allowed(tcp_group):
    group = await tcp_group(2, token=None)
    await assert_group_works(group)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.5"])
async def test_loopback_listening_needs_no_token(host):
    await check_listen_security(host, None, False, "test")


@pytest.mark.parametrize("host", ["0.0.0.0", "", "::", "10.1.2.3"])
async def test_non_loopback_listening_needs_a_token_or_insecure(host):
    with pytest.raises(ConfigError, match="no token is set"):
        await check_listen_security(host, None, False, "rank 3's peer listener")
    await check_listen_security(host, "secret", False, "test")
    await check_listen_security(host, None, True, "test")


async def test_coordinator_refuses_to_listen_openly_without_a_token():
    config = DistributedConfig(rank=0, world_size=2, coordinator=("0.0.0.0", 0),
                               connect_timeout=1.0)
    with pytest.raises(ConfigError, match="coordinator .* not a loopback address"):
        await TcpTransport.connect(config)


async def test_a_non_local_advertise_address_falls_back_to_all_interfaces(monkeypatch):
    import errno

    from netdist.errors import ConnectError
    from netdist.transport import connection

    calls: list[str] = []

    async def fake_start_listener(host, port, factory, *, what):
        calls.append(host)
        if host == "192.0.2.10":  # TEST-NET address: not an interface of this machine
            raise ConnectError("cannot listen") from OSError(errno.EADDRNOTAVAIL, "nope")
        return "server", ("0.0.0.0", 1234)

    monkeypatch.setattr(connection, "start_listener", fake_start_listener)
    with pytest.raises(ConfigError, match="no token is set"):
        await connection.listen("192.0.2.10", 0, lambda: None, token=None, insecure=False,
                                what="x", fallback_to_all=True)
    assert calls == []
    result = await connection.listen("192.0.2.10", 0, lambda: None, token="t",
                                     insecure=False, what="x", fallback_to_all=True)
    assert result == ("server", ("0.0.0.0", 1234)) and calls == ["192.0.2.10", ""]
    with pytest.raises(ConnectError):
        await connection.listen("192.0.2.10", 0, lambda: None, token="t", insecure=False,
                                what="x", fallback_to_all=False)
