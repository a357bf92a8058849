"""Rendezvous: rank 0 hosts a coordinator; every rank registers and gets the address table.

The coordinator listens at ``config.coordinator`` (port 0 binds a free port and reports
it). Each rank connects (retrying until ``connect_timeout``, since rank 0 may start
later), authenticates with the same HMAC handshake as peer connections (the coordinator
speaks with role ``"coordinator"``), then exchanges control frames whose headers are
msgpack maps::

    rank -> coordinator   HELLO {op: "clock"}                    (CLOCK_SAMPLES times, each
    coordinator -> rank   OK    {op: "clock", t: monotonic ns}    answered before the next)
    rank -> coordinator   HELLO {op: "register", rank, world_size, host, port, host_key}
    coordinator -> rank   OK    {op: "table", addresses: [[host, port, host_key], ...]}
                                                                    (rank order)
                    or    ERROR {reason, code, missing}
                          code: "duplicate_rank" | "world_size" | "timeout" | "bad_request"

``host_key`` (optional, 32 hex digits; ``netdist.transport.host_identity.host_key``)
tells which ranks share a host and can share memory, so groups know it without another
exchange.
The table goes out once every rank has registered. A duplicate rank or a world-size
mismatch is refused (``RendezvousError`` on the offender, the job continues to wait for
the right process); ranks that never arrive make every registered rank raise
``RendezvousTimeoutError`` naming the missing ranks. Strangers and garbage on the port
are logged and dropped without disturbing the rendezvous.

Failures say what to do. The coordinator keeps a bounded record of the handshakes it
refused (``RefusalRecord``: per claimed rank, a count and the last reason and address),
so its timeout names the connections it refused and why ("refused 1 connection claiming
rank 1 from 127.0.0.1:5555: bad token (check that NETDIST_TOKEN is the same on every
rank)"). A rank still retrying the coordinator after ``RETRY_NOTICE_SECONDS`` (at most
half its join timeout) logs one warning naming the address it tries, for how much longer,
and the variables to check; its final ``ConnectError`` says the same.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from netdist.config import DistributedConfig, WireLimits
from netdist.errors import (
    AuthenticationError,
    ConnectError,
    NetdistError,
    NetdistTimeoutError,
    RendezvousError,
    RendezvousTimeoutError,
)
from netdist.trace.clock import CLOCK_SAMPLES, ClockAlignment, estimate_alignment
from netdist.transport.admission import AdmissionControl, RefusalRecord, Release
from netdist.transport.connection import (
    RETRY_FIRST_PAUSE,
    FrameConnection,
    close_listener,
    listen,
    open_connection,
    retry_pause,
    run_handshake,
    stop_accepting,
)
from netdist.transport.os_errors import Stage, map_os_errors
from netdist.wire import (
    ClientHandshake,
    ControlFrame,
    FrameKind,
    HandshakeIdentity,
    ServerHandshake,
    encode_control,
)

__all__ = ["PeerAddress", "Coordinator", "RendezvousClient", "rendezvous_identity",
           "RETRY_NOTICE_SECONDS", "COORDINATOR_ADVICE"]

logger = logging.getLogger("netdist.transport")

_TABLE_GRACE = 2.0
_MAX_CLOCK_PINGS = 4 * CLOCK_SAMPLES
"""Clock requests a coordinator answers per connection (a rank makes ``CLOCK_SAMPLES``)."""
"""Extra seconds a rank waits for the table beyond connect_timeout, so the coordinator's
own timeout report (which names the missing ranks) arrives first."""

RETRY_NOTICE_SECONDS = 5.0
"""A rank that has not reached the coordinator after this long (or after half its join
timeout, if that is sooner) logs one warning saying what it is waiting for: silence until
the timeout looked like a hang."""

COORDINATOR_ADVICE = ("check that rank 0 is running and that NETDIST_COORDINATOR (or "
                      "MASTER_ADDR / MASTER_PORT) is its address")
"""What to check when a rank cannot reach the coordinator."""

_REFUSAL_ADVICE: dict[str, tuple[str, str]] = {
    "token": ("bad token", "check that NETDIST_TOKEN is the same on every rank"),
    "job_id": ("another job id", "check that NETDIST_JOB_ID is the same on every rank"),
    "world_size": ("another world size", "check that NETDIST_WORLD_SIZE (or WORLD_SIZE) "
                   "is the same on every rank"),
    "rank_range": ("a rank outside the job", "check NETDIST_RANK (or RANK): ranks are 0 to "
                   "the world size - 1"),
    "version": ("another handshake version", "run the same netdist version on every rank"),
}
"""Per handshake refusal code: what the refusal means in a few words, and what to check."""


@dataclass(frozen=True, slots=True)
class PeerAddress:
    """Where a rank's peer listener can be reached."""

    host: str
    port: int
    host_key: bytes = b""
    """Which ranks share a host (equal keys; empty if the rank did not say)."""

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def rendezvous_identity(config: DistributedConfig, role: str = "rank") -> HandshakeIdentity:
    """The handshake identity of this process (``role`` "coordinator" for rank 0's server)."""
    rank = 0 if role == "coordinator" else config.rank
    return HandshakeIdentity(config.job_id, rank, config.world_size, config.token, role=role)


@dataclass(slots=True)
class _Registration:
    address: PeerAddress
    conn: FrameConnection


class Coordinator:
    """Rank 0's rendezvous server. Start with ``await Coordinator.start(config)``.

    ``address`` is the bound ``(host, port)``; ``wait_finished`` waits until the table
    was sent to everyone (or the rendezvous failed); ``aclose`` is idempotent.
    """

    def __init__(self, config: DistributedConfig,
                 admission: AdmissionControl | None = None) -> None:
        self.config = config
        self.admission = (AdmissionControl(config.admission, owner="the coordinator",
                                           expected=config.world_size)
                          if admission is None else admission)
        """Bounds connections that have not authenticated (shared with rank 0's listener
        when ``TcpTransport`` starts the coordinator)."""
        self._identity = rendezvous_identity(config, "coordinator")
        self.refusals = RefusalRecord(config.world_size)
        """Handshakes refused so far (wrong token, job id, world size...), bounded; the
        timeout report names them."""
        self._loop = asyncio.get_running_loop()
        self._server: asyncio.Server | None = None
        self.address: tuple[str, int] = config.coordinator
        self._registered: dict[int, _Registration] = {}
        self._conns: set[FrameConnection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._deadline = self._loop.time() + config.join_timeout
        self._finished: asyncio.Future[None] = self._loop.create_future()
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False

    @classmethod
    async def start(cls, config: DistributedConfig, *,
                    admission: AdmissionControl | None = None) -> Coordinator:
        """Bind the coordinator port and start accepting registrations.

        Strangers are bounded by ``admission`` (default: one built from
        ``config.admission``), so the process hosting the coordinator shares one bound.
        """
        self = cls(config, admission)
        host, port = config.coordinator
        self._server, self.address = await listen(
            host, port, self.admission.protocol_factory(self._new_connection),
            token=config.token, insecure=config.insecure,
            what=f"the coordinator at {host}:{port}", fallback_to_all=port != 0)
        self._timer = self._loop.call_at(self._deadline, self._on_timeout)
        return self

    @property
    def finished(self) -> bool:
        """True once the table went out or the rendezvous failed."""
        return self._finished.done()

    @property
    def registered(self) -> tuple[int, ...]:
        """Ranks registered so far (sorted), for diagnostics."""
        return tuple(sorted(self._registered))

    async def wait_finished(self, timeout: float) -> None:
        """Wait (bounded) until every rank got the table or the rendezvous failed."""
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._finished)
        except TimeoutError:
            pass

    # -- connections -------------------------------------------------------------------

    def _new_connection(self, release: Release) -> FrameConnection:
        """An admitted connection (``release`` frees its admission slot)."""
        return FrameConnection(
            _rendezvous_limits(self.config), label="?", on_made=self._on_made,
            on_failed=self._on_failed, release=release,
            handshake_header_bytes=self.config.admission.handshake_header_bytes)

    def _on_made(self, conn: FrameConnection) -> None:
        if self._closed:
            conn.close(send_bye=False)
            return
        self._conns.add(conn)
        task = self._loop.create_task(self._serve(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_failed(self, conn: FrameConnection) -> None:
        if self.finished:
            return
        for rank, reg in list(self._registered.items()):
            if reg.conn is conn:
                logger.warning("netdist coordinator: rank %d (%s) left before the table was "
                               "complete: %s", rank, reg.address, conn.failure_reason)
                del self._registered[rank]

    async def _serve(self, conn: FrameConnection) -> None:
        where = conn.peername()
        handshake = ServerHandshake(self._identity, peer_label=where)
        try:
            # an OS error here is a lost connection like any other (os_errors names it)
            with map_os_errors(f"coordinator serving {where}", where, Stage.STREAM):
                step = await run_handshake(
                    conn, handshake, deadline=self.admission.handshake_deadline(
                        self._loop.time(), self.config.join_timeout),
                    what=f"coordinator handshake with {where}")
                rank = step.peer_rank
                conn.label = f"rank {rank} at {where}"
                frame = await conn.next_control(self._deadline + _TABLE_GRACE,
                                                f"registration from rank {rank}")
                pings = 0
                while _is_clock_request(frame) and pings < _MAX_CLOCK_PINGS:
                    pings += 1
                    conn.write_control(encode_control(FrameKind.OK, {
                        "op": "clock", "t": time.monotonic_ns()}))
                    frame = await conn.next_control(self._deadline + _TABLE_GRACE,
                                                    f"registration from rank {rank}")
                self._register(conn, rank, frame)
                # keep reading until the table goes out, so a rank that dies meanwhile is
                # noticed (and may be replaced by a restarted process)
                while not conn.failed and not self.finished:
                    frame = await conn.next_control(self._deadline + _TABLE_GRACE,
                                                    f"rank {rank} after registering")
                    self._refuse(conn, "bad_request",
                                 f"unexpected {frame.kind.name} frame after registration")
        except NetdistError as exc:
            if isinstance(exc, AuthenticationError) and not conn.authenticated:
                self._record_refusal(where, exc, handshake.claimed_rank)
            if not conn.authenticated:  # a stranger: rate-limited, a flood is no log flood
                self.admission.log.warning(
                    "netdist coordinator: dropped connection from %s: %s", where, exc)
            elif not conn.failed or not self.finished:
                logger.warning("netdist coordinator: dropped connection from %s: %s",
                               where, exc)
            conn.close(send_bye=False, reason=f"dropped: {exc}")
        except asyncio.CancelledError:
            conn.close(send_bye=False)
            raise
        finally:
            if conn.failed:  # closed: keep no reference, strangers must not accumulate
                self._conns.discard(conn)

    def _record_refusal(self, where: str, exc: AuthenticationError,
                        claimed_rank: int | None) -> None:
        """Remember a handshake this coordinator refused for a reason a user can fix
        (``_REFUSAL_ADVICE``), for the timeout report; bounded (``RefusalRecord``).

        Only refusals of a connection that sent its AUTH frame (``claimed_rank`` known)
        count: after AUTH the coordinator either refuses or admits, so the code is its
        own verdict (wrong token, job id, world size), never one a stranger's ERROR frame
        made up.
        """
        advice = _REFUSAL_ADVICE.get(exc.code or "")
        if advice is not None and claimed_rank is not None:
            self.refusals.add(where, f"{advice[0]} ({advice[1]})", claimed_rank)

    def _refuse(self, conn: FrameConnection, code: str, reason: str,
                missing: list[int] | None = None) -> None:
        logger.warning("netdist coordinator: refused %s: %s", conn.label, reason)
        conn.write_control(encode_control(FrameKind.ERROR, {
            "reason": reason, "code": code, "missing": missing or []}))
        conn.close(send_bye=False, reason=reason)

    def _register(self, conn: FrameConnection, rank: int, frame: ControlFrame) -> None:
        fields = frame.fields
        if (frame.kind != FrameKind.HELLO or fields.get("op") != "register"
                or type(fields.get("host")) is not str or type(fields.get("port")) is not int
                or not 0 < fields["port"] < 65536):
            self._refuse(conn, "bad_request", f"expected a register request from rank {rank}, "
                         f"got {frame.kind.name} {sorted(fields)}")
            return
        if fields.get("rank") != rank or fields.get("world_size") != self.config.world_size:
            self._refuse(conn, "world_size",
                         f"rank {fields.get('rank')!r} registered with world size "
                         f"{fields.get('world_size')!r}, the coordinator expects "
                         f"{self.config.world_size}")
            return
        if self.finished:
            self._refuse(conn, "bad_request", "the rendezvous is already over")
            return
        previous = self._registered.get(rank)
        if previous is not None:
            self._refuse(conn, "duplicate_rank",
                         f"rank {rank} is already registered (from {previous.conn.peername()},"
                         f" listening at {previous.address}); this process at "
                         f"{conn.peername()} has a duplicate rank")
            return
        self._registered[rank] = _Registration(
            PeerAddress(fields["host"], fields["port"], _host_key(fields.get("host_key"))),
            conn)
        if len(self._registered) == self.config.world_size:
            self._publish()

    def _publish(self) -> None:
        table = [[entry.host, entry.port, entry.host_key.hex()]
                 for entry in (self._registered[r].address
                               for r in range(self.config.world_size))]
        frame = encode_control(FrameKind.OK, {"op": "table", "addresses": table},
                               limits=_rendezvous_limits(self.config))
        self._finish()
        for reg in list(self._registered.values()):
            reg.conn.write_control(frame)
            reg.conn.close(send_bye=False, reason="rendezvous complete")

    def _on_timeout(self) -> None:
        self._timer = None
        if self.finished:
            return
        missing = [r for r in range(self.config.world_size) if r not in self._registered]
        reason = (f"rendezvous timed out after {self.config.join_timeout:.1f}s: "
                  f"rank{'s' if len(missing) != 1 else ''} "
                  f"{', '.join(map(str, missing))} never arrived "
                  f"({len(self._registered)} of {self.config.world_size} registered)"
                  f"{self._advice(missing)}")
        logger.warning("netdist coordinator: %s", reason)
        self._finish()
        for reg in list(self._registered.values()):
            self._refuse(reg.conn, "timeout", reason, missing)

    def _advice(self, missing: list[int]) -> str:
        """What the timeout report adds after naming the ``missing`` ranks: the
        connections refused (and why), then what to check for ranks never seen at all."""
        parts = []
        refused = self.refusals.describe(missing)
        if refused:
            parts.append(f"the coordinator {refused}")
        unseen = [rank for rank in missing if self.refusals.get(rank) is None]
        if unseen:
            one = len(unseen) == 1
            names = ", ".join(map(str, unseen[:4])) + (
                f" and {len(unseen) - 4} more" if len(unseen) > 4 else "")
            who = f"rank {names} was" if one else f"ranks {names} were"
            parts.append(f"check that {who} started and that {'its' if one else 'their'} "
                         f"NETDIST_COORDINATOR (or MASTER_ADDR / MASTER_PORT) points at "
                         f"this coordinator ({PeerAddress(*self.address)}), with the same "
                         f"NETDIST_WORLD_SIZE")
        return "".join(f"; {part}" for part in parts)

    def _finish(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._finished.done():
            self._finished.set_result(None)

    async def aclose(self) -> None:
        """Stop listening, drop connections, cancel and await the coordinator's tasks."""
        if not self._closed:
            self._closed = True
            self._finish()
            if self._server is not None:
                stop_accepting(self._server)
            for conn in list(self._conns):
                conn.close(send_bye=False, reason="coordinator closed")
            for task in list(self._tasks):
                task.cancel()
        tasks = list(self._tasks)
        conns = list(self._conns)

        server = self._server

        async def finish() -> None:
            if server is not None:
                await close_listener(server)
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            for conn in conns:
                await conn.wait_closed(1.0)

        await asyncio.shield(finish())


def _rendezvous_limits(config: DistributedConfig) -> WireLimits:
    """Limits on rendezvous connections: the table grows with the world size."""
    limits = config.limits
    need = 1024 + 300 * config.world_size
    if need <= limits.max_header_bytes:
        return limits
    return dataclasses.replace(limits, max_header_bytes=need)


class RendezvousClient:
    """A rank's authenticated connection to the coordinator (see the module docstring)."""

    def __init__(self, config: DistributedConfig, conn: FrameConnection) -> None:
        self.config = config
        self._conn = conn

    @classmethod
    async def connect(cls, config: DistributedConfig, *, deadline: float,
                      notice_after: float | None = None) -> RendezvousClient:
        """Reach and authenticate with the coordinator, retrying until ``deadline``.

        Still trying after ``notice_after`` seconds (default ``RETRY_NOTICE_SECONDS``, or
        half the join timeout if that is sooner; tests pass 0), it logs one warning on
        the ``netdist.transport`` logger: the address it tries, for how much longer, and
        what to check, so a rank whose rank 0 is not running does not look hung.

        Raises ``ConnectError`` (unreachable), ``AuthenticationError`` (refused),
        ``RendezvousError`` (world-size mismatch) or ``NetdistTimeoutError``; the
        messages of the first three end with what to check.
        """
        loop = asyncio.get_running_loop()
        started = loop.time()
        if notice_after is None:
            notice_after = min(RETRY_NOTICE_SECONDS, config.join_timeout / 2)
        notice = loop.call_at(started + notice_after, _still_trying, config, loop,
                              started, deadline)
        try:
            return await cls._connect(config, deadline)
        except AuthenticationError as exc:
            advice = _REFUSAL_ADVICE.get(exc.code or "")
            if advice is None:
                raise
            raise AuthenticationError(f"{exc} ({advice[1]})", code=exc.code) from exc
        except ConnectError as exc:
            # the cause stays the last OS error, as for every ConnectError of a connect
            raise ConnectError(
                f"{exc}; tried for {loop.time() - started:.1f}s "
                f"({_timeout_variable(config)}): {COORDINATOR_ADVICE}"
            ) from (exc.__cause__ or exc)
        finally:
            notice.cancel()

    @classmethod
    async def _connect(cls, config: DistributedConfig, deadline: float) -> RendezvousClient:
        """``connect`` without the notice and the advice."""
        host, port = config.coordinator
        where = f"{host}:{port}"
        label = f"coordinator at {where}"
        ident = rendezvous_identity(config)
        pause: float | None = RETRY_FIRST_PAUSE
        while True:
            conn = await open_connection(
                host, port, lambda: FrameConnection(
                    _rendezvous_limits(config), label=label,
                    handshake_header_bytes=config.admission.handshake_header_bytes),
                deadline=deadline, retry=True,
                what=f"rank {config.rank} reaching the coordinator")
            handshake = ClientHandshake(ident, expect_role="coordinator", peer_label=where)
            try:
                await run_handshake(conn, handshake, deadline=deadline,
                                    what=f"handshake with the {label}",
                                    first=handshake.initiate())
            except AuthenticationError as exc:
                conn.close(send_bye=False)
                await conn.wait_closed(1.0)
                if exc.code in ("world_size", "rank_range"):
                    raise RendezvousError(f"{exc} ({_REFUSAL_ADVICE[exc.code][1]})") from exc
                raise
            except ConnectError:
                # dropped mid-handshake (the coordinator may be restarting, or at its bound
                # on unauthenticated connections): back off, then try again
                conn.close(send_bye=False)
                await conn.wait_closed(1.0)
                pause = await retry_pause(pause, deadline)
                if pause is None:
                    raise
                continue
            except BaseException:
                conn.close(send_bye=False)
                await conn.wait_closed(1.0)
                raise
            return cls(config, conn)

    @property
    def local_host(self) -> str:
        """Our address on the socket that reached the coordinator (the default advertise)."""
        local = self._conn.sockname()
        return "127.0.0.1" if local is None else local[0]

    async def align_clock(self, samples: int = CLOCK_SAMPLES) -> ClockAlignment:
        """Measure this rank's clock against the coordinator's (``netdist.trace.clock``):
        ``samples`` ping-pongs before registering, the shortest round trip counts."""
        conn = self._conn
        loop = asyncio.get_running_loop()
        measured = []
        for _ in range(samples):
            sent = time.monotonic_ns()
            conn.write_control(encode_control(FrameKind.HELLO, {"op": "clock"}))
            frame = await conn.next_control(loop.time() + self.config.join_timeout,
                                            f"rank {self.config.rank} aligning its clock")
            received = time.monotonic_ns()
            answer = frame.fields.get("t")
            if frame.kind != FrameKind.OK or frame.fields.get("op") != "clock" \
                    or type(answer) is not int:
                raise RendezvousError(
                    f"rank {self.config.rank}: malformed clock answer from the "
                    f"{conn.label}: {frame.kind.name} {sorted(frame.fields)}")
            measured.append((sent, answer, received))
        return estimate_alignment(measured, reference_rank=0)

    async def register(self, address: PeerAddress) -> tuple[PeerAddress, ...]:
        """Register this rank's listen address; wait for the whole table (rank order)."""
        config = self.config
        conn = self._conn
        conn.write_control(encode_control(FrameKind.HELLO, {
            "op": "register", "rank": config.rank, "world_size": config.world_size,
            "host": address.host, "port": address.port, "host_key": address.host_key.hex()}))
        loop = asyncio.get_running_loop()
        try:
            frame = await conn.next_control(
                loop.time() + config.join_timeout + _TABLE_GRACE,
                f"rank {config.rank} waiting for the rendezvous table")
        except NetdistTimeoutError:
            raise RendezvousTimeoutError(
                f"rank {config.rank}: the rendezvous at {conn.label} did not complete within "
                f"{config.join_timeout:.1f}s (not every rank arrived)") from None
        fields = frame.fields
        if frame.kind == FrameKind.ERROR:
            reason = str(fields.get("reason", "no reason given"))
            code = fields.get("code")
            if code == "timeout":
                missing = tuple(r for r in fields.get("missing", ()) if type(r) is int)
                raise RendezvousTimeoutError(f"rank {config.rank}: {reason}", missing)
            raise RendezvousError(f"rank {config.rank} was refused by the {conn.label}: "
                                  f"{reason}")
        table = fields.get("addresses")
        if (frame.kind != FrameKind.OK or fields.get("op") != "table"
                or not isinstance(table, list) or len(table) != config.world_size
                or not all(_valid_entry(entry) for entry in table)):
            raise RendezvousError(f"rank {config.rank}: malformed rendezvous table from the "
                                  f"{conn.label}: {frame.kind.name} {sorted(fields)}")
        return tuple(PeerAddress(entry[0], entry[1],
                                 _host_key(entry[2] if len(entry) > 2 else None))
                     for entry in table)

    async def aclose(self) -> None:
        """Close the coordinator connection (bounded wait)."""
        self._conn.close(send_bye=False, reason="rendezvous finished")
        await self._conn.wait_closed(1.0)


def _is_clock_request(frame: ControlFrame) -> bool:
    return frame.kind == FrameKind.HELLO and frame.fields.get("op") == "clock"


def _timeout_variable(config: DistributedConfig) -> str:
    """The environment variable that sets ``config.join_timeout``."""
    return "NETDIST_CONNECT_TIMEOUT" if config.connect_timeout is not None else "NETDIST_TIMEOUT"


def _still_trying(config: DistributedConfig, loop: asyncio.AbstractEventLoop,
                  started: float, deadline: float) -> None:
    """The one warning of a rank that has not reached the coordinator yet."""
    host, port = config.coordinator
    now = loop.time()
    logger.warning(
        "netdist: rank %d is still trying to reach the coordinator at %s (for %.1fs now); "
        "it keeps trying for %.1fs more (the join timeout is %.1fs, %s): %s",
        config.rank, PeerAddress(host, port), now - started, max(deadline - now, 0.0),
        config.join_timeout, _timeout_variable(config), COORDINATOR_ADVICE)


def _valid_entry(entry: Any) -> bool:
    return (isinstance(entry, (list, tuple)) and len(entry) in (2, 3)
            and type(entry[0]) is str and type(entry[1]) is int and 0 < entry[1] < 65536
            and (len(entry) == 2 or type(entry[2]) is str))


def _host_key(value: Any) -> bytes:
    """A registered host key: 32 hex digits, else empty (unknown: no shared memory)."""
    if type(value) is not str or len(value) != 32:
        return b""
    try:
        return bytes.fromhex(value)
    except ValueError:
        return b""


OnCoordinatorReady = Callable[[tuple[str, int]], None]
"""Called by rank 0 with the coordinator's bound address (port 0 resolves here)."""
