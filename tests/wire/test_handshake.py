"""Handshake state machines: success, every refusal on both sides, attacks, golden bytes.

The handshake (version 2) makes the connecting side prove the token before the accepting
side sends anything derived from it: these tests pin that a stranger's view of the
acceptor (CHALLENGE, refusals) is independent of the token and of the job, that every
mismatch a legitimate peer can have is still refused with a precise reason and code, and
the exact bytes of docs/PROTOCOL.md section 6.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
from netdist.wire import handshake as handshake_module
from netdist.wire.handshake import (
    HANDSHAKE_VERSION,
    MAC_LABEL,
    PROOF_BY_ACCEPTOR,
    PROOF_BY_CONNECTOR,
    TOKEN_MISMATCH,
    compute_proof,
    mac_input,
)

CLIENT_ADDR = "127.0.0.1:51234"  # the server's view of the connecting side
SERVER_ADDR = "127.0.0.1:40000"  # the client's view of the accepting side
TOKEN = "s3cret-t0ken-0123456789"
VERSION_HINT = " (the peer may run another netdist version; this side speaks handshake version 2)"


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
          ) -> tuple[HandshakeStep, HandshakeStep, list[bytes]]:
    """Run both sides to completion through real frame bytes; return the final steps and
    every frame sent, in order."""
    to_server = [client.initiate()]
    to_client: list[bytes] = []
    c_final: HandshakeStep | None = None
    s_final: HandshakeStep | None = None
    wire: list[bytes] = []
    for _ in range(10):
        while to_server and s_final is None:
            data = to_server.pop(0)
            wire.append(data)
            step = server.receive(decode(data))
            if step.send is not None:
                to_client.append(step.send)
            if step.done:
                s_final = step
        while to_client and c_final is None:
            data = to_client.pop(0)
            wire.append(data)
            step = client.receive(decode(data))
            if step.send is not None:
                to_server.append(step.send)
            if step.done:
                c_final = step
        if c_final is not None and s_final is not None:
            break
    assert c_final is not None and s_final is not None, wire
    return c_final, s_final, wire


def kinds(wire: list[bytes]) -> list[FrameKind]:
    return [decode(data).kind for data in wire]


def pair(c: HandshakeIdentity, s: HandshakeIdentity, *,
         expect_role: str = "rank", expect_rank: int | None = None,
         accept_rank: Callable[[int], str | None] | None = None
         ) -> tuple[HandshakeStep, HandshakeStep, list[FrameKind]]:
    c_step, s_step, wire = drive(
        ClientHandshake(c, expect_role=expect_role, expect_rank=expect_rank,
                        peer_label=SERVER_ADDR),
        ServerHandshake(s, peer_label=CLIENT_ADDR, accept_rank=accept_rank))
    return c_step, s_step, kinds(wire)


@pytest.fixture
def pinned_nonces(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bytes]]:
    """Make ``_fresh_nonce`` return the listed nonces in order (transcripts become exact)."""
    queue: list[bytes] = []
    monkeypatch.setattr(handshake_module, "_fresh_nonce", lambda: queue.pop(0))
    yield queue


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
    ok = decode(s.send)  # type: ignore[arg-type]
    assert ok.kind is FrameKind.OK and set(ok.fields) == {"proof"}
    assert len(ok.fields["proof"]) == 32
    assert seen == [3]


def test_success_with_coordinator() -> None:
    c, s, _ = pair(ident(0), ident(0, role="coordinator"), expect_role="coordinator")
    assert c.error is None and s.error is None and c.peer_rank == 0 and s.peer_rank == 0


def test_hello_carries_only_version_and_nonce() -> None:
    client = ClientHandshake(ident(1, job="job-7", world=8))
    hello = decode(client.initiate())
    assert hello.kind is FrameKind.HELLO
    assert set(hello.fields) == {"version", "nonce"}
    assert hello.fields["version"] == HANDSHAKE_VERSION == 2
    assert len(hello.fields["nonce"]) == 32
    other = decode(ClientHandshake(ident(1)).initiate())
    assert other.fields["nonce"] != hello.fields["nonce"]
    with pytest.raises(LocalProtocolError, match="twice"):
        client.initiate()


# ---------------------------------------------------------------------------------------
# what a stranger sees: nothing derived from the token, nothing about the job


def _stranger_auth(challenge: ControlFrame, hello_nonce: bytes, *, token: str,
                   job: str = "a", rank: int = 3, world: int = 4) -> ControlFrame:
    """The AUTH an attacker holding ``token`` (a guess) builds for ``challenge``."""
    transcript = mac_input(
        PROOF_BY_CONNECTOR, version=2, job_id=job, world_size=world, client_rank=rank,
        client_role="rank", server_rank=challenge.fields["rank"],
        server_role=challenge.fields["role"], client_nonce=hello_nonce,
        server_nonce=challenge.fields["nonce"])
    return decode(encode_control(FrameKind.AUTH, {
        "job_id": job, "rank": rank, "world_size": world, "role": "rank",
        "proof": compute_proof(token.encode(), transcript)}))


def _server_view(server_ident: HandshakeIdentity, guess: str, *, job: str = "a",
                 world: int = 4) -> list[bytes]:
    """Every byte a ServerHandshake sends to a stranger who guesses ``guess``."""
    server = ServerHandshake(server_ident)
    hello_nonce = bytes(range(32))
    first = server.receive(decode(encode_control(
        FrameKind.HELLO, {"version": 2, "nonce": hello_nonce})))
    assert first.error is None and first.send is not None
    last = server.receive(_stranger_auth(decode(first.send), hello_nonce, token=guess,
                                         job=job, world=world))
    assert isinstance(last.error, AuthenticationError) and last.send is not None
    assert str(last.error) == f"{server_ident.describe()} rejected connection: {TOKEN_MISMATCH}"
    assert last.error.code == "token"
    return [first.send, last.send]


REFUSAL = (b"ND\x01\x05" + (58).to_bytes(4, "little") + bytes(8)
           + b"\x82" + b"\xa6reason" + b"\xd9\x25authentication failed: token mismatch"
           + b"\xa4code" + b"\xa5token")
"""The one refusal any wrong proof gets: ERROR {reason, code}, 58 header bytes."""


def test_a_stranger_sees_the_same_bytes_whatever_the_token_and_job(
        pinned_nonces: list[bytes]) -> None:
    """Servers with different tokens, job ids and world sizes, probed with different
    wrong guesses, send byte-identical frames: nothing depends on the token or the job."""
    views = []
    for s_token, s_job, s_world, guess in [(TOKEN, "a", 4, "guess-1"),
                                           ("another-token-0123", "a", 4, "guess-2"),
                                           (TOKEN, "job-b", 4, "guess-1"),
                                           (TOKEN, "a", 8, "guess-3"),
                                           (None, "z", 3, "guess-4")]:
        pinned_nonces.append(bytes(range(32, 64)))
        views.append(_server_view(ident(2, job=s_job, world=s_world, token=s_token), guess))
    assert all(view == views[0] for view in views)
    challenge, refusal = views[0]
    assert challenge == (b"ND\x01\x02" + (66).to_bytes(4, "little") + bytes(8)
                         + b"\x84" + b"\xa7version\x02" + b"\xa4rank\x02"
                         + b"\xa4role\xa4rank" + b"\xa5nonce\xc4\x20" + bytes(range(32, 64)))
    assert refusal == REFUSAL


def test_a_wrong_guess_with_the_right_job_id_gets_the_same_refusal() -> None:
    """Knowing (or guessing) the job id and world size changes nothing before the proof."""
    for job, world in [("a", 4), ("wrong-job", 4), ("a", 9)]:
        assert _server_view(ident(2), "bad-guess", job=job, world=world)[1] == REFUSAL


def test_the_acceptor_never_signs_a_stranger_chosen_nonce() -> None:
    """No byte the acceptor sends before the peer's proof verifies is an HMAC under the
    real token of any transcript built from the connection's values (no oracle)."""
    server_ident = ident(0, role="coordinator")
    sent = _server_view(server_ident, "bad-guess")
    challenge = decode(sent[0])
    for direction in (PROOF_BY_ACCEPTOR, PROOF_BY_CONNECTOR):
        for client_nonce, server_nonce in [(bytes(range(32)), challenge.fields["nonce"]),
                                           (challenge.fields["nonce"], bytes(range(32)))]:
            mac = compute_proof(TOKEN.encode(), mac_input(
                direction, version=2, job_id="a", world_size=4, client_rank=3,
                client_role="rank", server_rank=0, server_role="coordinator",
                client_nonce=client_nonce, server_nonce=server_nonce))
            assert all(mac not in data for data in sent)
    assert b"\xa1a" not in sent[0] + sent[1]  # the job id "a" as a msgpack str


# ---------------------------------------------------------------------------------------
# refusals: the legitimate side gets a clear AuthenticationError


def both_errors(c: HandshakeStep, s: HandshakeStep) -> tuple[str, str]:
    assert isinstance(c.error, AuthenticationError) and isinstance(s.error, AuthenticationError)
    assert c.done and s.done
    return str(c.error), str(s.error)


def both_codes(c: HandshakeStep, s: HandshakeStep) -> tuple[str | None, str | None]:
    assert isinstance(c.error, AuthenticationError) and isinstance(s.error, AuthenticationError)
    return c.error.code, s.error.code


def test_token_mismatch() -> None:
    c, s, log = pair(ident(3, token="wrong-token-0123456"), ident(2, token=TOKEN))
    client_msg, server_msg = both_errors(c, s)
    # the acceptor checks the connector's proof first; it never proves anything itself
    assert server_msg == f"rank 2 rejected connection from {CLIENT_ADDR}: {TOKEN_MISMATCH}"
    assert client_msg == f"rank 2 at {SERVER_ADDR} refused rank 3: {TOKEN_MISMATCH}"
    assert log == [FrameKind.HELLO, FrameKind.CHALLENGE, FrameKind.AUTH, FrameKind.ERROR]
    assert s.send == REFUSAL
    assert both_codes(c, s) == ("token", "token")
    for text in (client_msg, server_msg, repr(c), repr(s), repr(ident(1))):
        assert TOKEN not in text and "wrong-token" not in text


@pytest.mark.parametrize("c_token, s_token", [(None, TOKEN), (TOKEN, None), ("", "x")])
def test_token_versus_no_token(c_token: str | None, s_token: str | None) -> None:
    c, s, _ = pair(ident(1, token=c_token), ident(0, token=s_token))
    client_msg, server_msg = both_errors(c, s)
    assert client_msg.endswith(TOKEN_MISMATCH) and server_msg.endswith(TOKEN_MISMATCH)
    assert both_codes(c, s) == ("token", "token")


def test_job_id_mismatch_is_reported_after_the_proof() -> None:
    c, s, log = pair(ident(3, job="b"), ident(2, job="a"))
    client_msg, server_msg = both_errors(c, s)
    assert server_msg == f"rank 2 rejected connection from {CLIENT_ADDR}: job id 'b' != 'a'"
    assert client_msg == f"rank 2 at {SERVER_ADDR} refused rank 3: job id 'b' != 'a'"
    assert log == [FrameKind.HELLO, FrameKind.CHALLENGE, FrameKind.AUTH, FrameKind.ERROR]
    # an authenticated peer is told who refused it
    assert decode(s.send).fields == {  # type: ignore[arg-type]
        "reason": "job id 'b' != 'a'", "code": "job_id", "rank": 2, "role": "rank"}
    assert both_codes(c, s) == ("job_id", "job_id")


def test_job_id_mismatch_with_a_wrong_token_reveals_nothing() -> None:
    c, s, _ = pair(ident(3, job="b", token="wrong-token-0123456"), ident(2, job="a"))
    assert s.send == REFUSAL
    assert both_codes(c, s) == ("token", "token")


def test_world_size_mismatch() -> None:
    c, s, _ = pair(ident(3, world=8), ident(2, world=4))
    client_msg, server_msg = both_errors(c, s)
    assert server_msg == f"rank 2 rejected connection from {CLIENT_ADDR}: world size 8 != 4"
    assert client_msg == f"rank 2 at {SERVER_ADDR} refused rank 3: world size 8 != 4"
    assert both_codes(c, s) == ("world_size", "world_size")
    # without the token, the same peer learns nothing about the world size
    c, s, _ = pair(ident(3, world=8, token="wrong-token-0123456"), ident(2, world=4))
    assert s.send == REFUSAL and both_codes(c, s) == ("token", "token")


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

    def accept(rank: int) -> str | None:
        asked.append(rank)
        return None

    c, s, _ = pair(ident(3, token="bad"), ident(2), accept_rank=accept)
    assert asked == [] and both_codes(c, s) == ("token", "token")


def test_expected_rank_mismatch_is_refused_before_the_client_proves_anything() -> None:
    c, s, log = pair(ident(3), ident(1), expect_rank=2)
    client_msg, server_msg = both_errors(c, s)
    assert client_msg == f"rank 3 rejected rank 1 at {SERVER_ADDR}: rank 1 != expected 2"
    assert server_msg == f"peer at {CLIENT_ADDR} refused rank 1: rank 1 != expected 2"
    assert log == [FrameKind.HELLO, FrameKind.CHALLENGE, FrameKind.ERROR]
    assert both_codes(c, s) == ("rank", "rank")


def test_wrong_role_client_expected_coordinator() -> None:
    c, s, log = pair(ident(3), ident(0), expect_role="coordinator")
    client_msg, server_msg = both_errors(c, s)
    assert client_msg == (f"rank 3 rejected rank 0 at {SERVER_ADDR}: "
                          "role 'rank' != expected 'coordinator'")
    assert server_msg == (f"peer at {CLIENT_ADDR} refused rank 0: "
                          "role 'rank' != expected 'coordinator'")
    assert log == [FrameKind.HELLO, FrameKind.CHALLENGE, FrameKind.ERROR]
    assert both_codes(c, s) == ("role", "role")


def test_wrong_role_server_refuses_coordinator_client() -> None:
    c, s, _ = pair(ident(1, role="coordinator"), ident(2))
    client_msg, server_msg = both_errors(c, s)
    assert server_msg == (f"rank 2 rejected connection from {CLIENT_ADDR}: "
                          "role 'coordinator' != expected 'rank'")
    assert client_msg == (f"rank 2 at {SERVER_ADDR} refused coordinator: "
                          "role 'coordinator' != expected 'rank'")


_DROP = object()


def _frame(kind: FrameKind, base: dict[str, Any], overrides: dict[str, Any]) -> ControlFrame:
    fields = {**base, **overrides}
    for key in [k for k, v in fields.items() if v is _DROP]:
        del fields[key]
    return decode(encode_control(kind, fields))


V1_HELLO = {"version": 1, "job_id": "a", "rank": 3, "world_size": 4, "role": "rank",
            "nonce": bytes(32)}


@pytest.mark.parametrize("fields, reason, code", [
    (V1_HELLO, "handshake version 1 != 2", "version"),  # an old client's HELLO
    ({"version": 3, "nonce": bytes(32)}, "handshake version 3 != 2", "version"),
    ({"version": 2, "nonce": b"short"}, "malformed HELLO: nonce must be 32 bytes", None),
    ({"version": 2}, "malformed HELLO: missing 'nonce'", None),
    ({"nonce": bytes(32)}, "malformed HELLO: missing 'version'", None),
    ({"version": "2", "nonce": bytes(32)}, "malformed HELLO: 'version' must be int, got str",
     None),
])
def test_server_refuses_bad_hello(fields: dict[str, Any], reason: str,
                                  code: str | None) -> None:
    server = ServerHandshake(ident(2, job="secret-job"), peer_label=CLIENT_ADDR)
    step = server.receive(decode(encode_control(FrameKind.HELLO, fields)))
    assert step.done and isinstance(step.error, AuthenticationError)
    assert str(step.error) == f"rank 2 rejected connection from {CLIENT_ADDR}: {reason}"
    assert step.error.code == code
    error = decode(step.send)  # type: ignore[arg-type]
    assert error.kind is FrameKind.ERROR  # only the reason (and code): nothing about us
    assert error.fields == ({"reason": reason} if code is None else
                            {"reason": reason, "code": code})
    # and a client receiving that ERROR reports it (naming its own handshake version
    # when the refusal carries no code: an older acceptor cannot parse a new HELLO)
    client = ClientHandshake(ident(3), peer_label=SERVER_ADDR)
    client.initiate()
    refused = client.receive(error)
    hint = VERSION_HINT if code is None else ""
    assert str(refused.error) == f"peer at {SERVER_ADDR} refused rank 3: {reason}{hint}"
    assert isinstance(refused.error, AuthenticationError) and refused.error.code == code
    assert refused.send is None and refused.done


def test_new_client_refused_by_a_version_1_acceptor() -> None:
    """A version-1 acceptor cannot read the new HELLO; the client says which it speaks."""
    client = ClientHandshake(ident(3), expect_role="coordinator", peer_label=SERVER_ADDR)
    client.initiate()
    step = client.receive(decode(encode_control(FrameKind.ERROR, {
        "reason": "malformed HELLO: missing 'job_id'", "rank": 0, "role": "coordinator"})))
    assert str(step.error) == (f"coordinator at {SERVER_ADDR} refused rank 3: malformed "
                               f"HELLO: missing 'job_id'{VERSION_HINT}")


def test_client_refuses_a_challenge_of_another_version() -> None:
    client = ClientHandshake(ident(3), peer_label=SERVER_ADDR)
    client.initiate()
    step = client.receive(_frame(FrameKind.CHALLENGE, {
        "version": 3, "rank": 2, "role": "rank", "nonce": bytes(32)}, {}))
    assert str(step.error) == f"rank 3 rejected rank 2 at {SERVER_ADDR}: handshake version 3 != 2"
    assert isinstance(step.error, AuthenticationError) and step.error.code == "version"
    assert decode(step.send).fields == {  # type: ignore[arg-type]
        "reason": "handshake version 3 != 2", "code": "version"}


def _server_waiting_for_auth(pinned: list[bytes], me: HandshakeIdentity
                             ) -> tuple[ServerHandshake, bytes]:
    pinned.append(bytes(range(32, 64)))
    server = ServerHandshake(me, peer_label=CLIENT_ADDR)
    server.receive(decode(encode_control(FrameKind.HELLO, {"version": 2,
                                                           "nonce": bytes(range(32))})))
    return server, bytes(range(32, 64))


def _auth(job: str = "a", rank: int = 3, world: int = 4, role: str = "rank",
          token: str = TOKEN, overrides: dict[str, Any] | None = None) -> ControlFrame:
    """An AUTH for a server rank 2 whose nonce is 32..63 (client nonce 0..31), with its
    proof made for the given values and then ``overrides`` applied."""
    proof = compute_proof(token.encode(), mac_input(
        PROOF_BY_CONNECTOR, version=2, job_id=job, world_size=world, client_rank=rank,
        client_role=role, server_rank=2, server_role="rank",
        client_nonce=bytes(range(32)), server_nonce=bytes(range(32, 64))))
    return _frame(FrameKind.AUTH, {"job_id": job, "rank": rank, "world_size": world,
                                   "role": role, "proof": proof}, overrides or {})


@pytest.mark.parametrize("auth, reason, code", [
    # structurally bad: refused before the proof is even looked at
    ({"rank": -1}, "malformed AUTH: rank -1 is not in 0..2**32-1", None),
    ({"world_size": 0}, "malformed AUTH: world size 0 is not in 1..2**32-1", None),
    ({"rank": True}, "malformed AUTH: 'rank' must be int, got bool", None),
    ({"rank": "3"}, "malformed AUTH: 'rank' must be int, got str", None),
    ({"proof": b"short"}, "malformed AUTH: proof must be 32 bytes", None),
    ({"job_id": _DROP}, "malformed AUTH: missing 'job_id'", None),
    ({"job_id": "x" * 2000}, "malformed AUTH: job id must be 1..1024 bytes", None),
    ({"role": "admin"}, "unknown role 'admin'", None),
    # well-formed but not proven: the one refusal
    ({"proof": bytes(32)}, TOKEN_MISMATCH, "token"),
    ({"rank": 1}, TOKEN_MISMATCH, "token"),  # the proof was made for rank 3
])
def test_server_refuses_bad_auth_before_the_proof(
        pinned_nonces: list[bytes], auth: dict[str, Any], reason: str,
        code: str | None) -> None:
    server, _ = _server_waiting_for_auth(pinned_nonces, ident(2, job="secret-job"))
    step = server.receive(_auth(job="secret-job", overrides=auth))
    assert str(step.error) == f"rank 2 rejected connection from {CLIENT_ADDR}: {reason}"
    assert isinstance(step.error, AuthenticationError) and step.error.code == code
    error = decode(step.send)  # type: ignore[arg-type]
    assert error.fields == ({"reason": reason} if code is None else
                            {"reason": reason, "code": code})


@pytest.mark.parametrize("rank, reason", [(4, "rank 4 is outside 0..3"),
                                          (2**32 - 1, "rank 4294967295 is outside 0..3")])
def test_server_refuses_an_authenticated_rank_out_of_range(
        pinned_nonces: list[bytes], rank: int, reason: str) -> None:
    server, _ = _server_waiting_for_auth(pinned_nonces, ident(2))
    step = server.receive(_auth(rank=rank))
    assert str(step.error) == f"rank 2 rejected connection from {CLIENT_ADDR}: {reason}"
    assert isinstance(step.error, AuthenticationError) and step.error.code == "rank_range"
    assert decode(step.send).fields == {  # type: ignore[arg-type]
        "reason": reason, "code": "rank_range", "rank": 2, "role": "rank"}


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
    step = client.receive(decode(encode_control(FrameKind.OK, {"proof": bytes(32)})))
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


def test_malformed_challenge_and_ok() -> None:
    client = ClientHandshake(ident(3), peer_label=SERVER_ADDR)
    client.initiate()
    step = client.receive(_frame(FrameKind.CHALLENGE, {
        "version": 2, "rank": 2, "role": "rank"}, {}))
    assert str(step.error) == (f"rank 3 rejected rank 2 at {SERVER_ADDR}: "
                               "malformed CHALLENGE: missing 'nonce'")
    client = ClientHandshake(ident(3), peer_label=SERVER_ADDR)
    client.initiate()
    assert client.receive(_frame(FrameKind.CHALLENGE, {
        "version": 2, "rank": 2, "role": "rank", "nonce": bytes(32)}, {})).error is None
    step = client.receive(decode(encode_control(FrameKind.OK)))
    assert str(step.error) == (f"rank 3 rejected rank 2 at {SERVER_ADDR}: "
                               "malformed OK: missing 'proof'")


_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1),
                   st.text(max_size=8), st.binary(max_size=40),
                   st.sampled_from(["rank", "coordinator", "a", 2, bytes(32)]))
_KEYS = st.sampled_from(["version", "nonce", "rank", "role", "job_id", "world_size",
                         "proof", "reason", "code", "x"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(list(FrameKind)[1:]),
                          st.dictionaries(_KEYS, _VALUES, max_size=7)), min_size=1,
                max_size=4),
       st.booleans())
def test_any_frames_give_a_step_never_an_exception(
        frames: list[tuple[FrameKind, dict[str, Any]]], as_client: bool) -> None:
    """Whatever a peer sends, either side answers with a HandshakeStep: hostile fields
    (negative or huge ranks, wrong types, odd sizes) never escape as struct.error,
    KeyError or TypeError."""
    side: ClientHandshake | ServerHandshake
    if as_client:
        side = ClientHandshake(ident(3))
        side.initiate()
    else:
        side = ServerHandshake(ident(2))
    for kind, fields in frames:
        step = side.receive(decode(encode_control(kind, fields)))
        assert isinstance(step, HandshakeStep)
        assert step.error is None or isinstance(step.error, AuthenticationError)
        if step.send is not None:
            assert decode(step.send).kind in (FrameKind.CHALLENGE, FrameKind.AUTH,
                                              FrameKind.OK, FrameKind.ERROR)


# ---------------------------------------------------------------------------------------
# attacks


def _legit_run(pinned: list[bytes]) -> list[bytes]:
    pinned.extend([bytes(range(32)), bytes(range(32, 64))])
    c, s, wire = drive(ClientHandshake(ident(3)), ServerHandshake(ident(2)))
    assert c.error is None and s.error is None
    return wire


def test_replayed_auth_fails(pinned_nonces: list[bytes]) -> None:
    """An AUTH recorded on one connection is useless on the next (the acceptor's nonce
    is fresh), even when the attacker replays the recorded HELLO too."""
    hello, _, auth, _ = _legit_run(pinned_nonces)
    server = ServerHandshake(ident(2))
    pinned_nonces.append(bytes(range(64, 96)))  # this connection's fresh nonce
    assert server.receive(decode(hello)).error is None
    step = server.receive(decode(auth))
    assert str(step.error) == f"rank 2 rejected connection: {TOKEN_MISMATCH}"


def test_reflected_acceptor_proof_fails(pinned_nonces: list[bytes]) -> None:
    """The acceptor's proof (recorded from a legitimate run) presented as a connector's
    proof on a connection with the same nonces fails: the direction byte differs."""
    hello, _, auth, ok = _legit_run(pinned_nonces)
    pinned_nonces.append(bytes(range(32, 64)))  # the acceptor even repeats its nonce
    server = ServerHandshake(ident(2))
    server.receive(decode(hello))
    forged = {**decode(auth).fields, "proof": decode(ok).fields["proof"]}
    step = server.receive(decode(encode_control(FrameKind.AUTH, forged)))
    assert str(step.error) == f"rank 2 rejected connection: {TOKEN_MISMATCH}"


def test_a_fake_acceptor_is_refused_by_the_client() -> None:
    """A listener without the token cannot finish the handshake: its OK proof fails."""
    client = ClientHandshake(ident(3), expect_rank=2, peer_label=SERVER_ADDR)
    client.initiate()
    step = client.receive(_frame(FrameKind.CHALLENGE, {
        "version": 2, "rank": 2, "role": "rank", "nonce": bytes(32)}, {}))
    assert decode(step.send).kind is FrameKind.AUTH  # type: ignore[arg-type]
    step = client.receive(decode(encode_control(FrameKind.OK, {"proof": bytes(32)})))
    assert str(step.error) == f"rank 3 rejected rank 2 at {SERVER_ADDR}: {TOKEN_MISMATCH}"
    assert isinstance(step.error, AuthenticationError) and step.error.code == "token"


def test_a_replayed_ok_fails(pinned_nonces: list[bytes]) -> None:
    """An OK recorded on one connection does not complete another (fresh client nonce)."""
    _, challenge, _, ok = _legit_run(pinned_nonces)
    client = ClientHandshake(ident(3), peer_label=SERVER_ADDR)
    pinned_nonces.append(bytes(range(96, 128)))
    client.initiate()
    assert client.receive(decode(challenge)).error is None
    assert str(client.receive(decode(ok)).error).endswith(TOKEN_MISMATCH)


# ---------------------------------------------------------------------------------------
# golden bytes (docs/PROTOCOL.md section 6.4), derived by hand from the spec

EXAMPLE_TOKEN = b"correct-horse-battery-staple"
NC, NS = bytes(range(32)), bytes(range(32, 64))


def _example_transcript(direction: int) -> bytes:
    return (b"netdist-hmac-v2\x00" + bytes([2, direction])
            + (4).to_bytes(4, "little")      # world size
            + (3).to_bytes(4, "little")      # client rank
            + (0).to_bytes(4, "little")      # server rank
            + b"\x03\x00job" + b"\x04rank" + b"\x0bcoordinator" + NC + NS)


def _prefix(kind: int, header_len: int) -> bytes:
    return b"ND\x01" + bytes([kind]) + header_len.to_bytes(4, "little") + bytes(8)


def _example_frames() -> list[bytes]:
    mac2 = hmac.new(EXAMPLE_TOKEN, _example_transcript(2), hashlib.sha256).digest()
    mac1 = hmac.new(EXAMPLE_TOKEN, _example_transcript(1), hashlib.sha256).digest()
    return [
        _prefix(1, 50) + b"\x82\xa7version\x02\xa5nonce\xc4\x20" + NC,
        _prefix(2, 73) + (b"\x84\xa7version\x02\xa4rank\x00\xa4role\xabcoordinator"
                          b"\xa5nonce\xc4\x20") + NS,
        _prefix(3, 80) + (b"\x85\xa6job_id\xa3job\xa4rank\x03\xaaworld_size\x04"
                          b"\xa4role\xa4rank\xa5proof\xc4\x20") + mac2,
        _prefix(4, 41) + b"\x81\xa5proof\xc4\x20" + mac1,
    ]


def test_mac_input_golden_bytes() -> None:
    params = dict(version=2, job_id="job", world_size=4, client_rank=3, client_role="rank",
                  server_rank=0, server_role="coordinator", client_nonce=NC, server_nonce=NS)
    assert MAC_LABEL == b"netdist-hmac-v2\x00" and len(MAC_LABEL) == 16
    for direction in (PROOF_BY_ACCEPTOR, PROOF_BY_CONNECTOR):
        data = mac_input(direction, **params)  # type: ignore[arg-type]
        assert data == _example_transcript(direction) and len(data) == 116
    assert compute_proof(b"k", b"x") == hmac.new(b"k", b"x", hashlib.sha256).digest()


def test_example_handshake_golden_bytes(pinned_nonces: list[bytes]) -> None:
    pinned_nonces.extend([NC, NS])
    token = EXAMPLE_TOKEN.decode()
    c, s, wire = drive(
        ClientHandshake(HandshakeIdentity("job", 3, 4, token), expect_role="coordinator"),
        ServerHandshake(HandshakeIdentity("job", 0, 4, token, "coordinator")))
    assert c.error is None and s.error is None
    assert wire == _example_frames()


def _doc_dump(text: str, title: str) -> bytes:
    block = text.split(title)[1].split("```")[1]
    return bytes.fromhex("".join(re.split(r"\s{3,}", line.strip())[0]
                                 for line in block.splitlines() if line.strip()))


def test_protocol_md_handshake_example_matches() -> None:
    """The hex dumps in docs/PROTOCOL.md are these bytes, byte for byte."""
    text = (Path(__file__).parents[2] / "docs" / "PROTOCOL.md").read_text(encoding="utf-8")
    frames = _example_frames()
    assert _doc_dump(text, "Example handshake:") == b"".join(frames)
    assert _doc_dump(text, "Example refusal:") == REFUSAL
    transcript = _example_transcript(2)
    assert _doc_dump(text, "Example transcript") == transcript
    for direction, label in ((2, "MAC(2)"), (1, "MAC(1)")):
        mac = hmac.new(EXAMPLE_TOKEN, _example_transcript(direction), hashlib.sha256)
        assert f"{label} = `{mac.hexdigest()}`" in text


# ---------------------------------------------------------------------------------------
# identities


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


def test_identity_repr_masks_the_token() -> None:
    identity = ident(1)
    for text in (repr(identity), str(identity)):
        assert text == ("HandshakeIdentity(job_id='a', rank=1, world_size=4, token='***', "
                        "role='rank')")
        assert TOKEN not in text
    assert "token=None" in repr(ident(1, token=None))
