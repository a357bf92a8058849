"""The live straggler report: rank 0 names the rank that keeps arriving last, as the job runs.

Every rank notes the arrival (issue time) of each collective it completes
(``Recorder.on_end``: one tuple appended to a bounded deque, nothing else on the hot
path). Every ``period`` seconds each rank other than 0 sends what it noted to rank 0, as
one small msgpack message (a ``uint8`` array, chunked to stay below the transport's small
frame size) on a tag of its own: the range ``reserve_tags`` gives owner
``"straggler-report"`` among all transport ranks, which every rank computes alike and
nothing else uses. Arrival times go on the job's aligned clock (``Recorder.clock``).
Rank 0 feeds them, with its own, into a ``StragglerWindow`` (``netdist.trace.stragglers``,
which holds the definition) and keeps the latest result (``straggler_report``); when it
names a rank, it logs a WARNING on ``netdist.trace`` at most once per
``NETDIST_STRAGGLER_REPORT`` seconds::

    netdist: straggler report: rank 2 arrived last at 48 of 50 collectives of group
    0x0001a2b3c4d5e6f7 (4 ranks), late by 50.3 ms (median)

Ranks late by less than ``MIN_LATE_MS`` in the median are not named: in a group of two
one rank is always last at half the collectives or more, by noise.

Off unless ``NETDIST_STRAGGLER_REPORT`` is set above 0 or ``NETDIST_TRACE`` traces from the
start (``TraceSettings.straggler_interval``): it adds one small message per rank per
period and, in lazy-connect mode, a connection from every rank to rank 0, which changes
the byte counts a job measures. Each rank other than 0 makes that connection when the
monitor starts (a first, empty message), while every rank is surely up: dialling rank 0
first at the end of a job, after rank 0 left, would be reported as losing it.

Rank 0 does not post receives for these messages: a posted receive would connect to
every peer, and a peer leaving while it is posted counts as cutting rank 0's work short
(``PeerMailbox.interrupted``), which changes how rank 0 says goodbye. Instead, once per
period, it takes the messages that have already arrived (``TcpTransport.message_ready``).

The monitor runs as a task on the transport's loop, so its batches go out when that
loop gets a turn: always on a progress thread (``netdist.connect``, the blocking API),
and whenever an asyncio rank awaits something that waits. An asyncio rank that computes
and then only runs collectives that complete without suspending (the last rank to arrive
at a shared-memory all-reduce finds everything ready) starves the loop, its heartbeats
and this report alike, until it next waits.

It never raises into the job: a lost peer, a closed transport or a message that is not
one of these stops that peer's part quietly (debug log). It holds bounded memory
(``MAX_PENDING`` arrivals per rank, the oldest dropped and counted; the window's
bounds), sends at most one batch per period (each send under the transport's operation
timeout, as any send of the job: a shorter one could drop the connection to rank 0 under
back-pressure), and its task is cancelled and awaited when the transport closes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from netdist.collectives.tags import reserve_tags
from netdist.trace.recorder import _GID, _SEQ, _STATE, _T0, OpState, Recorder
from netdist.trace.stragglers import Straggler, StragglerWindow

if TYPE_CHECKING:
    from netdist.transport.tcp import TcpTransport

__all__ = ["StragglerMonitor", "start_straggler_monitor", "straggler_report",
           "monitor_of", "OWNER", "DEFAULT_PERIOD", "MAX_PENDING", "MIN_LATE_MS"]

logger = logging.getLogger("netdist.trace")

OWNER = "straggler-report"
"""The owner name of the monitor's tag range (among all transport ranks)."""
DEFAULT_PERIOD = 1.0
"""Seconds between two batches of arrivals a rank sends to rank 0."""
MAX_PENDING = 4096
"""Arrivals a rank holds between two batches; beyond it the oldest are dropped."""
CHUNK = 1024
"""Arrivals per message (at most about 28 KB: one small frame)."""
MAX_MESSAGES_PER_PEER = 64
"""Messages rank 0 takes from one peer per period, at most."""
MIN_LATE_MS = 1.0
"""Least median lateness (ms) of a rank the report names."""
STOP_WAIT = 2.0
"""Seconds ``wait_stopped`` waits for the monitor's task after cancelling it."""
_VERSION = 1


class StragglerMonitor:
    """One rank's part of the live straggler report (see the module docstring)."""

    def __init__(self, transport: TcpTransport, interval: float, *,
                 period: float | None = None, max_pending: int = MAX_PENDING) -> None:
        self.transport = transport
        self.rank = transport.rank
        self.world_size = transport.world_size
        self.interval = interval
        """Least seconds between two report lines (rank 0)."""
        self.period = DEFAULT_PERIOD if period is None else period
        self.recorder: Recorder = transport.recorder
        self.tag = reserve_tags(transport, range(self.world_size), OWNER).tag(0)
        self.pending: deque[tuple[int, int, int]] = deque(maxlen=max_pending)
        """(group id, seq, arrival ns on this rank's clock) not sent yet; appended from
        ``on_end``, which may run on a thread calling collectives eagerly (a deque's
        append and popleft are safe there)."""
        self.dropped = 0
        """Arrivals dropped here because ``pending`` was full."""
        self.window: StragglerWindow | None = StragglerWindow() if self.rank == 0 else None
        """Rank 0's window over every rank's arrivals."""
        self.latest: list[Straggler] = []
        """Rank 0: the stragglers as of the last period."""
        self.reports = 0
        """Rank 0: report lines logged."""
        self.peer_dropped: dict[int, int] = {}
        """Rank 0: arrivals each peer says it dropped."""
        self.silenced: set[int] = set()
        """Rank 0: peers whose messages are no longer read (lost, or sent garbage)."""
        self._announced: set[int] = set()
        self._last_report: float | None = None
        self._previous_on_end = self.recorder.on_end
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    # -- hot path ------------------------------------------------------------------------

    def on_end(self, record: list[Any]) -> None:
        """``Recorder.on_end``: note a completed collective's arrival."""
        if record[_STATE] == OpState.OK and not self._stopped:
            pending = self.pending
            if len(pending) == pending.maxlen:
                self.dropped += 1
            pending.append((record[_GID], record[_SEQ], record[_T0]))
        previous = self._previous_on_end
        if previous is not None:
            previous(record)

    # -- start and stop ------------------------------------------------------------------

    def start(self) -> None:
        """Hook into the recorder and start the task on the running loop."""
        self.recorder.on_end = self.on_end
        loop = asyncio.get_running_loop()
        body = self._collect_loop() if self.rank == 0 else self._send_loop()
        self._task = loop.create_task(
            body, name=f"netdist rank {self.rank}: straggler report")

    def stop(self) -> None:
        """Unhook from the recorder and cancel the task (``wait_stopped`` awaits it)."""
        if self._stopped:
            return
        self._stopped = True
        if self.recorder.on_end == self.on_end:
            self.recorder.on_end = self._previous_on_end
        if self._task is not None:
            self._task.cancel()

    async def wait_stopped(self, timeout: float = STOP_WAIT) -> None:
        """Wait for the cancelled task to end (at most ``timeout`` seconds)."""
        self.stop()
        if self._task is not None and not self._task.done():
            await asyncio.wait({self._task}, timeout=timeout)

    # -- ranks other than 0 --------------------------------------------------------------

    async def _send_loop(self) -> None:
        transport = self.transport
        try:
            # connect to rank 0 now, while every rank is surely up (lazy mode)
            await transport.send(0, self._encode([]), tag=self.tag)
            while True:
                await asyncio.sleep(self.period)
                for message in self._batches():
                    await transport.send(0, message, tag=self.tag)
        except Exception as exc:  # noqa: BLE001 - never into the job: the report stops
            logger.debug("netdist: rank %d stopped sending its straggler report to rank 0: "
                         "%s", self.rank, exc)

    def _batches(self) -> Iterator[np.ndarray]:
        """This period's messages: what ``pending`` holds now, ``CHUNK`` at a time."""
        pending = self.pending
        for _ in range(-(-len(pending) // CHUNK)):
            items = [pending.popleft() for _ in range(min(CHUNK, len(pending)))]
            if items:
                yield self._encode(items)

    def _encode(self, items: list[tuple[int, int, int]]) -> np.ndarray:
        offset = self.recorder.clock.offset_ns
        groups = self.recorder.groups
        announce: list[list[Any]] = []
        flat: list[int] = []
        for gid, seq, arrival in items:
            if gid not in self._announced:
                ranks = groups.get(gid)
                if ranks is not None:
                    announce.append([gid, list(ranks)])
                    self._announced.add(gid)
            flat.extend((gid, seq, arrival + offset))
        payload = msgpack.packb({"v": _VERSION, "g": announce, "a": flat, "d": self.dropped})
        return np.frombuffer(payload, np.uint8)

    # -- rank 0 --------------------------------------------------------------------------

    async def _collect_loop(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.period)
                await self.collect()
                self.report()
        except Exception as exc:  # noqa: BLE001 - never into the job: the report stops
            logger.debug("netdist: rank 0 stopped its straggler report: %s", exc)

    async def collect(self) -> None:
        """Feed the window with this rank's arrivals and every message already here."""
        window = self.window
        if window is None:
            return
        for gid, ranks in list(self.recorder.groups.items()):
            window.set_group(gid, ranks)
        offset = self.recorder.clock.offset_ns
        pending = self.pending
        for _ in range(len(pending)):
            gid, seq, arrival = pending.popleft()
            window.arrive(gid, seq, self.rank, arrival + offset)
        transport = self.transport
        for peer in range(self.world_size):
            if peer == self.rank or peer in self.silenced:
                continue
            try:
                for _ in range(MAX_MESSAGES_PER_PEER):
                    if not transport.message_ready(peer, tag=self.tag):
                        break
                    message = await transport.recv(peer, tag=self.tag, timeout=self.period)
                    if not self._take(window, peer, message):
                        self.silenced.add(peer)
                        logger.debug("netdist: rank 0 ignores rank %d's straggler report "
                                     "from now on: a message that is not one", peer)
                        break
            except Exception as exc:  # noqa: BLE001 - that peer's part stops, quietly
                self.silenced.add(peer)
                logger.debug("netdist: rank 0 stopped reading rank %d's straggler report: "
                             "%s", peer, exc)

    def _take(self, window: StragglerWindow, peer: int, message: np.ndarray) -> bool:
        """Feed one peer's message into ``window``; False if it is not such a message."""
        if message.dtype != np.uint8 or message.ndim != 1:
            return False
        try:
            data = msgpack.unpackb(message.tobytes(), raw=False, strict_map_key=False)
        except Exception:  # noqa: BLE001 - msgpack raises several kinds for garbage
            return False
        if not isinstance(data, dict) or data.get("v") != _VERSION:
            return False
        groups, flat, dropped = data.get("g"), data.get("a"), data.get("d")
        if not (isinstance(groups, list) and isinstance(flat, list) and len(flat) % 3 == 0
                and type(dropped) is int and all(type(x) is int for x in flat)):
            return False
        for entry in groups:
            if not (isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int
                    and isinstance(entry[1], list)
                    and all(type(r) is int and 0 <= r < self.world_size for r in entry[1])):
                return False
            window.set_group(entry[0], entry[1])
        for i in range(0, len(flat), 3):
            window.arrive(flat[i], flat[i + 1], peer, flat[i + 2])
        self.peer_dropped[peer] = dropped
        return True

    def report(self) -> list[Straggler]:
        """Judge the window now (``latest``); log it if it names a rank and the last line
        is ``interval`` seconds old."""
        if self.window is None:
            return []
        found = self.latest = self.window.stragglers(min_late_ms=MIN_LATE_MS)
        now = time.monotonic()
        if found and (self._last_report is None or now - self._last_report >= self.interval):
            self._last_report = now
            self.reports += 1
            logger.warning("netdist: straggler report: %s",
                           "; ".join(straggler.describe() for straggler in found))
        return found


def start_straggler_monitor(transport: TcpTransport) -> StragglerMonitor | None:
    """Start ``transport``'s part of the live straggler report, if it is on
    (``TraceSettings.straggler_interval``); ``None`` when off. Called at the end of
    ``TcpTransport`` start-up; a failure to start is logged, never raised."""
    interval = transport.recorder.settings.straggler_interval
    if interval <= 0 or transport.world_size < 2:
        return None
    try:
        monitor = StragglerMonitor(transport, interval)
        monitor.start()
    except Exception as exc:  # noqa: BLE001 - the job goes on without the report
        logger.warning("netdist: rank %d could not start the live straggler report: %s",
                       transport.rank, exc)
        return None
    return monitor


def monitor_of(transport: object) -> StragglerMonitor | None:
    """``transport``'s straggler monitor, or ``None`` (off, or not a TCP transport)."""
    monitor = getattr(transport, "_straggler", None)
    return monitor if isinstance(monitor, StragglerMonitor) else None


def straggler_report(transport: object) -> list[Straggler]:
    """The stragglers rank 0's live report names as of its last period (empty on other
    ranks, and when the report is off)."""
    monitor = monitor_of(transport)
    return [] if monitor is None else list(monitor.latest)
