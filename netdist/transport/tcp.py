"""``TcpTransport``: at most one authenticated TCP connection per pair of ranks.

Start-up (``TcpTransport.connect(config)``):

1. rank 0 starts the rendezvous coordinator (``netdist.transport.rendezvous``);
2. every rank reaches the coordinator, binds its peer listener on the address the
   coordinator sees it at (or ``listen_host`` / ``advertise_addr``), registers it and
   receives the address table -- only once every rank has registered, so a missing
   rank is still reported at start-up (``RendezvousTimeoutError`` naming it);
3. connections (``config.connect``):

   - ``ConnectMode.LAZY`` (default): none yet. A rank connects to a peer the first time
     it sends to it or posts a receive from it, so it holds only the connections its
     algorithms use (a ring all-reduce: its two neighbours; a parameter-server worker:
     the server) and start-up costs O(n), not O(n^2) handshakes. Either side may
     connect; when both do at once, the connection the lower rank initiated survives
     (``netdist.transport.links``), and senders waiting for a connection keep their
     call order. A peer that cannot be reached on first use -- its port refuses the
     connection (nothing listens: it is gone), or it does not complete the handshake
     within a liveness window -- fails every operation on it with ``PeerLostError``, as a
     lost connection does. A rank that leaves tells its reason (BYE, or the ERROR naming
     whom to blame) to the peers connected to it; one that first connects after it left
     learns only that it is gone (``origin_rank`` is then the departed rank itself);
   - ``ConnectMode.EAGER``: the higher rank of every pair connects to the lower one
     before ``connect`` returns (n(n-1)/2 connections).

   Both sides run the HMAC handshake; duplicates and strangers are refused (strangers
   are logged and dropped, the job is undisturbed). Strangers are bounded
   (``netdist.transport.admission``): at most ``AdmissionLimits.max_unauthenticated``
   mid-handshake per process, each with a small read buffer and ``handshake_timeout``
   to authenticate, none while descriptors run short; a rank refused that way retries
   until the join timeout;
4. a monitor task sends HEARTBEAT frames on idle connections and declares a peer lost
   after ``heartbeat_interval * heartbeat_misses`` of silence -- measured only over time
   our own event loop was responsive, so a long NumPy computation here never makes a
   healthy peer look dead. On a link that is losing packets while the peer's kernel
   still acknowledges, the window stretches (``netdist.transport.link_stats``): TCP's
   retransmission back-off can hold a live peer's frames longer than the plain window.

Data path: see ``netdist.transport.connection`` (zero-copy receive into ``out=``
through ``asyncio.BufferedProtocol``; sends return once the array's memory is free).

Failure semantics: every wait is bounded (per-call ``timeout``, default
``config.timeout``; a connection made on first use within ``config.join_timeout``); a
lost or unreachable peer fails every pending and later operation on it with
``PeerLostError`` naming it and saying why; ``aclose()`` sends BYE, so peers report
"rank N closed its transport (left the job)", is idempotent and completes under
cancellation. A rank that closes after losing a peer, or aborts (``abort(error)``,
or leaving ``async with`` on an exception), sends an ERROR frame instead that names
the rank which went away first, so every rank blames the same one
(``PeerLostError.origin_rank``; see ``netdist.transport.blame``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from time import monotonic_ns
from typing import Any

import numpy as np

from netdist.config import ConnectMode, DistributedConfig
from netdist.errors import (
    AuthenticationError,
    ConnectError,
    LocalProtocolError,
    NetdistError,
    NetdistTimeoutError,
    PeerLostError,
    TransportClosedError,
    UndeliveredError,
)
from netdist.trace.metrics_server import MetricsServer, start_metrics_from_env
from netdist.trace.signals import install_dump_signal
from netdist.trace.straggler_monitor import StragglerMonitor, start_straggler_monitor
from netdist.trace.tracer import KIND_RECV, KIND_SEND
from netdist.transport.admission import AdmissionControl, Release, raise_nofile_limit
from netdist.transport.dissemination import dissemination_barrier
from netdist.transport.blame import (
    Departure,
    LossOrigin,
    describe_failure,
    farewell_fields,
    one_line,
)
from netdist.transport.base import MAX_TAG, Transport
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
from netdist.transport.links import (
    REFUSED_GRACE,
    PeerLinks,
    is_tie_refusal,
    tie_refusal,
    unreachable_reason,
)
from netdist.transport.host_identity import host_key
from netdist.transport.mailbox import PeerMailbox
from netdist.transport.os_errors import Stage, map_os_errors
from netdist.transport.spin import SpinPolicy, default_spin_seconds, ranks_sharing_host
from netdist.transport.traffic import PeerTraffic, Traffic
from netdist.transport.rendezvous import (
    Coordinator,
    OnCoordinatorReady,
    PeerAddress,
    RendezvousClient,
    rendezvous_identity,
)
from netdist.wire import ClientHandshake, FrameKind, ServerHandshake, encode_control, encode_data

__all__ = ["TcpTransport"]

logger = logging.getLogger("netdist.transport")

_HEARTBEAT = encode_control(FrameKind.HEARTBEAT)
_CLOSE_WAIT = 2.0
"""Seconds ``aclose`` gives a connection still mid-handshake before aborting it."""


class TcpTransport(Transport):
    """The TCP implementation of ``Transport``; build one with ``await connect(config)``.

    Also usable as ``async with await TcpTransport.connect(config) as transport:``, or
    through ``netdist.init()``.
    """

    def __init__(self, config: DistributedConfig) -> None:
        """An unconnected transport; ``connect()`` is the public constructor."""
        self.config = config
        self.rank = config.rank
        self.world_size = config.world_size
        self.timeout = config.timeout
        self._limits = config.limits
        self._loop = asyncio.get_running_loop()
        self._identity = rendezvous_identity(config)
        self.admission = AdmissionControl(config.admission, owner=f"rank {config.rank}",
                                          expected=config.world_size)
        """Bounds connections that have not authenticated (this rank's listener and, on
        rank 0, the coordinator); its ``stats()`` count pending and refused strangers."""
        self.spin = SpinPolicy()
        """Busy-poll budget of small receives; set from ``config.spin_us`` on connect."""
        self._mailboxes: list[PeerMailbox | None] = [
            None if peer == self.rank else PeerMailbox(peer, self._loop, self.spin)
            for peer in range(self.world_size)]
        self._connections: list[FrameConnection | None] = [None] * self.world_size
        """Per peer, the one connection adopted (kept once failed: a lost peer stays lost)."""
        self._eager = config.connect is ConnectMode.EAGER
        self._links = PeerLinks(self._loop)
        """Connections on first use (lazy mode): dials, unreachable peers, waiting senders."""
        self._handshaking: set[FrameConnection] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._server: asyncio.Server | None = None
        self._coordinator: Coordinator | None = None
        self.listen_address: tuple[str, int] | None = None
        """Where this rank's peer listener is bound (None for world size 1)."""
        self.peer_addresses: tuple[PeerAddress, ...] = ()
        """The rendezvous table, rank order."""
        self._accepted = asyncio.Event()
        self._closed = False
        self._close_task: asyncio.Task[None] | None = None
        self._undelivered: dict[int, int] = {}
        """Per peer, the bytes a close could not deliver (see ``aclose``)."""
        self._monitor_task: asyncio.Task[Any] | None = None
        self._metrics: MetricsServer | None = None
        """The Prometheus endpoint (``NETDIST_METRICS_PORT``), if asked for."""
        self._straggler: StragglerMonitor | None = None
        """The live straggler report (``netdist.trace.straggler_monitor``), when on."""
        self._lost: dict[int, tuple[LossOrigin, bool]] = {}
        """Per lost peer, in the order lost: who went away first, and whether that loss
        can explain this rank leaving (not a clean BYE, not a drop decided here)."""
        self._recorder = self._new_recorder()
        install_dump_signal(self._recorder)
        self._silent_peers: set[int] = set()
        """Peers traced as silent beyond two heartbeat intervals (until heard again)."""

    # -- construction --------------------------------------------------------------------

    @classmethod
    async def connect(cls, config: DistributedConfig, *,
                      on_coordinator_ready: OnCoordinatorReady | None = None) -> TcpTransport:
        """Rendezvous with the other ranks (and, with ``connect="eager"``, connect to all).

        Returns once every rank has registered and this rank has the address table
        (lazy, the default: peers are connected on first use), or once a connection to
        every other rank is authenticated (eager). Bounded by ``config.join_timeout``
        per phase (reaching the coordinator, waiting for the table, connecting the
        mesh). Rank 0 calls ``on_coordinator_ready(host, port)``
        once its coordinator is bound (useful with port 0). On failure everything opened
        so far is closed and the error is raised: ``ConnectError`` /
        ``AuthenticationError``, ``RendezvousError``, ``RendezvousTimeoutError``,
        ``NetdistTimeoutError`` or ``ConfigError``.
        """
        self = cls(config)
        try:
            await self._establish(on_coordinator_ready)
            self._metrics = await start_metrics_from_env(self)
        except BaseException:
            await self.aclose()
            raise
        return self

    async def _establish(self, on_coordinator_ready: OnCoordinatorReady | None) -> None:
        config = self.config
        if self.world_size == 1:
            return
        loop = self._loop
        if config.admission.raise_fd_limit:
            raised = raise_nofile_limit()
            if raised is not None:
                logger.debug("netdist: rank %d raised its soft RLIMIT_NOFILE from %d to %d",
                             self.rank, *raised)
        if self.rank == 0:
            self._coordinator = await Coordinator.start(config, admission=self.admission)
            if on_coordinator_ready is not None:
                on_coordinator_ready(self._coordinator.address)
            coordinator_config = config.replace(coordinator=self._coordinator.address)
        else:
            coordinator_config = config
        client = await RendezvousClient.connect(
            coordinator_config, deadline=loop.time() + config.join_timeout)
        try:
            advertise = config.advertise_addr or client.local_host
            listen_host = config.listen_host or advertise
            self._server, self.listen_address = await listen(
                listen_host, 0, self.admission.protocol_factory(self._new_inbound),
                token=config.token,
                insecure=config.insecure, what=f"rank {self.rank}'s peer listener",
                fallback_to_all=config.listen_host is None)
            self._recorder.clock = await client.align_clock()
            table = await client.register(PeerAddress(advertise, self.listen_address[1],
                                                      host_key(config.host_id)))
        finally:
            await client.aclose()
        self.peer_addresses = table
        self.spin.seconds = (default_spin_seconds(
                ranks_sharing_host((entry.host for entry in table), advertise))
                             if config.spin_us is None else config.spin_us * 1e-6)
        if self._coordinator is not None:
            await self._coordinator.wait_finished(config.join_timeout)
            await self._coordinator.aclose()
            self._coordinator = None
        if self._eager:
            await self._connect_mesh(table, loop.time() + config.join_timeout)
        self._monitor_task = self._spawn(self._monitor(), "heartbeat monitor")
        self._straggler = start_straggler_monitor(self)

    async def _connect_mesh(self, table: tuple[PeerAddress, ...], deadline: float) -> None:
        """Connect to every lower rank; wait for every higher rank to connect to us."""
        self._check_all_accepted()
        try:
            async with asyncio.timeout_at(deadline):
                async with asyncio.TaskGroup() as group:
                    for peer in range(self.rank):
                        group.create_task(self._connect_peer(peer, table[peer], deadline))
                    group.create_task(self._accepted.wait())
        except TimeoutError:
            missing = [p for p in range(self.world_size)
                       if p != self.rank and self._connections[p] is None]
            raise NetdistTimeoutError(
                f"rank {self.rank} could not connect to rank{'s' if len(missing) > 1 else ''}"
                f" {', '.join(map(str, missing))} within "
                f"{self.config.join_timeout:.1f}s") from None
        except BaseExceptionGroup as group_error:
            raise _first_error(group_error) from None

    async def _connect_peer(self, peer: int, address: PeerAddress, deadline: float, *,
                            silence: float | None = None,
                            refused_grace: float | None = None) -> None:
        """Connect to ``peer`` and authenticate, retrying a dropped attempt until ``deadline``.

        A connection closed before the handshake finished (not refused by it) is tried
        again after a back-off: the peer may have been at its bound on unauthenticated
        connections (``AdmissionLimits``), which closes new ones at once. For connections
        made on first use, a peer that does not complete the handshake within
        ``silence`` seconds is given up on (stopped or partitioned, as heartbeats would
        say), and so is a port that refuses connections for ``refused_grace`` seconds
        (nothing listens there any more).
        """
        label = f"rank {peer}"
        where = str(address)
        pause: float | None = RETRY_FIRST_PAUSE
        while True:
            if self._connections[peer] is not None:
                return  # (lazy) the peer's own connection to us was adopted meanwhile
            conn = await open_connection(
                address.host, address.port,
                lambda: FrameConnection(
                    self.config.limits, label=label, on_failed=self._on_connection_failed,
                    handshake_header_bytes=self.config.admission.handshake_header_bytes),
                deadline=deadline, retry=True, what=f"rank {self.rank} connecting to {label}",
                refused_grace=refused_grace)
            handshake = ClientHandshake(self._identity, expect_role="rank", expect_rank=peer,
                                        peer_label=where)
            attempt = self._loop.time()
            answer_by = deadline if silence is None else min(deadline, attempt + silence)
            try:
                await run_handshake(conn, handshake, deadline=answer_by,
                                    what=f"handshake with {label} at {where}",
                                    first=handshake.initiate())
                if self._closed:
                    raise TransportClosedError(f"rank {self.rank}: transport is closed")
                if self._connections[peer] is not None:
                    raise AuthenticationError(
                        f"rank {self.rank} is already connected to {label}")
            except BaseException as exc:
                conn.close(send_bye=False, reason="handshake failed")
                await conn.wait_closed(1.0)
                if isinstance(exc, NetdistTimeoutError) and silence is not None:
                    raise NetdistTimeoutError(
                        f"rank {peer} at {where} did not complete the handshake within "
                        f"{answer_by - attempt:.1f}s: presumed dead (stopped, partitioned, or "
                        "computing without a progress thread)") from None
                if type(exc) is ConnectError and not self._closed:
                    pause = await retry_pause(pause, deadline)
                    if pause is not None:
                        continue
                raise
            self._adopt(peer, conn)
            return

    def _new_inbound(self, release: Release) -> FrameConnection:
        """An admitted inbound connection (``release`` frees its admission slot)."""
        return FrameConnection(
            self.config.limits, label="?", on_made=self._on_inbound,
            on_failed=self._on_connection_failed,
            handshake_header_bytes=self.config.admission.handshake_header_bytes,
            release=release)

    def _on_inbound(self, conn: FrameConnection) -> None:
        if self._closed:
            conn.close(send_bye=False, reason="transport closed")
            return
        self._handshaking.add(conn)
        self._spawn(self._serve_handshake(conn), f"handshake with {conn.label}")

    def _accept_reason(self, rank: int) -> str | None:
        """Why an authenticated connection from ``rank`` is refused (None: adopt it)."""
        if self._eager and rank < self.rank:
            return (f"rank {rank} must accept a connection from rank {self.rank}, "
                    "not connect to it")
        if self._connections[rank] is not None:
            return f"duplicate connection from rank {rank} (already connected)"
        if self._closed:
            return f"rank {self.rank} is closing"
        if rank in self._links.unreachable:
            return f"rank {self.rank} has given up on rank {rank} (it could not connect to it)"
        if rank > self.rank and rank in self._links.dials:
            return tie_refusal(self.rank, rank)
        return None

    async def _serve_handshake(self, conn: FrameConnection) -> None:
        where = conn.peername()
        vetoed: list[str] = []

        def accept(rank: int) -> str | None:
            reason = self._accept_reason(rank)
            if reason is not None:
                vetoed.append(reason)
            return reason

        handshake = ServerHandshake(self._identity, peer_label=where, accept_rank=accept)
        try:
            # an OS error here is a lost connection like any other (os_errors names it)
            with map_os_errors(f"handshake with {where}", where, Stage.STREAM):
                step = await run_handshake(
                    conn, handshake, deadline=self.admission.handshake_deadline(
                        self._loop.time(), self.config.join_timeout),
                    what=f"handshake with {where}")
                self._adopt(step.peer_rank, conn)
        except NetdistError as exc:
            if vetoed and not self._eager:
                # a rank of this job that proved the token, refused because the pair is
                # already connected or connecting the other way: an expected race
                logger.debug("netdist: rank %d refused connection from %s: %s",
                             self.rank, where, exc)
            else:
                self.admission.log.warning("netdist: rank %d dropped connection from %s: %s",
                                           self.rank, where, exc)
            conn.close(send_bye=False, reason=f"handshake failed: {exc}")
        except asyncio.CancelledError:
            conn.close(send_bye=False, reason="transport closed")
            raise
        finally:
            self._handshaking.discard(conn)

    def _adopt(self, peer: int, conn: FrameConnection) -> None:
        """A handshake succeeded: ``conn`` carries all traffic with ``peer`` from now on."""
        if conn.failed:
            raise conn.error()
        conn.attach(peer, self._mailboxes[peer], f"rank {peer}")
        self._connections[peer] = conn
        self._links.settle(peer)
        self._recorder.instant("connection", "connect", peer=peer)
        self._check_all_accepted()

    def _check_all_accepted(self) -> None:
        if all(self._connections[p] is not None for p in range(self.rank + 1, self.world_size)):
            self._accepted.set()

    def _on_connection_failed(self, conn: FrameConnection) -> None:
        peer = conn.peer_rank
        if peer is None or self._connections[peer] is not conn or self._closed:
            return
        origin = conn.loss_origin or LossOrigin(peer, one_line(conn.failure_reason), self.rank)
        self._lost.setdefault(peer, (origin, not (conn.peer_said_bye or conn.dropped_locally)))
        self._recorder.instant("connection", "closed" if conn.peer_said_bye else "lost",
                               peer=peer, reason=one_line(conn.failure_reason))
        if conn.peer_said_bye:
            logger.info("netdist: rank %d: %s", self.rank, conn.failure_reason)
        else:
            logger.warning("netdist: rank %d lost rank %d: %s", self.rank, peer,
                           conn.failure_reason)

    # -- connections on first use (lazy mode) --------------------------------------------

    def _ensure_dial(self, peer: int) -> None:
        """Start connecting to ``peer`` unless connected, connecting, given up or closed."""
        links = self._links
        if (self._eager or self._closed or self._connections[peer] is not None
                or peer in links.dials or peer in links.unreachable):
            return
        links.dials[peer] = self._spawn(self._dial(peer), f"connecting to rank {peer}")

    def _link_settled(self, peer: int) -> bool:
        return (self._closed or self._connections[peer] is not None
                or peer in self._links.unreachable)

    async def _dial(self, peer: int) -> None:
        """Connect to ``peer`` on first use; on failure every operation on it fails.

        Bounded by ``config.join_timeout``; a refused connection gives up at once (after
        ``REFUSED_GRACE``) and a silent handshake after one liveness window. Refused
        because ``peer`` (a lower rank) is connecting to us at the same moment, wait for
        its connection, dialling again after a back-off in case its attempt failed.
        """
        loop = self._loop
        config = self.config
        window = config.liveness_window
        deadline = loop.time() + config.join_timeout
        address = self.peer_addresses[peer]
        pause = RETRY_FIRST_PAUSE
        try:
            while True:
                try:
                    await self._connect_peer(peer, address, deadline, silence=window,
                                             refused_grace=min(REFUSED_GRACE, window))
                    return
                except AuthenticationError as exc:
                    if not (is_tie_refusal(exc) and peer < self.rank) or self._link_settled(peer):
                        raise
                # the lower rank's own connection to us wins: wait for it, then try again
                await self._links.wait_settled(peer, min(pause, deadline - loop.time()))
                if self._link_settled(peer):
                    return
                if loop.time() >= deadline:
                    raise NetdistTimeoutError(
                        f"rank {peer} refused this rank's connections for "
                        f"{config.join_timeout:.1f}s because it was connecting itself, and "
                        "its own connection never arrived")
                pause = min(2 * pause, 0.5)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever it was, the peer is unreachable
            if not self._link_settled(peer):
                self._give_up(peer, unreachable_reason(peer, str(address), exc))
        finally:
            self._links.dials.pop(peer, None)

    def _give_up(self, peer: int, reason: str) -> None:
        """``peer`` could not be reached: fail every waiter on it, now and later."""
        rank = self.rank

        def lost() -> Exception:
            return PeerLostError(peer, reason)

        self._links.unreachable[peer] = lost
        self._lost.setdefault(peer, (LossOrigin(peer, one_line(reason), rank), True))
        logger.warning("netdist: rank %d lost rank %d: %s", rank, peer, reason)
        self._recorder.instant("connection", "lost", peer=peer, reason=one_line(reason))
        box = self._mailboxes[peer]
        if box is not None:
            box.fail(lost)
        self._links.settle(peer)

    def _job_name(self) -> str:
        return self.config.job_id

    def lost_peer_error(self, peer: int) -> Exception | None:
        box = self._mailboxes[peer] if 0 <= peer < self.world_size else None
        error = None if box is None else box.failure()
        return error if isinstance(error, PeerLostError) else None

    async def find_lost_peers(self, peers: Sequence[int], *,
                              timeout: float) -> dict[int, Exception]:
        """Known losses at once; in lazy mode, also dial (for at most ``timeout``
        seconds) the listed peers never connected to, as a first use would."""
        pending = [p for p in peers if 0 <= p < self.world_size and p != self.rank
                   and not self._link_settled(p)]
        if pending and not self._eager and timeout > 0:
            for peer in pending:
                self._ensure_dial(peer)
            await asyncio.gather(*(self._links.wait_settled(p, timeout) for p in pending))
        return await super().find_lost_peers(peers, timeout=timeout)

    @property
    def spin_seconds(self) -> float:
        return self.spin.seconds

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the transport was connected on: its sockets, reader tasks and
        heartbeats run there, and so must every coroutine of it or of a ``Group`` over it
        (with ``netdist.connect()``, the progress thread's loop)."""
        return self._loop

    def host_keys(self) -> tuple[bytes, ...] | None:
        """Every rank's host key from the rendezvous table (``None`` if one is missing)."""
        if self.world_size == 1:
            return (host_key(self.config.host_id),)
        keys = tuple(entry.host_key for entry in self.peer_addresses)
        return keys if len(keys) == self.world_size and all(keys) else None

    def traffic(self) -> Traffic:
        """Payload and wire bytes exchanged with every peer so far, and by host.

        Per peer, the counts of the connection that carries its traffic (kept after it
        fails, so a lost peer's counts stay): wire bytes include that connection's
        handshake, heartbeats and goodbye; a duplicate connection refused while both ranks
        dialled at once is not counted. A peer never connected to reads zero. Call it on
        the transport's event loop (``job.transport.traffic()`` does, from any thread).
        """
        zero = PeerTraffic()
        return Traffic(self.rank, {
            peer: zero if conn is None else conn.counts.snapshot()
            for peer, conn in enumerate(self._connections) if peer != self.rank},
            self.host_keys())

    def connected_peers(self) -> tuple[int, ...]:
        """Ranks this rank holds a live authenticated connection to, ascending.

        With ``connect="lazy"`` these are the peers it has exchanged messages with (or
        posted a receive from) so far; with ``"eager"`` every other rank. A connection
        that failed is not counted.
        """
        return tuple(peer for peer, conn in enumerate(self._connections)
                     if conn is not None and not conn.failed)

    # -- liveness ------------------------------------------------------------------------

    async def _monitor(self) -> None:
        """Heartbeats on idle connections; silence beyond the limit fails the peer."""
        interval = self.config.heartbeat_interval
        limit = self.config.liveness_window
        tick = interval / 4
        loop = self._loop
        responsive_since = loop.time()
        expected = responsive_since + tick
        while True:
            await asyncio.sleep(tick)
            now = loop.time()
            lag = now - expected
            expected = now + tick
            if lag > tick:
                # our loop was blocked (e.g. NumPy compute): peers' bytes may be sitting
                # unread in the kernel, so silence is measured from now on
                responsive_since = now
                logger.debug("netdist: rank %d event loop was blocked for %.2fs",
                             self.rank, lag)
            for conn in self._connections:
                if conn is None or conn.failed:
                    continue
                idle, silent = conn.observe(now)
                if idle >= interval:
                    conn.write_control(_HEARTBEAT)
                conn.watch_link(now)
                silent = min(silent, now - responsive_since)
                self._trace_silence(conn.peer_rank, silent, interval)
                allowed = conn.link.window(limit) if silent > limit else limit
                if silent > allowed:
                    window = (f"the liveness window of {limit:g}s, stretched to "
                              f"{allowed:g}s because the link was losing packets"
                              if allowed > limit else f"the liveness window of {limit:g}s")
                    conn.fail(
                        f"rank {conn.peer_rank} sent nothing for {silent:.1f}s, beyond "
                        f"{window} (NETDIST_HEARTBEAT_INTERVAL="
                        f"{interval:g} x NETDIST_HEARTBEAT_MISSES="
                        f"{self.config.heartbeat_misses}): presumed dead (stopped, "
                        "partitioned, or computing without a progress thread)")

    def _trace_silence(self, peer: int | None, silent: float, interval: float) -> None:
        """Trace a peer silent for over two heartbeat intervals, once per such gap."""
        if peer is None or self._recorder.trace is None:
            return
        if silent > 2 * interval:
            if peer not in self._silent_peers:
                self._silent_peers.add(peer)
                self._recorder.instant("connection", "heartbeat_gap", peer=peer,
                                       gap_us=silent * 1e6)
        elif silent < interval:
            self._silent_peers.discard(peer)

    def _spawn(self, coro: Any, what: str) -> asyncio.Task[Any]:
        task = self._loop.create_task(coro, name=f"netdist rank {self.rank}: {what}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("netdist: %s failed", task.get_name(), exc_info=task.exception())

    # -- the Transport API ---------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def _peer_index(self, peer: Any, what: str) -> int:
        """``peer`` as a list index, validated (cheap for the common case)."""
        if type(peer) is int and 0 <= peer < self.world_size and peer != self.rank:
            return peer
        self.check_peer(peer, what)
        return int(peer)

    async def send(self, dst: int, data: Any, *, tag: int = 0,
                   timeout: float | None = None) -> None:
        """Send ``data`` to ``dst``; returns once ``data``'s memory may be reused.

        The first send to a peer not connected yet connects to it (lazy mode); sends
        waiting for that connection leave in the order they were called. Raises
        ``PeerLostError`` if ``dst`` is gone or cannot be reached,
        ``NetdistTimeoutError`` after ``timeout`` (default ``config.timeout``, which
        includes waiting for the connection), ``LocalProtocolError`` for a dtype or size
        the wire cannot carry. A timeout or cancellation after the frame started going
        out fails the connection to ``dst`` (see ``Transport.send``).
        """
        if self._closed:
            self.check_open("send")
        dst = self._peer_index(dst, "dst")
        if type(tag) is not int or not 0 <= tag <= MAX_TAG:
            tag = self.check_tag(tag)
        buffers = encode_data(data, tag=tag, limits=self._limits)
        conn = self._connections[dst]
        trace = self._recorder.trace
        started_ns = monotonic_ns() if trace is not None else 0
        started = self._loop.time()
        deadline = started + (self.timeout if timeout is None else timeout)
        if conn is None or self._links.has_senders(dst):
            conn = await self._connection_for_send(dst, tag, started, deadline)
        payload = len(buffers[1]) if len(buffers) > 1 else 0
        if trace is None:
            await conn.send_frame(buffers, tag, payload, deadline, started)
            return
        ready_ns = monotonic_ns()
        await conn.send_frame(buffers, tag, payload, deadline, started)
        trace.add((KIND_SEND, started_ns, monotonic_ns(), dst, tag, payload,
                   ready_ns - started_ns, 0, 0, 0))

    async def _connection_for_send(self, dst: int, tag: int, started: float,
                                   deadline: float) -> FrameConnection:
        """The connection to ``dst`` once made (on first use), in senders' call order."""
        if self._eager:
            raise ConnectError(f"send: rank {self.rank} has no connection to rank {dst}")
        self._ensure_dial(dst)
        try:
            await self._links.wait_turn(dst, deadline, self._link_settled(dst))
        except TimeoutError:
            elapsed = self._loop.time() - started
            raise NetdistTimeoutError(
                f"send to rank {dst} (tag {tag}) timed out after {elapsed:.2f}s waiting to "
                f"connect to rank {dst}") from None
        self.check_open("send")
        conn = self._connections[dst]
        if conn is None:
            lost = self._links.unreachable.get(dst)
            if lost is None:  # pragma: no cover - a settled link is one of the three
                raise ConnectError(f"send: rank {self.rank} has no connection to rank {dst}")
            raise lost()
        return conn

    async def recv(self, src: int, *, tag: int = 0, out: np.ndarray | None = None,
                   timeout: float | None = None) -> np.ndarray:
        """Receive the next message from ``src`` on ``tag`` (into ``out`` if given).

        Posting a receive from a peer not connected yet connects to it (lazy mode), so a
        peer that is gone fails the receive with ``PeerLostError``. On timeout or
        cancellation the posted receive is withdrawn; if its frame was already landing
        (in ``out``), the connection to ``src`` is failed instead of letting the rest of
        the frame write into memory the caller got back. bfloat16 without ``out``: see
        ``Transport.recv``.
        """
        if self._closed:
            self.check_open("recv")
        src = self._peer_index(src, "src")
        if type(tag) is not int or not 0 <= tag <= MAX_TAG:
            tag = self.check_tag(tag)
        box = self._mailboxes[src]
        if box is None:  # pragma: no cover - _peer_index excludes our own rank
            raise ValueError(f"src {src} is this rank")
        if self._connections[src] is None:
            self._ensure_dial(src)  # waiting on a peer connects to it: its loss is seen
        trace = self._recorder.trace
        started_ns = 0
        if trace is not None:
            if box.claim_times is None:
                box.claim_times = {}
            started_ns = monotonic_ns()
        try:
            message = await box.recv(tag, out, self.timeout if timeout is None else timeout)
        except (NetdistTimeoutError, asyncio.CancelledError):
            conn = self._connections[src]
            if conn is not None:
                conn.abandon_withdrawn_landing(f"recv from rank {src} (tag {tag}) gave up")
            raise
        if trace is not None:
            ended_ns = monotonic_ns()
            claimed = box.claim_times.pop(tag, started_ns) if box.claim_times else started_ns
            trace.add((KIND_RECV, started_ns, ended_ns, src, tag, message.nbytes,
                       max(0, min(claimed, ended_ns) - started_ns), 0, 0, 0))
        return message

    def message_ready(self, src: int, *, tag: int) -> bool:
        """Whether a message from ``src`` on ``tag`` has arrived whole, so ``recv`` returns
        it at once. Unlike a ``recv``, asking neither connects to ``src`` nor counts as
        waiting on it (a peer that leaves is not blamed for cutting this rank short)."""
        box = self._mailboxes[self._peer_index(src, "src")]
        return box is not None and box.ready(tag)

    async def barrier(self, *, timeout: float | None = None) -> None:
        """Dissemination barrier (ceil(log2 n) rounds); ``NetdistTimeoutError`` on timeout."""
        self.check_open("barrier")
        await dissemination_barrier(self, self.timeout if timeout is None else timeout)

    async def aclose(self) -> None:
        """Send BYE to every peer, deliver what was sent, close every socket, await tasks.

        Nothing a send or collective reported done is dropped: each connection is closed
        only once the peer has read up to this rank's BYE (its EOF says so), or its kernel
        has acknowledged every byte, bounded by the operation timeout (``timeout``); a
        peer whose kernel stops acknowledging for a liveness window is given up on. A
        clean close that could not deliver everything raises ``UndeliveredError`` naming
        each such peer and the bytes left (an ``abort`` only logs it). Idempotent. Pending operations fail with ``TransportClosedError``. If the caller
        is cancelled, closing still completes (the sockets are closed synchronously; the
        bounded wait for them runs in a task the next ``aclose`` awaits). If a peer was
        lost before (not one that left with BYE while this rank waited on nothing from
        it), peers get an ERROR frame naming the rank that went away first instead of
        BYE, as with ``abort``.
        """
        await self._close(None)

    async def abort(self, error: BaseException | str) -> None:
        """Close because this rank is failing with ``error``; peers learn whom to blame.

        Every peer still connected gets an ERROR frame instead of BYE, naming the
        origin: the rank behind a ``PeerLostError`` in ``error``'s chain (its cause,
        context or exception-group members), else the first peer this transport lost
        other than by BYE, else this rank itself ("rank 2 aborted: RuntimeError: boom";
        a ``str`` ``error`` is the reason itself). A ``SystemExit`` with code 0 or None
        is a clean exit: the same as ``aclose``. Otherwise like ``aclose``: idempotent
        (the first of the two decides the frame), completes under cancellation.
        Leaving ``async with`` on an exception calls this.
        """
        clean = isinstance(error, SystemExit) and error.code in (0, None)
        await self._close(None if clean else error)

    async def _close(self, error: BaseException | str | None) -> None:
        first = self._close_task is None
        if self._close_task is None:
            self._finish_recording()
            self._begin_close(self._farewell(error))
            self._close_task = self._loop.create_task(self._finish_close())
        await asyncio.shield(self._close_task)
        if first and self._undelivered:
            failure = self._undelivered_error()
            if error is None:
                raise failure
            logger.warning("netdist: %s", failure)

    def _undelivered_error(self) -> UndeliveredError:
        """What a clean close could not deliver, peer by peer (see ``wait_delivered``)."""
        parts = [(f"rank {peer}: {n} bytes not acknowledged" if n > 0 else
                  f"rank {peer}: never confirmed it read everything")
                 for peer, n in sorted(self._undelivered.items())]
        return UndeliveredError(
            f"rank {self.rank} closed its transport but could not deliver everything it "
            f"had sent within the operation timeout of {self.timeout:g}s ("
            + "; ".join(parts) + "): the peer stopped reading or the link stopped "
            "moving bytes", self._undelivered)

    def _farewell(self, error: BaseException | str | None) -> bytes | None:
        """The ERROR frame to leave with (None: a plain BYE, nothing to blame)."""
        origin = self._blame(error)
        if origin is None:
            return None
        how = Departure.CLOSED if error is None else Departure.ABORTED
        try:
            return encode_control(FrameKind.ERROR, farewell_fields(self.rank, origin, how),
                                  limits=self._limits)
        except LocalProtocolError:  # a max_header_bytes too small for the reason: BYE
            logger.warning("netdist: rank %d: farewell naming rank %d does not fit "
                           "max_header_bytes; sending BYE", self.rank, origin.rank)
            return None

    def _blame(self, error: BaseException | str | None) -> LossOrigin | None:
        """Who went away first, as far as this rank knows (None: nobody, a clean close)."""
        lost = _peer_loss_in(error) if isinstance(error, BaseException) else None
        if lost is not None:
            recorded = self._lost.get(lost.rank)
            if recorded is not None and recorded[0].rank == lost.origin_rank:
                return recorded[0]  # knows who saw it first hand
            seen_by = self.rank if lost.via is None else lost.rank
            return LossOrigin(lost.origin_rank, one_line(lost.origin_reason), seen_by)
        for peer, (origin, explains) in self._lost.items():
            box = self._mailboxes[peer]
            if explains or (box is not None and box.interrupted):
                return origin  # a BYE counts once it cut short something we waited for
        if error is None:
            return None
        return LossOrigin(self.rank, describe_failure(self.rank, error), self.rank)

    def _begin_close(self, farewell: bytes | None) -> None:
        self._closed = True
        rank = self.rank

        def closed_error() -> Exception:
            return TransportClosedError(f"rank {rank}: transport is closed")

        if self._server is not None:
            stop_accepting(self._server)  # closed by _finish_close (close_listener)
        self._links.close()
        for conn in self._connections:
            if conn is not None:
                conn.close(send_bye=True, error=closed_error,
                           reason=f"rank {rank} closed its transport", farewell=farewell)
        for conn in list(self._handshaking):
            conn.close(send_bye=False, error=closed_error, reason="transport closed")
        for box in self._mailboxes:
            if box is not None:
                box.fail(closed_error)
        for task in list(self._tasks):
            task.cancel()
        if self._straggler is not None:
            self._straggler.stop()

    async def _finish_close(self) -> None:
        if self._metrics is not None:
            await self._metrics.aclose()
        if self._straggler is not None:
            await self._straggler.wait_stopped()
        if self._server is not None:
            await close_listener(self._server)
        tasks = list(self._tasks)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._coordinator is not None:
            await self._coordinator.aclose()
        deadline = self._loop.time() + self.timeout
        window = self.config.liveness_window
        peers = [c for c in self._connections if c is not None]
        left = await asyncio.gather(*(c.wait_delivered(deadline, window) for c in peers),
                                    *(c.wait_closed(_CLOSE_WAIT) for c in self._handshaking))
        self._undelivered = {conn.peer_rank: n for conn, n in zip(peers, left)
                             if n and conn.peer_rank is not None}
        if self._server is not None:
            await self._server.wait_closed()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"<TcpTransport rank {self.rank}/{self.world_size} {state} "
                f"listening on {self.listen_address}>")

    def link_stats(self) -> dict[int, Any]:
        """Per peer ever connected, the kernel's counters of its connection: a
        ``netdist.transport.link_stats.TcpStats``, or ``None`` where they cannot be read
        (closed, not Linux). Read-only; ``netdist.trace.counters`` reports them. Call it on
        the transport's event loop."""
        return {peer: conn.tcp_stats() for peer, conn in enumerate(self._connections)
                if conn is not None}


def _peer_loss_in(error: BaseException) -> PeerLostError | None:
    """The first ``PeerLostError`` behind ``error``: itself, its cause or context chain,
    or the members of an exception group (breadth first, bounded)."""
    queue: list[BaseException] = [error]
    seen: set[int] = set()
    while queue and len(seen) < 256:
        exc = queue.pop(0)
        if id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, PeerLostError):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            queue.extend(exc.exceptions)
        queue.extend(e for e in (exc.__cause__, exc.__context__) if e is not None)
    return None


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The most informative exception of a TaskGroup failure (not a cancellation)."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_error(exc)
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return group.exceptions[0]
