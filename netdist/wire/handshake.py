"""Connection handshake: identity checks plus mutual HMAC-SHA256 challenge-response.

Pure state machines, used for rank-to-rank connections and for the coordinator's port.
The connecting side runs ``ClientHandshake``, the accepting side ``ServerHandshake``; a
driver moves frames between them and the socket::

    C -> S  HELLO      {version, job_id, rank, world_size, role, nonce}
    S -> C  CHALLENGE  {version, job_id, rank, world_size, role, nonce, proof}
    C -> S  AUTH       {proof}
    S -> C  OK         {}
    (either side, instead of its next frame)  ERROR {reason, rank, role}

The accepting side checks the HELLO (version, job id, world size, role, rank range)
before it proves anything; the connecting side checks the accepting side's identity and
proof before it proves its own. Each proof is ``HMAC-SHA256(token, transcript)`` where the
transcript (``mac_input``) binds the direction, both identities and both nonces, so a
proof can neither be replayed on another connection nor reflected back to its sender.
``docs/PROTOCOL.md`` gives the transcript byte by byte.

Driver contract: send ``step.send`` if it is not ``None``, then raise ``step.error`` if it
is not ``None``, and stop when ``step.done``. Tokens are never printed.

This module is PURE: it imports neither asyncio nor socket.
"""

from __future__ import annotations

import abc
import hashlib
import hmac
import secrets
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from netdist.errors import AuthenticationError, LocalProtocolError
from netdist.wire.decoder import ControlFrame
from netdist.wire.frame import PROTOCOL_VERSION, FrameKind, _short, encode_control

__all__ = [
    "ROLES",
    "NONCE_SIZE",
    "MAX_JOB_ID_BYTES",
    "MAC_LABEL",
    "PROOF_BY_ACCEPTOR",
    "PROOF_BY_CONNECTOR",
    "TOKEN_MISMATCH",
    "HandshakeIdentity",
    "HandshakeStep",
    "ClientHandshake",
    "ServerHandshake",
    "mac_input",
    "compute_proof",
]

ROLES = ("rank", "coordinator")
"""Who is speaking: a training process (``rank``) or the rendezvous ``coordinator``."""

NONCE_SIZE = 32
MAX_JOB_ID_BYTES = 1024
MAX_WORLD_SIZE = 2**32 - 1

MAC_LABEL = b"netdist-hmac-v1\x00"
"""First 16 bytes of every MAC transcript."""

PROOF_BY_ACCEPTOR = 1
"""Direction byte of the proof the accepting side sends in CHALLENGE."""

PROOF_BY_CONNECTOR = 2
"""Direction byte of the proof the connecting side sends in AUTH."""

TOKEN_MISMATCH = "authentication failed: token mismatch"

_MAC_FIXED = struct.Struct("<16sBBIII")  # label, version, direction, world, client, server


def _describe(role: str, rank: int | None) -> str:
    if role == "coordinator":
        return "coordinator"
    return "peer" if rank is None else f"rank {rank}"


def _at(label: str) -> str:
    return f" at {label}" if label else ""


@dataclass(frozen=True, slots=True)
class HandshakeIdentity:
    """Who this side is. ``token`` ``None`` or ``""`` means the empty HMAC key."""

    job_id: str
    rank: int
    world_size: int
    token: str | None = field(repr=False)
    role: str = "rank"

    def __post_init__(self) -> None:
        if type(self.job_id) is not str or not self.job_id:
            raise ValueError("job_id must be a non-empty str")
        if len(self.job_id.encode("utf-8")) > MAX_JOB_ID_BYTES:
            raise ValueError(f"job_id is longer than {MAX_JOB_ID_BYTES} UTF-8 bytes")
        if type(self.world_size) is not int or not 1 <= self.world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size must be an int in 1..2**32-1, got {self.world_size!r}")
        if type(self.rank) is not int or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank!r} is outside 0..{self.world_size - 1}")
        if self.token is not None and type(self.token) is not str:
            raise TypeError("token must be a str or None")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")

    @property
    def key(self) -> bytes:
        """The HMAC key: the token's UTF-8 bytes (empty without a token)."""
        return self.token.encode("utf-8") if self.token else b""

    def describe(self) -> str:
        """``"rank N"`` or ``"coordinator"``, for messages."""
        return _describe(self.role, self.rank)


@dataclass(frozen=True, slots=True)
class HandshakeStep:
    """What the driver does next: send ``send``, raise ``error``, stop when ``done``.

    ``peer_rank`` is the other side's rank once known (the accepting side's rank for a
    client, the connecting rank for a server).
    """

    send: bytes | None
    done: bool
    error: AuthenticationError | None
    peer_rank: int | None


def mac_input(direction: int, *, version: int, job_id: str, world_size: int,
              client_rank: int, client_role: str, server_rank: int, server_role: str,
              client_nonce: bytes, server_nonce: bytes) -> bytes:
    """The exact bytes a handshake proof covers (see docs/PROTOCOL.md).

    ``label(16) | version u8 | direction u8 | world_size u32 | client_rank u32 |
    server_rank u32 | len u16 + job_id | len u8 + client_role | len u8 + server_role |
    client_nonce(32) | server_nonce(32)``, integers little-endian, strings UTF-8.
    """
    job = job_id.encode("utf-8")
    croles = client_role.encode("utf-8")
    sroles = server_role.encode("utf-8")
    return b"".join((
        _MAC_FIXED.pack(MAC_LABEL, version, direction, world_size, client_rank, server_rank),
        struct.pack("<H", len(job)), job,
        struct.pack("<B", len(croles)), croles,
        struct.pack("<B", len(sroles)), sroles,
        client_nonce, server_nonce,
    ))


def compute_proof(key: bytes, transcript: bytes) -> bytes:
    """``HMAC-SHA256(key, transcript)`` (32 bytes)."""
    return hmac.new(key, transcript, hashlib.sha256).digest()


def _check_identity_fields(fields: dict[str, Any], what: str) -> str | None:
    """Why ``fields`` is not a well-formed HELLO/CHALLENGE identity, or ``None``."""
    for name, kind in (("version", int), ("job_id", str), ("rank", int),
                       ("world_size", int), ("role", str), ("nonce", bytes)):
        if name not in fields:
            return f"malformed {what}: missing {name!r}"
        if type(fields[name]) is not kind:
            return (f"malformed {what}: {name!r} must be {kind.__name__}, "
                    f"got {type(fields[name]).__name__}")
    if len(fields["nonce"]) != NONCE_SIZE:
        return f"malformed {what}: nonce must be {NONCE_SIZE} bytes"
    if len(fields["job_id"].encode("utf-8")) > MAX_JOB_ID_BYTES:
        return f"malformed {what}: job id longer than {MAX_JOB_ID_BYTES} bytes"
    if fields["role"] not in ROLES:
        return f"unknown role {_short(fields['role'])}"
    return None


def _compare_identity(me: HandshakeIdentity,
                      fields: dict[str, Any]) -> tuple[str, str] | None:
    """The first mismatch between our identity and the peer's fields (theirs != ours), as
    ``(code, reason)``: the code goes into the ERROR frame so the other side can act on
    the kind of refusal without parsing the text."""
    if fields["version"] != PROTOCOL_VERSION:
        return "version", f"protocol version {fields['version']} != {PROTOCOL_VERSION}"
    if fields["job_id"] != me.job_id:
        return "job_id", f"job id {_short(fields['job_id'])} != {me.job_id!r}"
    if fields["world_size"] != me.world_size:
        return "world_size", f"world size {fields['world_size']} != {me.world_size}"
    rank = fields["rank"]
    if not 0 <= rank < me.world_size:
        return "rank_range", f"rank {rank} is outside 0..{me.world_size - 1}"
    return None


def _error_frame(me: HandshakeIdentity, reason: str, code: str | None = None) -> bytes:
    fields: dict[str, Any] = {"reason": reason, "rank": me.rank, "role": me.role}
    if code is not None:
        fields["code"] = code
    return encode_control(FrameKind.ERROR, fields)


def _peer_code(frame: ControlFrame) -> str | None:
    code = frame.fields.get("code")
    return code if type(code) is str and code else None


def _peer_reason(frame: ControlFrame) -> str:
    reason = frame.fields.get("reason")
    return reason if type(reason) is str and reason else "no reason given"


class _HandshakeSide(abc.ABC):
    """What both sides share: state, and the frames every state answers the same way
    (ERROR ends it, HEARTBEAT is ignored, data or anything after the end is refused);
    the side-specific frames go to ``_on_frame``."""

    me: HandshakeIdentity
    peer_label: str
    _peer: dict[str, Any] | None
    _state: str

    @property
    def done(self) -> bool:
        """True once the handshake succeeded or failed."""
        return self._state in ("done", "failed")

    def _peer_rank(self) -> int | None:
        return None if self._peer is None else self._peer["rank"]

    def receive(self, frame: ControlFrame | Any) -> HandshakeStep:
        """Advance on one received frame."""
        if self._state in ("done", "failed"):
            self._state = "failed"
            what = frame.kind.name if isinstance(frame, ControlFrame) else "data"
            return HandshakeStep(None, True, AuthenticationError(
                f"unexpected {what} frame{self._ended_from()} after the handshake ended"),
                self._peer_rank())
        if not isinstance(frame, ControlFrame):
            return self._reject("unexpected data frame during the handshake")
        kind = frame.kind
        if kind is FrameKind.ERROR:
            return self._refused(frame)
        if kind is FrameKind.HEARTBEAT:
            return HandshakeStep(None, False, None, self._peer_rank())
        return self._on_frame(kind, frame.fields)

    @abc.abstractmethod
    def _ended_from(self) -> str:
        """`` from <peer>`` for the after-the-end message ("" if unknown)."""

    @abc.abstractmethod
    def _reject(self, reason: str) -> HandshakeStep:
        """We refuse the peer: tell it why and fail."""

    @abc.abstractmethod
    def _refused(self, frame: ControlFrame) -> HandshakeStep:
        """The peer refused us with an ERROR frame."""

    @abc.abstractmethod
    def _on_frame(self, kind: FrameKind, fields: dict[str, Any]) -> HandshakeStep:
        """A HELLO / CHALLENGE / AUTH / OK frame in the current state."""


class ClientHandshake(_HandshakeSide):
    """The connecting side: HELLO, then verify CHALLENGE and answer AUTH, then OK.

    ``expect_role`` is the role we meant to reach (``"rank"`` for a peer,
    ``"coordinator"`` for the rendezvous port); ``expect_rank`` the rank we dialled, if
    any; ``peer_label`` (usually ``host:port``) is used in messages only.
    """

    def __init__(self, me: HandshakeIdentity, *, expect_role: str = "rank",
                 expect_rank: int | None = None, peer_label: str = "") -> None:
        if expect_role not in ROLES:
            raise ValueError(f"expect_role must be one of {ROLES}, got {expect_role!r}")
        self.me = me
        self.expect_role = expect_role
        self.expect_rank = expect_rank
        self.peer_label = peer_label
        self._nonce = b""
        self._peer: dict[str, Any] | None = None
        self._state = "init"  # init -> hello-sent -> auth-sent -> done | failed

    def _peer_desc(self, fields: dict[str, Any] | None = None) -> str:
        info = fields if fields is not None else self._peer
        if info is not None:
            role, rank = info.get("role"), info.get("rank")
            if role in ROLES and type(rank) is int:
                return _describe(role, rank)
        if self.expect_role == "coordinator":
            return "coordinator"
        return _describe("rank", self.expect_rank)

    def _reject(self, reason: str, claimed: dict[str, Any] | None = None,
                code: str | None = None) -> HandshakeStep:
        """We refuse the peer: tell it why and fail."""
        self._state = "failed"
        error = AuthenticationError(f"{self.me.describe()} rejected "
                                    f"{self._peer_desc(claimed)}{_at(self.peer_label)}: {reason}",
                                    code=code)
        return HandshakeStep(_error_frame(self.me, reason, code), True, error, self._peer_rank())

    def _refused(self, frame: ControlFrame) -> HandshakeStep:
        """The peer refused us with an ERROR frame."""
        self._state = "failed"
        error = AuthenticationError(
            f"{self._peer_desc(frame.fields)}{_at(self.peer_label)} refused "
            f"{self.me.describe()}: {_peer_reason(frame)}", code=_peer_code(frame))
        return HandshakeStep(None, True, error, self._peer_rank())

    def initiate(self) -> bytes:
        """The HELLO frame to send first (call once)."""
        if self._state != "init":
            raise LocalProtocolError("ClientHandshake.initiate() called twice")
        self._nonce = secrets.token_bytes(NONCE_SIZE)
        self._state = "hello-sent"
        me = self.me
        return encode_control(FrameKind.HELLO, {
            "version": PROTOCOL_VERSION, "job_id": me.job_id, "rank": me.rank,
            "world_size": me.world_size, "role": me.role, "nonce": self._nonce,
        })

    def receive(self, frame: ControlFrame | Any) -> HandshakeStep:
        """Advance on one received frame."""
        if self._state == "init":
            raise LocalProtocolError("ClientHandshake.receive() before initiate()")
        return super().receive(frame)

    def _ended_from(self) -> str:
        return f" from {self._peer_desc()}{_at(self.peer_label)}"

    def _on_frame(self, kind: FrameKind, fields: dict[str, Any]) -> HandshakeStep:
        state = self._state
        if state == "hello-sent" and kind is FrameKind.CHALLENGE:
            return self._on_challenge(fields)
        if state == "auth-sent" and kind is FrameKind.OK:
            self._state = "done"
            return HandshakeStep(None, True, None, self._peer_rank())
        waiting = "CHALLENGE" if state == "hello-sent" else "OK"
        return self._reject(f"unexpected {kind.name} frame while waiting for {waiting}")

    def _on_challenge(self, fields: dict[str, Any]) -> HandshakeStep:
        problem = _check_identity_fields(fields, "CHALLENGE")
        if problem is None and type(fields.get("proof")) is not bytes:
            problem = "malformed CHALLENGE: 'proof' must be bytes"
        if problem is not None:
            return self._reject(problem, fields)
        self._peer = fields
        me = self.me
        mismatch = _compare_identity(me, fields)
        if mismatch is None and fields["role"] != self.expect_role:
            mismatch = "role", f"role {fields['role']!r} != expected {self.expect_role!r}"
        if (mismatch is None and self.expect_rank is not None
                and fields["rank"] != self.expect_rank):
            mismatch = "rank", f"rank {fields['rank']} != expected {self.expect_rank}"
        if mismatch is not None:
            return self._reject(mismatch[1], code=mismatch[0])
        params = dict(version=PROTOCOL_VERSION, job_id=me.job_id, world_size=me.world_size,
                      client_rank=me.rank, client_role=me.role,
                      server_rank=fields["rank"], server_role=fields["role"],
                      client_nonce=self._nonce, server_nonce=fields["nonce"])
        key = me.key
        expected = compute_proof(key, mac_input(PROOF_BY_ACCEPTOR, **params))
        if not hmac.compare_digest(expected, fields["proof"]):
            return self._reject(TOKEN_MISMATCH, code="token")
        proof = compute_proof(key, mac_input(PROOF_BY_CONNECTOR, **params))
        self._state = "auth-sent"
        return HandshakeStep(encode_control(FrameKind.AUTH, {"proof": proof}), False, None,
                             fields["rank"])


class ServerHandshake(_HandshakeSide):
    """The accepting side: check HELLO, send CHALLENGE, verify AUTH, send OK.

    ``accept_rank(rank)`` is asked, only after the peer has proven the token, whether the
    authenticated rank may connect; it returns ``None`` to accept or a reason to refuse
    (e.g. ``"duplicate connection from rank 3"``). ``peer_label`` (usually the peer's
    ``host:port``) is used in messages only.
    """

    def __init__(self, me: HandshakeIdentity, *, peer_label: str = "",
                 accept_rank: Callable[[int], str | None] | None = None) -> None:
        self.me = me
        self.peer_label = peer_label
        self.accept_rank = accept_rank
        self._nonce = b""
        self._peer: dict[str, Any] | None = None
        self._state = "wait-hello"  # wait-hello -> wait-auth -> done | failed

    def _reject(self, reason: str, code: str | None = None) -> HandshakeStep:
        self._state = "failed"
        src = f" from {self.peer_label}" if self.peer_label else ""
        error = AuthenticationError(f"{self.me.describe()} rejected connection{src}: {reason}",
                                    code=code)
        return HandshakeStep(_error_frame(self.me, reason, code), True, error, self._peer_rank())

    def _refused(self, frame: ControlFrame) -> HandshakeStep:
        self._state = "failed"
        rank = self._peer_rank()
        claimed = frame.fields.get("rank")
        who_rank = rank if rank is not None else (claimed if type(claimed) is int else None)
        who = _describe("rank", who_rank)
        error = AuthenticationError(f"{who}{_at(self.peer_label)} refused "
                                    f"{self.me.describe()}: {_peer_reason(frame)}",
                                    code=_peer_code(frame))
        return HandshakeStep(None, True, error, rank)

    def _ended_from(self) -> str:
        return f" from {self.peer_label}" if self.peer_label else ""

    def _on_frame(self, kind: FrameKind, fields: dict[str, Any]) -> HandshakeStep:
        state = self._state
        if state == "wait-hello" and kind is FrameKind.HELLO:
            return self._on_hello(fields)
        if state == "wait-auth" and kind is FrameKind.AUTH:
            return self._on_auth(fields)
        waiting = "HELLO" if state == "wait-hello" else "AUTH"
        return self._reject(f"unexpected {kind.name} frame while waiting for {waiting}")

    def _on_hello(self, fields: dict[str, Any]) -> HandshakeStep:
        problem = _check_identity_fields(fields, "HELLO")
        if problem is not None:
            return self._reject(problem)
        me = self.me
        mismatch = _compare_identity(me, fields)
        if mismatch is not None:
            return self._reject(mismatch[1], code=mismatch[0])
        self._peer = fields
        rank = fields["rank"]
        if fields["role"] != "rank":
            return self._reject(f"role {fields['role']!r} != expected 'rank'")
        if me.role == "rank" and rank == me.rank:
            return self._reject(f"rank {rank} is this rank")
        self._nonce = secrets.token_bytes(NONCE_SIZE)
        proof = compute_proof(me.key, mac_input(PROOF_BY_ACCEPTOR, **self._params()))
        self._state = "wait-auth"
        return HandshakeStep(encode_control(FrameKind.CHALLENGE, {
            "version": PROTOCOL_VERSION, "job_id": me.job_id, "rank": me.rank,
            "world_size": me.world_size, "role": me.role, "nonce": self._nonce,
            "proof": proof,
        }), False, None, rank)

    def _hello(self) -> dict[str, Any]:
        """The accepted HELLO's fields (only called after ``_on_hello`` stored them)."""
        peer = self._peer
        if peer is None:
            raise LocalProtocolError("ServerHandshake: no HELLO accepted yet (internal "
                                     "state error)")
        return peer

    def _params(self) -> dict[str, Any]:
        me, peer = self.me, self._hello()
        return dict(version=PROTOCOL_VERSION, job_id=me.job_id, world_size=me.world_size,
                    client_rank=peer["rank"], client_role=peer["role"],
                    server_rank=me.rank, server_role=me.role,
                    client_nonce=peer["nonce"], server_nonce=self._nonce)

    def _on_auth(self, fields: dict[str, Any]) -> HandshakeStep:
        proof = fields.get("proof")
        expected = compute_proof(self.me.key, mac_input(PROOF_BY_CONNECTOR, **self._params()))
        if type(proof) is not bytes or not hmac.compare_digest(expected, proof):
            return self._reject(TOKEN_MISMATCH, code="token")
        rank: int = self._hello()["rank"]
        if self.accept_rank is not None:
            veto = self.accept_rank(rank)
            if veto is not None:
                return self._reject(str(veto))
        self._state = "done"
        return HandshakeStep(encode_control(FrameKind.OK), True, None, rank)
