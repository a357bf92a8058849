"""What a stranger learns from a real rank or coordinator port: nothing to guess against.

A stranger without the token connects over loopback to a live ``TcpTransport`` and to a
rendezvous ``Coordinator``, speaks the handshake byte by byte and records everything the
port sends. It must get a CHALLENGE made of public values and a fresh nonce, then one
fixed refusal: the same bytes for every wrong guess, every job id and every world size,
with no MAC and no job id in them (docs/PROTOCOL.md section 6). The job itself is not
disturbed and the legitimate side logs a clear reason.
"""

from __future__ import annotations

import asyncio
import logging
import struct

import numpy as np
import pytest

from netdist.config import DistributedConfig
from netdist.transport.rendezvous import Coordinator, RendezvousClient
from netdist.wire import NEED_DATA, ControlFrame, FrameDecoder, FrameKind, encode_control
from netdist.wire import handshake as handshake_module
from netdist.wire.handshake import PROOF_BY_ACCEPTOR, PROOF_BY_CONNECTOR, compute_proof, mac_input

IO_TIMEOUT = 5.0
CLIENT_NONCE = bytes(range(32))
PINNED_NONCE = bytes(range(100, 132))

REFUSAL = (b"ND\x01\x05" + (58).to_bytes(4, "little") + bytes(8)
           + b"\x82" + b"\xa6reason" + b"\xd9\x25authentication failed: token mismatch"
           + b"\xa4code" + b"\xa5token")
"""ERROR {"reason": "authentication failed: token mismatch", "code": "token"}, by hand."""


def decode(data: bytes) -> ControlFrame:
    decoder = FrameDecoder()
    decoder.feed(data)
    frame = decoder.next_frame()
    assert isinstance(frame, ControlFrame) and decoder.next_frame() is NEED_DATA
    return frame


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    prefix = await asyncio.wait_for(reader.readexactly(16), IO_TIMEOUT)
    header_len = struct.unpack_from("<I", prefix, 4)[0]
    return prefix + await asyncio.wait_for(reader.readexactly(header_len), IO_TIMEOUT)


async def probe(port: int, guess: str, *, job: str, world: int = 2,
                rank: int = 1) -> tuple[bytes, bytes]:
    """Be a stranger holding ``guess``: HELLO, read the CHALLENGE, answer with an AUTH
    proven with ``guess`` for ``job``/``world``/``rank``; return the CHALLENGE's bytes and
    every byte the port sends after our AUTH, up to its close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(encode_control(FrameKind.HELLO, {"version": 2, "nonce": CLIENT_NONCE}))
        challenge = await read_frame(reader)
        fields = decode(challenge).fields
        proof = compute_proof(guess.encode(), mac_input(
            PROOF_BY_CONNECTOR, version=2, job_id=job, world_size=world, client_rank=rank,
            client_role="rank", server_rank=fields["rank"], server_role=fields["role"],
            client_nonce=CLIENT_NONCE, server_nonce=fields["nonce"]))
        writer.write(encode_control(FrameKind.AUTH, {
            "job_id": job, "rank": rank, "world_size": world, "role": "rank",
            "proof": proof}))
        rest = await asyncio.wait_for(reader.read(), IO_TIMEOUT)  # the port closes
        return challenge, rest
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except ConnectionError:
            pass


def assert_public_challenge(challenge: bytes, rank: int, role: str) -> bytes:
    """CHALLENGE is exactly {version, rank, role, nonce} (nothing else hidden in it);
    return its nonce."""
    fields = decode(challenge).fields
    assert set(fields) == {"version", "rank", "role", "nonce"}
    assert (fields["version"], fields["rank"], fields["role"]) == (2, rank, role)
    assert challenge == encode_control(FrameKind.CHALLENGE, {
        "version": 2, "rank": rank, "role": role, "nonce": fields["nonce"]})
    assert len(fields["nonce"]) == 32
    return fields["nonce"]


def assert_no_secret(sent: bytes, *, token: str, job: str, world: int, server_rank: int,
                     server_role: str, server_nonce: bytes) -> None:
    """Neither the job id nor any MAC under the real token (either direction, either
    nonce order, the stranger's or the real identity) appears in ``sent``."""
    assert job.encode() not in sent and token.encode() not in sent
    for direction in (PROOF_BY_ACCEPTOR, PROOF_BY_CONNECTOR):
        for nonces in ((CLIENT_NONCE, server_nonce), (server_nonce, CLIENT_NONCE)):
            mac = compute_proof(token.encode(), mac_input(
                direction, version=2, job_id=job, world_size=world, client_rank=1,
                client_role="rank", server_rank=server_rank, server_role=server_role,
                client_nonce=nonces[0], server_nonce=nonces[1]))
            assert mac not in sent


async def assert_group_works(group) -> None:
    for src in range(len(group)):
        dst = (src + 1) % len(group)
        await group[src].send(dst, np.array([src, dst]), tag=91)
        assert (await group[dst].recv(src, tag=91, timeout=IO_TIMEOUT)).tolist() == [src, dst]


def pin_nonces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Until ``monkeypatch.undo()``, every acceptor nonce is PINNED_NONCE (so two ports'
    CHALLENGEs can be compared byte for byte)."""
    monkeypatch.setattr(handshake_module, "_fresh_nonce", lambda: PINNED_NONCE)


async def test_a_stranger_at_a_rank_port_learns_nothing_to_guess_against(
        tcp_group, monkeypatch, caplog):
    """Two live jobs (different job ids, tokens, world sizes); strangers with different
    wrong guesses, claiming each job's real id and size. Every port sends the same public
    CHALLENGE and the same fixed refusal."""
    first, second = await tcp_group(2), await tcp_group(3)
    jobs = [(group[0], group[0].config) for group in (first, second)]
    assert jobs[0][1].job_id != jobs[1][1].job_id and jobs[0][1].token != jobs[1][1].token

    # unpinned: each connection gets its own fresh nonce
    port = first[0].listen_address[1]
    nonces = {assert_public_challenge((await probe(port, "guess", job="x"))[0], 0, "rank")
              for _ in range(2)}
    assert len(nonces) == 2

    pin_nonces(monkeypatch)
    seen: set[tuple[bytes, bytes]] = set()
    with caplog.at_level(logging.WARNING, logger="netdist.transport"):
        for transport, config in jobs:
            port = transport.listen_address[1]
            for guess in ("wrong-guess-one", "wrong-guess-two"):
                for job, world in ((config.job_id, config.world_size), ("other-job", 5)):
                    challenge, rest = await probe(port, guess, job=job, world=world)
                    seen.add((challenge, rest))
                    assert_no_secret(challenge + rest, token=config.token, job=config.job_id,
                                     world=config.world_size, server_rank=0,
                                     server_role="rank", server_nonce=PINNED_NONCE)
    challenge, rest = seen.pop()
    assert not seen  # byte-identical across jobs, tokens, guesses and claimed identities
    assert_public_challenge(challenge, 0, "rank")
    assert rest == REFUSAL
    assert "rank 0 rejected connection from 127.0.0.1:" in caplog.text
    assert "authentication failed: token mismatch" in caplog.text
    monkeypatch.undo()
    await assert_group_works(first)
    await assert_group_works(second)


def _config(rank: int, world: int, port: int, *, job: str, token: str) -> DistributedConfig:
    return DistributedConfig(rank=rank, world_size=world, coordinator=("127.0.0.1", port),
                             job_id=job, token=token, connect_timeout=IO_TIMEOUT)


async def test_a_stranger_at_the_coordinator_learns_nothing_to_guess_against(monkeypatch):
    """The same at two rendezvous coordinators of different jobs; a rank holding the
    token then still gets through."""
    jobs = [("job-one", "token-of-job-one-0123456789", 2),
            ("job-two", "token-of-job-two-9876543210", 4)]
    coordinators = [await Coordinator.start(_config(0, world, 0, job=job, token=token))
                    for job, token, world in jobs]
    try:
        pin_nonces(monkeypatch)
        seen: set[tuple[bytes, bytes]] = set()
        for coordinator, (job, token, world) in zip(coordinators, jobs):
            for guess in ("wrong-guess-one", "wrong-guess-two"):
                challenge, rest = await probe(coordinator.address[1], guess, job=job,
                                              world=world)
                seen.add((challenge, rest))
                assert_no_secret(challenge + rest, token=token, job=job, world=world,
                                 server_rank=0, server_role="coordinator",
                                 server_nonce=PINNED_NONCE)
        challenge, rest = seen.pop()
        assert not seen
        assert_public_challenge(challenge, 0, "coordinator")
        assert rest == REFUSAL
        monkeypatch.undo()
        loop = asyncio.get_running_loop()
        job, token, world = jobs[0]
        client = await RendezvousClient.connect(
            _config(1, world, coordinators[0].address[1], job=job, token=token),
            deadline=loop.time() + IO_TIMEOUT)
        await client.aclose()
    finally:
        for coordinator in coordinators:
            await coordinator.aclose()


async def test_an_old_version_client_is_told_the_version(tcp_group):
    """A handshake-version-1 HELLO (which carried the job id) gets a clear version refusal
    that names no job."""
    group = await tcp_group(2)
    reader, writer = await asyncio.open_connection("127.0.0.1", group[0].listen_address[1])
    try:
        writer.write(encode_control(FrameKind.HELLO, {
            "version": 1, "job_id": group[0].config.job_id, "rank": 1, "world_size": 2,
            "role": "rank", "nonce": CLIENT_NONCE}))
        error = decode(await read_frame(reader))
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except ConnectionError:
            pass
    assert error.kind is FrameKind.ERROR
    assert error.fields == {"reason": "handshake version 1 != 2", "code": "version"}
    await assert_group_works(group)
