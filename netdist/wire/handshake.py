"""Connection handshake: the connecting side proves the token first, then the acceptor.

Pure state machines, used for rank-to-rank connections and for the coordinator's port.
The connecting side runs ``ClientHandshake``, the accepting side ``ServerHandshake``; a
driver moves frames between them and the socket::

    C -> S  HELLO      {version, nonce}
    S -> C  CHALLENGE  {version, rank, role, nonce}
    C -> S  AUTH       {job_id, rank, world_size, role, proof}     proof = MAC(2)
    S -> C  OK         {proof}                                      proof = MAC(1)
    (either side, instead of its next frame)  ERROR {reason, code[, rank, role]}

Why this order: whoever sends the first token-derived value gives its receiver something
to test token guesses against offline. The accepting side is the one any stranger can
reach, so it sends nothing derived from the token, and nothing about its job (job id,
world size), until the connecting side's proof has verified: CHALLENGE holds public
values and a fresh nonce, and every refusal before that point is a fixed text. (In
handshake version 1 the acceptor proved first, over a nonce the stranger chose, and its
refusals named the job id: one connection sufficed to brute-force a weak token.) The
connector's job id and world size travel inside AUTH, bound by its proof, and are
compared only once the proof verified, so a rank of another job or size still gets a
precise refusal (``job_id``, ``world_size``, ``rank_range`` codes).

Each proof is ``HMAC-SHA256(token, transcript)`` where the transcript (``mac_input``)
binds the direction, both identities, the job id and both nonces, so a proof can neither
be replayed on another connection nor reflected back to its sender; the acceptor's proof
goes only to a peer that has already proven the token, so it is never an oracle.
``docs/PROTOCOL.md`` gives every frame and the transcript byte by byte.

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
from dataclasses import dataclass
from typing import Any

from netdist.config import redacted_repr
from netdist.errors import AuthenticationError, LocalProtocolError
from netdist.wire.decoder import ControlFrame
from netdist.wire.frame import FrameKind, _short, encode_control

__all__ = [
    "ROLES",
    "HANDSHAKE_VERSION",
    "NONCE_SIZE",
    "PROOF_SIZE",
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

ROLES = ("rank", "coordinator", "elastic")
"""Who is speaking: a training process (``rank``), the rendezvous ``coordinator``, or an
elastic job's membership endpoint (``elastic``, ``netdist.elastic.endpoint``)."""

HANDSHAKE_VERSION = 2
"""The ``version`` in HELLO and CHALLENGE, and byte 16 of every MAC transcript. Versioned
apart from the frame layout (the frame prefix's version byte), which did not change."""

NONCE_SIZE = 32
PROOF_SIZE = 32
MAX_JOB_ID_BYTES = 1024
MAX_WORLD_SIZE = 2**32 - 1
MAX_RANK = 2**32 - 1

MAC_LABEL = b"netdist-hmac-v2\x00"
"""First 16 bytes of every MAC transcript."""

PROOF_BY_ACCEPTOR = 1
"""Direction byte of the accepting side's proof (in OK)."""

PROOF_BY_CONNECTOR = 2
"""Direction byte of the connecting side's proof (in AUTH)."""

TOKEN_MISMATCH = "authentication failed: token mismatch"

_MAC_FIXED = struct.Struct("<16sBBIII")  # label, version, direction, world, client, server

# (field, type) a frame must carry, in the order they are checked (extra keys are ignored)
_HELLO = (("version", int), ("nonce", bytes))
_CHALLENGE = (("version", int), ("rank", int), ("role", str), ("nonce", bytes))
_AUTH = (("job_id", str), ("rank", int), ("world_size", int), ("role", str),
         ("proof", bytes))
_OK = (("proof", bytes),)


def _fresh_nonce() -> bytes:
    """A new random per-connection nonce (a function so tests can pin transcripts)."""
    return secrets.token_bytes(NONCE_SIZE)


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
    token: str | None
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

    def __repr__(self) -> str:
        """The fields, with the token shown as ``'***'`` (tokens are never printed)."""
        return redacted_repr(self)

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

    ``peer_rank`` is the other side's rank once known (the rank the accepting side
    announced, for a client; the rank the connecting side claimed, for a server).
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


def _check_fields(fields: dict[str, Any], schema: tuple[tuple[str, type], ...],
                  what: str) -> tuple[str | None, str] | None:
    """Why ``fields`` is not a well-formed ``what`` frame, as ``(code, reason)``, or
    ``None``. Only the frame's own content is judged (never this side's job or token),
    so the reason is safe to tell anyone. A different handshake ``version`` is reported
    before anything else, so a peer of another version learns exactly that."""
    version = fields.get("version")
    if "version" in dict(schema) and type(version) is int and version != HANDSHAKE_VERSION:
        return "version", f"handshake version {version} != {HANDSHAKE_VERSION}"
    for name, kind in schema:
        if name not in fields:
            return None, f"malformed {what}: missing {name!r}"
        if type(fields[name]) is not kind:
            return None, (f"malformed {what}: {name!r} must be {kind.__name__}, "
                          f"got {type(fields[name]).__name__}")
    return _check_values(fields, what)


def _check_values(fields: dict[str, Any], what: str) -> tuple[str | None, str] | None:
    """The range checks of ``_check_fields`` (sizes that the MAC transcript must fit)."""
    for name, size in (("nonce", NONCE_SIZE), ("proof", PROOF_SIZE)):
        if name in fields and len(fields[name]) != size:
            return None, f"malformed {what}: {name} must be {size} bytes"
    if "job_id" in fields:
        job = fields["job_id"]
        if not job or len(job.encode("utf-8")) > MAX_JOB_ID_BYTES:
            return None, f"malformed {what}: job id must be 1..{MAX_JOB_ID_BYTES} bytes"
    if "world_size" in fields and not 1 <= fields["world_size"] <= MAX_WORLD_SIZE:
        return None, f"malformed {what}: world size {fields['world_size']} is not in 1..2**32-1"
    if "rank" in fields and not 0 <= fields["rank"] <= MAX_RANK:
        return None, f"malformed {what}: rank {fields['rank']} is not in 0..2**32-1"
    if "role" in fields and fields["role"] not in ROLES:
        return None, f"unknown role {_short(fields['role'])}"
    return None


def _compare_identity(me: HandshakeIdentity,
                      fields: dict[str, Any]) -> tuple[str, str] | None:
    """The first mismatch between our identity and an authenticated peer's claims
    (theirs != ours), as ``(code, reason)``: the code goes into the ERROR frame so the
    other side can act on the kind of refusal without parsing the text."""
    if fields["job_id"] != me.job_id:
        return "job_id", f"job id {_short(fields['job_id'])} != {me.job_id!r}"
    if fields["world_size"] != me.world_size:
        return "world_size", f"world size {fields['world_size']} != {me.world_size}"
    rank = fields["rank"]
    if not 0 <= rank < me.world_size:
        return "rank_range", f"rank {rank} is outside 0..{me.world_size - 1}"
    return None


def _error_frame(reason: str, code: str | None,
                 sender: HandshakeIdentity | None = None) -> bytes:
    """An ERROR frame. ``sender`` (our rank and role) is added only for a peer that has
    proven the token: a refusal to anyone else depends on nothing but its reason."""
    fields: dict[str, Any] = {"reason": reason}
    if code is not None:
        fields["code"] = code
    if sender is not None:
        fields["rank"] = sender.rank
        fields["role"] = sender.role
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

    def _params(self, client: dict[str, Any], server: dict[str, Any],
                job_id: str) -> dict[str, Any]:
        """The ``mac_input`` keywords from the client's and server's identity fields
        (``rank``, ``role``, ``nonce``; the client's also ``world_size``)."""
        return dict(version=HANDSHAKE_VERSION, job_id=job_id,
                    world_size=client["world_size"],
                    client_rank=client["rank"], client_role=client["role"],
                    server_rank=server["rank"], server_role=server["role"],
                    client_nonce=client["nonce"], server_nonce=server["nonce"])

    @abc.abstractmethod
    def _ended_from(self) -> str:
        """`` from <peer>`` for the after-the-end message ("" if unknown)."""

    @abc.abstractmethod
    def _reject(self, reason: str, code: str | None = None) -> HandshakeStep:
        """We refuse the peer: tell it why and fail."""

    @abc.abstractmethod
    def _refused(self, frame: ControlFrame) -> HandshakeStep:
        """The peer refused us with an ERROR frame."""

    @abc.abstractmethod
    def _on_frame(self, kind: FrameKind, fields: dict[str, Any]) -> HandshakeStep:
        """A HELLO / CHALLENGE / AUTH / OK frame in the current state."""


class ClientHandshake(_HandshakeSide):
    """The connecting side: HELLO; check CHALLENGE and prove the token in AUTH; verify
    the acceptor's proof in OK.

    ``expect_role`` is the role we meant to reach (``"rank"`` for a peer,
    ``"coordinator"`` for the rendezvous port); ``expect_rank`` the rank we dialled, if
    any; ``peer_label`` (usually ``host:port``) is used in messages only. Both are
    checked on CHALLENGE, before we prove anything, and are authenticated by OK's proof.
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
        self._peer: dict[str, Any] | None = None  # the CHALLENGE's rank, role, nonce
        self._state = "init"  # init -> hello-sent -> auth-sent -> done | failed

    def _peer_desc(self, fields: dict[str, Any] | None = None) -> str:
        for info in (fields, self._peer):
            if info is not None:
                role, rank = info.get("role"), info.get("rank")
                if role in ROLES and type(rank) is int:
                    return _describe(role, rank)
        if self.expect_role == "coordinator":
            return "coordinator"
        return _describe("rank", self.expect_rank)

    def _reject(self, reason: str, code: str | None = None,
                claimed: dict[str, Any] | None = None) -> HandshakeStep:
        """We refuse the peer (described by ``claimed`` fields if given): tell it why and
        fail. Our ERROR carries no identity: the acceptor proves itself only in OK."""
        self._state = "failed"
        error = AuthenticationError(f"{self.me.describe()} rejected "
                                    f"{self._peer_desc(claimed)}{_at(self.peer_label)}: "
                                    f"{reason}", code=code)
        return HandshakeStep(_error_frame(reason, code), True, error, self._peer_rank())

    def _refused(self, frame: ControlFrame) -> HandshakeStep:
        """The peer refused us with an ERROR frame. Refused before CHALLENGE without a
        code, the acceptor probably speaks another handshake version: say which we speak."""
        hint = ""
        code = _peer_code(frame)
        if self._state == "hello-sent" and code is None:
            hint = (f" (the peer may run another netdist version; this side speaks "
                    f"handshake version {HANDSHAKE_VERSION})")
        self._state = "failed"
        error = AuthenticationError(
            f"{self._peer_desc(frame.fields)}{_at(self.peer_label)} refused "
            f"{self.me.describe()}: {_peer_reason(frame)}{hint}", code=code)
        return HandshakeStep(None, True, error, self._peer_rank())

    def initiate(self) -> bytes:
        """The HELLO frame to send first (call once)."""
        if self._state != "init":
            raise LocalProtocolError("ClientHandshake.initiate() called twice")
        self._nonce = _fresh_nonce()
        self._state = "hello-sent"
        return encode_control(FrameKind.HELLO,
                              {"version": HANDSHAKE_VERSION, "nonce": self._nonce})

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
            return self._on_ok(fields)
        waiting = "CHALLENGE" if state == "hello-sent" else "OK"
        return self._reject(f"unexpected {kind.name} frame while waiting for {waiting}")

    def _transcript(self, direction: int) -> bytes:
        me, peer = self.me, self._peer
        if peer is None:
            raise LocalProtocolError("ClientHandshake: no CHALLENGE accepted yet (internal "
                                     "state error)")
        client = {"world_size": me.world_size, "rank": me.rank, "role": me.role,
                  "nonce": self._nonce}
        return mac_input(direction, **self._params(client, peer, me.job_id))

    def _on_challenge(self, fields: dict[str, Any]) -> HandshakeStep:
        problem = _check_fields(fields, _CHALLENGE, "CHALLENGE")
        if problem is not None:
            return self._reject(problem[1], code=problem[0], claimed=fields)
        self._peer = {"rank": fields["rank"], "role": fields["role"], "nonce": fields["nonce"]}
        if fields["role"] != self.expect_role:
            return self._reject(f"role {fields['role']!r} != expected {self.expect_role!r}",
                                code="role")
        if self.expect_rank is not None and fields["rank"] != self.expect_rank:
            return self._reject(f"rank {fields['rank']} != expected {self.expect_rank}",
                                code="rank")
        me = self.me
        proof = compute_proof(me.key, self._transcript(PROOF_BY_CONNECTOR))
        self._state = "auth-sent"
        return HandshakeStep(encode_control(FrameKind.AUTH, {
            "job_id": me.job_id, "rank": me.rank, "world_size": me.world_size,
            "role": me.role, "proof": proof,
        }), False, None, fields["rank"])

    def _on_ok(self, fields: dict[str, Any]) -> HandshakeStep:
        problem = _check_fields(fields, _OK, "OK")
        if problem is not None:
            return self._reject(problem[1], code=problem[0])
        expected = compute_proof(self.me.key, self._transcript(PROOF_BY_ACCEPTOR))
        if not hmac.compare_digest(expected, fields["proof"]):
            return self._reject(TOKEN_MISMATCH, code="token")
        self._state = "done"
        return HandshakeStep(None, True, None, self._peer_rank())


class ServerHandshake(_HandshakeSide):
    """The accepting side: answer HELLO with a CHALLENGE nonce, verify AUTH's proof, then
    check the now authenticated identity and prove the token in OK.

    Until AUTH's proof verifies, nothing we send depends on the token or on our job,
    and every refusal is a fixed text (``TOKEN_MISMATCH`` for a wrong proof).
    ``accept_rank(rank)`` is asked, only after the peer has proven the token and its
    identity matched, whether the rank may connect; it returns ``None`` to accept or a
    reason to refuse (e.g. ``"duplicate connection from rank 3"``). ``peer_label``
    (usually the peer's ``host:port``) is used in messages only.
    """

    def __init__(self, me: HandshakeIdentity, *, peer_label: str = "",
                 accept_rank: Callable[[int], str | None] | None = None) -> None:
        self.me = me
        self.peer_label = peer_label
        self.accept_rank = accept_rank
        self._nonce = b""
        self._client_nonce = b""
        self._peer: dict[str, Any] | None = None  # the AUTH's claims, plus the nonce
        self._authenticated = False
        self._state = "wait-hello"  # wait-hello -> wait-auth -> done | failed

    @property
    def claimed_rank(self) -> int | None:
        """The rank the connecting side put in its AUTH frame (``None`` before a
        well-formed AUTH arrived). Unproven unless the handshake succeeded: anyone can
        claim any rank in 0..2**32-1, so use it for diagnostics only (the coordinator
        tells which rank a refused connection claimed to be, see
        the coordinator's ``RefusalRecord`` in the admission module)."""
        return self._peer_rank()

    def _reject(self, reason: str, code: str | None = None) -> HandshakeStep:
        """We refuse the peer: tell it why (naming us only if it proved the token)."""
        self._state = "failed"
        src = f" from {self.peer_label}" if self.peer_label else ""
        error = AuthenticationError(f"{self.me.describe()} rejected connection{src}: {reason}",
                                    code=code)
        sender = self.me if self._authenticated else None
        return HandshakeStep(_error_frame(reason, code, sender), True, error,
                             self._peer_rank())

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
        problem = _check_fields(fields, _HELLO, "HELLO")
        if problem is not None:
            return self._reject(problem[1], code=problem[0])
        me = self.me
        self._client_nonce = fields["nonce"]
        self._nonce = _fresh_nonce()
        self._state = "wait-auth"
        return HandshakeStep(encode_control(FrameKind.CHALLENGE, {
            "version": HANDSHAKE_VERSION, "rank": me.rank, "role": me.role,
            "nonce": self._nonce,
        }), False, None, None)

    def _transcript(self, direction: int) -> bytes:
        me, peer = self.me, self._peer
        if peer is None:
            raise LocalProtocolError("ServerHandshake: no AUTH received yet (internal "
                                     "state error)")
        server = {"rank": me.rank, "role": me.role, "nonce": self._nonce}
        return mac_input(direction, **self._params(peer, server, peer["job_id"]))

    def _on_auth(self, fields: dict[str, Any]) -> HandshakeStep:
        problem = _check_fields(fields, _AUTH, "AUTH")
        if problem is not None:
            return self._reject(problem[1], code=problem[0])
        self._peer = {name: fields[name] for name, _ in _AUTH}
        self._peer["nonce"] = self._client_nonce
        me = self.me
        expected = compute_proof(me.key, self._transcript(PROOF_BY_CONNECTOR))
        if not hmac.compare_digest(expected, fields["proof"]):
            return self._reject(TOKEN_MISMATCH, code="token")
        self._authenticated = True
        return self._admit(fields)

    def _admit(self, fields: dict[str, Any]) -> HandshakeStep:
        """The peer proved the token: check what it claims, then prove ours in OK."""
        me = self.me
        mismatch = _compare_identity(me, fields)
        if mismatch is not None:
            return self._reject(mismatch[1], code=mismatch[0])
        rank: int = fields["rank"]
        if fields["role"] != "rank":
            return self._reject(f"role {fields['role']!r} != expected 'rank'")
        if me.role == "rank" and rank == me.rank:
            return self._reject(f"rank {rank} is this rank")
        if self.accept_rank is not None:
            veto = self.accept_rank(rank)
            if veto is not None:
                return self._reject(str(veto))
        proof = compute_proof(me.key, self._transcript(PROOF_BY_ACCEPTOR))
        self._state = "done"
        return HandshakeStep(encode_control(FrameKind.OK, {"proof": proof}), True, None, rank)
