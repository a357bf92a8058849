"""Handshake state machines: success, every refusal on both sides, attacks."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from typing import Any

import pytest

from netdist.errors import AuthenticationError, LocalProtocolError
from netdist.wire import (
    NEED_DATA,
    ClientHandshake,
    ControlFrame,
    FrameDecoder,
    FrameKind,
    HandshakeIdentity,
    HandshakeStep,
    ServerHandshake,
    encode_control,
)
from netdist.wire.handshake import (
    MAC_LABEL,
    PROOF_BY_ACCEPTOR,
    PROOF_BY_CONNECTOR,
    compute_proof,
    mac_input,
)

CLIENT_ADDR = "127.0.0.1:51234"  # the server's view of the connecting side
SERVER_ADDR = "127.0.0.1:40000"  # the client's view of the accepting side
TOKEN = "s3cret-t0ken"


def decode(data: bytes) -> ControlFrame:
    dec = FrameDecoder()
    dec.feed(data)
    frame = dec.next_frame()
    assert isinstance(frame, ControlFrame)
    assert dec.next_frame() is NEED_DATA
    return frame


def ident(rank: int, *, job: str = "a", world: int = 4, token: str | None = TOKEN,
          role: str = "rank") -> HandshakeIdentity:
    return HandshakeIdentity(job, rank, world, token, role)


def drive(client: ClientHandshake, server: ServerHandshake
          ) -> tuple[HandshakeStep, HandshakeStep, list[FrameKind]]:
    """Run both sides to completion through real frame bytes; return final steps + log."""
    to_server = [client.initiate()]
    to_client: list[bytes] = []
    c_final: HandshakeStep | None = None
    s_final: HandshakeStep | None = None
    log: list[FrameKind] = []
    for _ in range(10):
        while to_server and s_final is None:
            frame = decode(to_server.pop(0))
            log.append(frame.kind)
            step = server.receive(frame)
            if step.send is not None:
                to_client.append(step.send)
            if step.done:
                s_final = step
        while to_client and c_final is None:
            frame = decode(to_client.pop(0))
            log.append(frame.kind)
            step = client.receive(frame)
            if step.send is not None:
                to_server.append(step.send)
            if step.done:
                c_final = step
        if c_final is not None and s_final is not None:
            break
    assert c_final is not None and s_final is not None, log
    return c_final, s_final, log


def pair(c: HandshakeIdentity, s: HandshakeIdentity, *,
         expect_role: str = "rank", expect_rank: int | None = None,
         accept_rank: Callable[[int], str | None] | None = None
         ) -> tuple[HandshakeStep, HandshakeStep, list[FrameKind]]:
    return drive(ClientHandshake(c, expect_role=expect_role, expect_rank=expect_rank,
                                 peer_label=SERVER_ADDR),
                 ServerHandshake(s, peer_label=CLIENT_ADDR, accept_rank=accept_rank))


# ---------------------------------------------------------------------------------------
# success


@pytest.mark.parametrize("c_token, s_token", [(TOKEN, TOKEN), (None, None), ("", None),
                                              (None, "")])
def test_success(c_token: str | None, s_token: str | None) -> None:
    seen: list[int] = []

    def accept(rank: int) -> str | None:
        seen.append(rank)
        return None

    c, s, log = pair(ident(3, token=c_token), ident(2, token=s_token), expect_rank=2,
                     accept_rank=accept)
    assert log == [FrameKind.HELLO, FrameKind.CHALLENGE, FrameKind.AUTH, FrameKind.OK]
    assert c == HandshakeStep(None, True, None, 2)
    assert s.done and s.error is None and s.peer_rank == 3
    assert decode(s.send) == ControlFrame(FrameKind.OK, {})  # type: ignore[arg-type]
    assert seen == [3]


def test_success_with_coordinator() -> None:
    c, s, _ = pair(ident(0), ident(0, role="coordinator"), expect_role="coordinator")
    assert c.error is None and s.error is None and c.peer_rank == 0 and s.peer_rank == 0


def test_hello_fields() -> None:
    client = ClientHandshake(ident(1, job="job-7", world=8))
    hello = decode(client.initiate())
    assert hello.kind is FrameKind.HELLO
    assert set(hello.fields) == {"version", "job_id", "rank", "world_size", "role", "nonce"}
    assert hello.fields["version"] == 1 and hello.fields["job_id"] == "job-7"
    assert hello.fields["rank"] == 1 and hello.fields["world_size"] == 8
    assert hello.fields["role"] == "rank" and len(hello.fields["nonce"]) == 32
    other = decode(ClientHandshake(ident(1)).initiate())
    assert other.fields["nonce"] != hello.fields["nonce"]
    with pytest.raises(LocalProtocolError, match="twice"):
        client.initiate()


# ---------------------------------------------------------------------------------------
# refusals: both sides get a clear AuthenticationError


def both_errors(c: HandshakeStep, s: HandshakeStep) -> tuple[str, str]:
    assert isinstance(c.error, AuthenticationError) and isinstance(s.error, AuthenticationError)
    assert c.done and s.done
    return str(c.error), str(s.error)


def both_codes(c: HandshakeStep, s: HandshakeStep) -> tuple[str | None, str | None]:
    assert isinstance(c.error, AuthenticationError) and isinstance(s.error, AuthenticationError)
    return c.error.code, s.error.code


def test_job_id_mismatch() -> None:
    c, s, log = pair(ident(3, job="b"), ident(2, job="a"))
    client_msg, server_msg = both_errors(c, s)
    assert server_msg == f"rank 2 rejected connection from {CLIENT_ADDR}: job id 'b' != 'a'"
    assert client_msg == f"rank 2 at {SERVER_ADDR} refused rank 3: job id 'b' != 'a'"
    assert log == [FrameKind.HELLO, FrameKind.ERROR]
    assert decode(s.send).fields == {  # type: ignore[arg-type]
        "reason": "job id 'b' != 'a'", "rank": 2, "role": "rank", "code": "job_id"}
    assert both_codes(c, s) == ("job_id", "job_id")


def test_token_mismatch() -> None:
    c, s, log = pair(ident(3, token="wrong-token"), ident(2, token=TOKEN))
    client_msg, server_msg = both_errors(c, s)
    # the connecting side checks the acceptor's proof first and refuses it
    assert client_msg == (f"rank 3 rejected rank 2 at {SERVER_ADDR}: "
                          "authentication failed: token mismatch")
    assert server_msg == (f"rank 3 at {CLIENT_ADDR} refused rank 2: "
                          "authentication failed: token mismatch")
    assert log == [FrameKind.HELLO, FrameKind.CHALLENGE, FrameKind.ERROR]
    for text in (client_msg, server_msg, repr(c), repr(s), repr(ident(1))):
        assert TOKEN not in text and "wrong-token" not in text


@pytest.mark.parametrize("c_token, s_token", [(None, TOKEN), (TOKEN, None), ("", "x")])
def test_token_versus_no_token(c_token: str | None, s_token: str | None) -> None:
    c, s, _ = pair(ident(1, token=c_token), ident(0, token=s_token))
    client_msg, server_msg = both_errors(c, s)
    assert client_msg.endswith("authentication failed: token mismatch")
    assert server_msg.endswith("authentication failed: token mismatch")
    assert both_codes(c, s) == ("token", "token")


def test_world_size_mismatch() -> None:
    c, s, _ = pair(ident(3, world=8), ident(2, world=4))
    client_msg, server_msg = both_errors(c, s)
    assert server_msg == f"rank 2 rejected connection from {CLIENT_ADDR}: world size 8 != 4"
    assert client_msg == f"rank 2 at {SERVER_ADDR} refused rank 3: world size 8 != 4"
    assert both_codes(c, s) == ("world_size", "world_size")


def test_connecting_to_itself_is_refused() -> None:
    c, s, _ = pair(ident(2), ident(2))
    client_msg, server_msg = both_errors(c, s)
    assert server_msg.endswith(": rank 2 is this rank")
    assert client_msg == f"rank 2 at {SERVER_ADDR} refused rank 2: rank 2 is this rank"
    assert both_codes(c, s) == (None, None)


def test_accept_rank_veto() -> None:
    c, s, log = pair(ident(3), ident(2),
                     accept_rank=lambda rank: f"duplicate connection from rank {rank}")
    client_msg, server_msg = both_errors(c, s)
    assert server_msg == (f"rank 2 rejected connection from {CLIENT_ADDR}: "
                          "duplicate connection from rank 3")
    assert client_msg == f"rank 2 at {SERVER_ADDR} refused rank 3: duplicate connection from rank 3"
    # the veto is asked only after the peer proved the token
    assert log == [FrameKind.HELLO, FrameKind.CHALLENGE, FrameKind.AUTH, FrameKind.ERROR]


def test_veto_not_asked_for_unauthenticated_peer() -> None:
    asked: list[int] = []
    pair(ident(3, token="bad"), ident(2), accept_rank=lambda r: asked.append(r) or None)
    assert asked == []


def test_expected_rank_mismatch_on_client() -> None:
    c, s, _ = pair(ident(3), ident(1), expect_rank=2)
    client_msg, server_msg = both_errors(c, s)
    assert client_msg == f"rank 3 rejected rank 1 at {SERVER_ADDR}: rank 1 != expected 2"
    assert server_msg == f"rank 3 at {CLIENT_ADDR} refused rank 1: rank 1 != expected 2"


def test_wrong_role_client_expected_coordinator() -> None:
    c, s, _ = pair(ident(3), ident(0), expect_role="coordinator")
    client_msg, server_msg = both_errors(c, s)
    assert client_msg == (f"rank 3 rejected rank 0 at {SERVER_ADDR}: "
                          "role 'rank' != expected 'coordinator'")
    assert server_msg.startswith(f"rank 3 at {CLIENT_ADDR} refused rank 0: role 'rank'")


def test_wrong_role_server_refuses_coordinator_client() -> None:
    c, s, _ = pair(ident(1, role="coordinator"), ident(2))
    client_msg, server_msg = both_errors(c, s)
    assert server_msg == (f"rank 2 rejected connection from {CLIENT_ADDR}: "
                          "role 'coordinator' != expected 'rank'")
    assert client_msg.startswith(f"rank 2 at {SERVER_ADDR} refused coordinator: role")


def _hello(**overrides: Any) -> ControlFrame:
    fields: dict[str, Any] = {"version": 1, "job_id": "a", "rank": 3, "world_size": 4,
                              "role": "rank", "nonce": bytes(32)}
    fields.update(overrides)
    for key in [k for k, v in fields.items() if v is _DROP]:
        del fields[key]
    return decode(encode_control(FrameKind.HELLO, fields))


_DROP = object()


@pytest.mark.parametrize("overrides, reason, code", [
    ({"version": 2}, "protocol version 2 != 1", "version"),
    ({"rank": 4}, "rank 4 is outside 0..3", "rank_range"),
    ({"rank": -1}, "rank -1 is outside 0..3", "rank_range"),
    ({"nonce": b"short"}, "malformed HELLO: nonce must be 32 bytes", None),
    ({"nonce": _DROP}, "malformed HELLO: missing 'nonce'", None),
    ({"rank": "3"}, "malformed HELLO: 'rank' must be int, got str", None),
    ({"rank": True}, "malformed HELLO: 'rank' must be int, got bool", None),
    ({"role": "admin"}, "unknown role 'admin'", None),
    ({"job_id": "x" * 2000}, "malformed HELLO: job id longer than 1024 bytes", None),
])
def test_server_refuses_bad_hello(overrides: dict[str, Any], reason: str,
                                  code: str | None) -> None:
    server = ServerHandshake(ident(2), peer_label=CLIENT_ADDR)
    step = server.receive(_hello(**overrides))
    assert step.done and isinstance(step.error, AuthenticationError)
    assert str(step.error) == f"rank 2 rejected connection from {CLIENT_ADDR}: {reason}"
    error = decode(step.send)  # type: ignore[arg-type]
    assert error.kind is FrameKind.ERROR and error.fields["reason"] == reason
    # and a client receiving that ERROR reports it
    client = ClientHandshake(ident(3), peer_label=SERVER_ADDR)
    client.initiate()
    refused = client.receive(error)
    assert str(refused.error) == f"rank 2 at {SERVER_ADDR} refused rank 3: {reason}"
    assert error.fields.get("code") == code
    assert isinstance(refused.error, AuthenticationError) and refused.error.code == code
    assert step.error.code == code
    assert refused.send is None and refused.done


def test_protocol_version_mismatch_reported_by_old_server_to_new_client() -> None:
    step = ServerHandshake(ident(0, role="coordinator")).receive(_hello(version=2))
    assert str(step.error) == "coordinator rejected connection: protocol version 2 != 1"


# ---------------------------------------------------------------------------------------
# order and kind of frames


def test_server_unexpected_first_frame() -> None:
    for kind in (FrameKind.AUTH, FrameKind.OK, FrameKind.CHALLENGE, FrameKind.BYE):
        step = ServerHandshake(ident(2), peer_label=CLIENT_ADDR).receive(
            decode(encode_control(kind, {"proof": bytes(32)})))
        assert str(step.error) == (f"rank 2 rejected connection from {CLIENT_ADDR}: "
                                   f"unexpected {kind.name} frame while waiting for HELLO")
        assert decode(step.send).kind is FrameKind.ERROR  # type: ignore[arg-type]


def test_server_hello_twice() -> None:
    server = ServerHandshake(ident(2))
    hello = decode(ClientHandshake(ident(3)).initiate())
    assert server.receive(hello).error is None
    step = server.receive(hello)
    assert str(step.error) == ("rank 2 rejected connection: unexpected HELLO frame while "
                               "waiting for AUTH")


def test_client_unexpected_frames() -> None:
    client = ClientHandshake(ident(3), peer_label=SERVER_ADDR, expect_rank=2)
    client.initiate()
    step = client.receive(decode(encode_control(FrameKind.OK)))
    assert str(step.error) == (f"rank 3 rejected rank 2 at {SERVER_ADDR}: "
                               "unexpected OK frame while waiting for CHALLENGE")
    assert decode(step.send).kind is FrameKind.ERROR  # type: ignore[arg-type]
    client = ClientHandshake(ident(3))
    with pytest.raises(LocalProtocolError, match="before initiate"):
        client.receive(decode(encode_control(FrameKind.OK)))


def test_data_frame_during_handshake() -> None:
    step = ServerHandshake(ident(2)).receive(("header", "payload"))
    assert str(step.error) == ("rank 2 rejected connection: unexpected data frame "
                               "during the handshake")


def test_heartbeat_during_handshake_is_ignored() -> None:
    server = ServerHandshake(ident(2))
    step = server.receive(decode(encode_control(FrameKind.HEARTBEAT)))
    assert step == HandshakeStep(None, False, None, None)
    assert server.receive(decode(ClientHandshake(ident(3)).initiate())).error is None


def test_frames_after_completion_are_errors() -> None:
    client = ClientHandshake(ident(3), peer_label=SERVER_ADDR)
    server = ServerHandshake(ident(2), peer_label=CLIENT_ADDR)
    c, s, _ = drive(client, server)
    assert c.error is None and s.error is None and client.done and server.done
    late = decode(encode_control(FrameKind.OK))
    assert "after the handshake ended" in str(client.receive(late).error)
    assert "after the handshake ended" in str(server.receive(late).error)


def test_malformed_challenge() -> None:
    client = ClientHandshake(ident(3), peer_label=SERVER_ADDR)
    client.initiate()
    step = client.receive(decode(encode_control(FrameKind.CHALLENGE, {
        "version": 1, "job_id": "a", "rank": 2, "world_size": 4, "role": "rank",
        "nonce": bytes(32)})))
    assert str(step.error) == (f"rank 3 rejected rank 2 at {SERVER_ADDR}: "
                               "malformed CHALLENGE: 'proof' must be bytes")


# ---------------------------------------------------------------------------------------
# attacks


def test_reflected_proof_fails() -> None:
    """An attacker without the token echoes the acceptor's own proof back as AUTH."""
    server = ServerHandshake(ident(2), peer_label=CLIENT_ADDR)
    attacker_hello = _hello()
    challenge = decode(server.receive(attacker_hello).send)  # type: ignore[arg-type]
    step = server.receive(decode(encode_control(
        FrameKind.AUTH, {"proof": challenge.fields["proof"]})))
    assert str(step.error) == (f"rank 2 rejected connection from {CLIENT_ADDR}: "
                               "authentication failed: token mismatch")


def test_reflection_via_second_connection_fails() -> None:
    """Use a second connection to make the acceptor compute a proof for the first one."""
    victim = ServerHandshake(ident(2))
    challenge = decode(victim.receive(_hello()).send)  # type: ignore[arg-type]
    # second connection: send the victim's nonce as our nonce, hoping for a usable proof
    oracle = ServerHandshake(ident(2))
    second = decode(oracle.receive(_hello(nonce=challenge.fields["nonce"])).send)  # type: ignore[arg-type]
    step = victim.receive(decode(encode_control(FrameKind.AUTH,
                                                {"proof": second.fields["proof"]})))
    assert "token mismatch" in str(step.error)


def test_replayed_auth_fails() -> None:
    """An AUTH proof recorded on one connection is useless on the next (fresh nonces)."""
    recorded: list[bytes] = []
    client = ClientHandshake(ident(3))
    server = ServerHandshake(ident(2))
    step = server.receive(decode(client.initiate()))
    auth = client.receive(decode(step.send))  # type: ignore[arg-type]
    recorded.append(auth.send)  # type: ignore[arg-type]
    assert server.receive(decode(auth.send)).error is None  # type: ignore[arg-type]
    replay_server = ServerHandshake(ident(2))
    replay_server.receive(_hello())
    assert "token mismatch" in str(replay_server.receive(decode(recorded[0])).error)


def test_mac_input_golden_bytes() -> None:
    params = dict(version=1, job_id="job", world_size=4, client_rank=3, client_role="rank",
                  server_rank=0, server_role="coordinator",
                  client_nonce=bytes(range(32)), server_nonce=bytes(range(32, 64)))
    data = mac_input(PROOF_BY_ACCEPTOR, **params)  # type: ignore[arg-type]
    assert MAC_LABEL == b"netdist-hmac-v1\x00"
    assert data == (b"netdist-hmac-v1\x00" + b"\x01" + b"\x01"
                    + (4).to_bytes(4, "little") + (3).to_bytes(4, "little")
                    + (0).to_bytes(4, "little")
                    + b"\x03\x00job" + b"\x04rank" + b"\x0bcoordinator"
                    + bytes(range(32)) + bytes(range(32, 64)))
    other = mac_input(PROOF_BY_CONNECTOR, **params)  # type: ignore[arg-type]
    assert other[17] == 2 and other[:17] == data[:17] and other[18:] == data[18:]
    assert compute_proof(b"k", data) == hmac.new(b"k", data, hashlib.sha256).digest()


def test_identity_validation() -> None:
    with pytest.raises(ValueError, match="outside"):
        HandshakeIdentity("a", 4, 4, None)
    with pytest.raises(ValueError, match="role"):
        HandshakeIdentity("a", 0, 4, None, "admin")
    with pytest.raises(ValueError, match="job_id"):
        HandshakeIdentity("", 0, 4, None)
    with pytest.raises(ValueError, match="world_size"):
        HandshakeIdentity("a", 0, 0, None)
    with pytest.raises(TypeError, match="token"):
        HandshakeIdentity("a", 0, 1, b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expect_role"):
        ClientHandshake(ident(0), expect_role="boss")
