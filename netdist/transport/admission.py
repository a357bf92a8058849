"""Admission of inbound connections before they authenticate: strangers are bounded.

Anyone who can reach a listening port -- a rank's peer listener, rank 0's coordinator --
can open connections, and until the handshake proves the job token each one costs a
descriptor and memory. Unbounded, idle strangers once raised a rank's RSS by gigabytes
and took the descriptors its next checkpoint save needed. ``AdmissionControl`` is the
one mechanism both listeners use (``TcpTransport`` shares its instance with the
coordinator it hosts, so the bound is per process):

* at most ``max_unauthenticated`` connections (or the job's world size, if larger: its
  own ranks all register with the coordinator, and with ``connect="eager"`` all dial rank
  0, at once) are mid-handshake at once; a new one beyond that is closed at once, before
  anything is allocated for it -- established peers are never evicted to make room;
* none is admitted while the process is within ``fd_reserve`` descriptors of its soft
  ``RLIMIT_NOFILE``, so the job's own files and peers always get one;
* an admitted connection reads its handshake under small limits (``FrameConnection``)
  and must authenticate within ``handshake_timeout``; its slot is released when it
  authenticates or closes;
* refusals and failed handshakes are logged at most once per ``refusal_log_interval``
  (the first in full, the others counted), so a flood cannot flood the log.

``RefusalRecord`` remembers handshakes the coordinator refused (a wrong token, another
job id or world size), per claimed rank and bounded in size, so that a rendezvous that
times out can say *why* a rank never arrived instead of only that it did not.

``raise_nofile_limit`` lifts the soft descriptor limit towards the hard one when a
transport starts, as Go's runtime does, so the common 1,024 default is not the ceiling.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

from netdist.config import AdmissionLimits
from netdist.transport.os_errors import OsErrorKind, kind_of

try:
    import resource
except ImportError:  # pragma: no cover - not on Windows
    resource = None  # type: ignore[assignment]

__all__ = [
    "AdmissionControl",
    "AdmissionStats",
    "Refusal",
    "RateLimitedLog",
    "RefusalEntry",
    "RefusalRecord",
    "MAX_REFUSAL_RANKS",
    "count_open_fds",
    "soft_fd_limit",
    "raise_nofile_limit",
    "FD_LIMIT_TARGET",
]

logger = logging.getLogger("netdist.transport")

FD_LIMIT_TARGET = 65536
"""``raise_nofile_limit`` raises the soft limit to this, or to the hard limit if lower."""

_RECOUNT_SECONDS = 0.1
"""How stale the open-descriptor count may be while the process is far from its limit."""

_FD_DIRS = ("/proc/self/fd", "/dev/fd")

MAX_REFUSAL_RANKS = 16
"""Claimed ranks a ``RefusalRecord`` keeps apart; refusals beyond share one entry."""

_MAX_REFUSAL_TEXT = 200
"""Longest reason or address a ``RefusalRecord`` keeps (longer ones are cut)."""


def count_open_fds() -> int | None:
    """Descriptors this process has open, or ``None`` where the OS does not list them.

    Raises ``OSError`` (``EMFILE``) when not even the listing can be opened: the process
    is out of descriptors.
    """
    for path in _FD_DIRS:
        try:
            return len(os.listdir(path)) - 1  # minus the descriptor reading the listing
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
    return None


def soft_fd_limit() -> int | None:
    """The soft ``RLIMIT_NOFILE`` of this process, or ``None`` if unlimited or unknown."""
    if resource is None:  # pragma: no cover - not on Windows
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def raise_nofile_limit(target: int = FD_LIMIT_TARGET) -> tuple[int, int] | None:
    """Raise the soft ``RLIMIT_NOFILE`` to ``min(hard, target)`` if it is lower.

    Returns ``(old, new)`` soft limits when it changed, else ``None``. The hard limit is
    never touched (only root could raise it), and a limit already higher is kept. Any
    refusal by the OS is ignored: this is an improvement, not a requirement.
    """
    if resource is None:  # pragma: no cover - not on Windows
        return None
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        new = target if hard == resource.RLIM_INFINITY else min(hard, target)
        if soft != resource.RLIM_INFINITY and soft < new:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            return int(soft), int(new)
    except (OSError, ValueError):  # pragma: no cover - a sandbox may refuse
        pass
    return None


class Refusal(enum.Enum):
    """Why a new connection was closed before its handshake started."""

    CAPACITY = "capacity"
    """``max_unauthenticated`` connections were already authenticating."""
    DESCRIPTORS = "descriptors"
    """The process was within ``fd_reserve`` descriptors of its limit."""


@dataclass(frozen=True, slots=True)
class AdmissionStats:
    """Counters of one ``AdmissionControl`` (for tests, benchmarks and diagnostics)."""

    pending: int
    """Admitted connections that have neither authenticated nor closed yet."""
    peak_pending: int
    """The largest ``pending`` ever reached (never above the capacity)."""
    admitted: int
    refused_capacity: int
    refused_descriptors: int

    @property
    def refused(self) -> int:
        """Connections closed at once, for either reason."""
        return self.refused_capacity + self.refused_descriptors


class RateLimitedLog:
    """Warnings at most once per ``interval`` seconds: the first in full, the rest counted.

    The count of the ones held back rides along with the next warning that is logged.
    """

    def __init__(self, log: logging.Logger, interval: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = log
        self._interval = interval
        self._clock = clock
        self._next = float("-inf")
        self._held = 0

    @property
    def held_back(self) -> int:
        """Warnings suppressed since the last one logged."""
        return self._held

    def warning(self, message: str, *args: Any) -> bool:
        """Log ``message % args`` unless one was logged less than ``interval`` ago.

        Returns True when it was logged. Suppressed messages are never formatted.
        """
        now = self._clock()
        if now < self._next:
            self._held += 1
            return False
        if self._held:
            message += " [%d similar message(s) in the previous %gs not logged]"
            args = (*args, self._held, self._interval)
        self._log.warning(message, *args)
        self._next = now + self._interval
        self._held = 0
        return True


class _Refused(asyncio.Protocol):
    """What a refused connection gets: reported, then closed at once, nothing read."""

    def __init__(self, on_made: Callable[[asyncio.BaseTransport], None]) -> None:
        self._on_made = on_made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._on_made(transport)
        # a stream transport (uvloop's is not an asyncio.Transport subclass: static only)
        cast(asyncio.Transport, transport).abort()

    def data_received(self, data: bytes) -> None:
        pass  # pragma: no cover - aborted before any read

    def eof_received(self) -> bool | None:
        return None  # pragma: no cover - aborted before any read


Release = Callable[[], None]
"""Gives an admission slot back (idempotent); see ``AdmissionControl.protocol_factory``."""


class AdmissionControl:
    """Admits inbound connections while few are unauthenticated and descriptors are left.

    ``owner`` names the process in log lines (``"rank 0"``). ``clock``, ``fd_counter``
    and ``fd_limit`` are injectable for tests. Not thread-safe: it lives on the event
    loop that accepts the connections.
    """

    def __init__(self, limits: AdmissionLimits, *, owner: str, expected: int = 0,
                 clock: Callable[[], float] = time.monotonic,
                 fd_counter: Callable[[], int | None] = count_open_fds,
                 fd_limit: Callable[[], int | None] = soft_fd_limit) -> None:
        if not isinstance(limits, AdmissionLimits):
            raise TypeError(f"limits must be an AdmissionLimits, got {type(limits).__name__}")
        if expected < 0:
            raise ValueError(f"expected must be >= 0, got {expected}")
        self.limits = limits
        self.owner = owner
        self.capacity = max(limits.max_unauthenticated, expected)
        """Connections admitted mid-handshake at once: ``max_unauthenticated``, or the
        ``expected`` number the job's own ranks open at once (its world size: every rank
        registering with the coordinator, or dialling one rank at start-up) if that is
        more. A job never refuses its own ranks for being many, and the bound on
        strangers stays fixed for a given job."""
        self.log = RateLimitedLog(logger, limits.refusal_log_interval, clock)
        """Where refusals and failed handshakes of strangers are reported."""
        self._clock = clock
        self._fd_counter = fd_counter
        self._fd_limit = fd_limit
        self._pending = 0
        self._peak = 0
        self._admitted = 0
        self._refused = dict.fromkeys(Refusal, 0)
        self._fd_count = 0
        self._fd_counted_at = float("-inf")
        self._admitted_since_count = 0

    # -- state -----------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Admitted connections that have neither authenticated nor closed yet."""
        return self._pending

    def stats(self) -> AdmissionStats:
        """A snapshot of the counters."""
        return AdmissionStats(self._pending, self._peak, self._admitted,
                              self._refused[Refusal.CAPACITY],
                              self._refused[Refusal.DESCRIPTORS])

    def handshake_deadline(self, now: float, join_timeout: float) -> float:
        """Loop time by which a connection accepted at ``now`` must have authenticated."""
        return now + min(self.limits.handshake_timeout, join_timeout)

    # -- admission -------------------------------------------------------------------------

    def protocol_factory(self, make: Callable[[Release], asyncio.BaseProtocol]
                         ) -> Callable[[], asyncio.BaseProtocol]:
        """A protocol factory for ``loop.create_server`` that admits or refuses.

        Admitted: ``make(release)`` builds the connection, which must call ``release()``
        once it has authenticated or closed (``FrameConnection`` does). Refused: a
        protocol that closes the socket as soon as it is made, so a refused stranger
        costs no buffer, no task and its descriptor only until the next loop turn.
        """
        def factory() -> asyncio.BaseProtocol:
            refusal = self._refusal()
            if refusal is not None:
                self._refused[refusal] += 1
                return _Refused(lambda transport: self._report(refusal, transport))
            return make(self._take_slot())

        return factory

    def _refusal(self) -> Refusal | None:
        if self._pending >= self.capacity:
            return Refusal.CAPACITY
        if self._descriptors_short():
            return Refusal.DESCRIPTORS
        return None

    def _take_slot(self) -> Release:
        self._pending += 1
        self._admitted += 1
        self._admitted_since_count += 1
        self._peak = max(self._peak, self._pending)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._pending -= 1

        return release

    def _descriptors_short(self) -> bool:
        """True when admitting one more would leave fewer than ``fd_reserve`` free.

        Listing the open descriptors costs about 0.4 us each, so while the process is far
        from its limit the count may be up to ``_RECOUNT_SECONDS`` old (corrected by the
        connections admitted since); near the limit it is exact every time.
        """
        reserve = self.limits.fd_reserve
        if reserve == 0:
            return False
        limit = self._fd_limit()
        if limit is None:
            return False
        now = self._clock()
        free = limit - self._fd_count - self._admitted_since_count
        if now - self._fd_counted_at >= _RECOUNT_SECONDS or free < 2 * reserve:
            try:
                count = self._fd_counter()
            except OSError as exc:
                if kind_of(exc) is OsErrorKind.OUT_OF_DESCRIPTORS:
                    return True  # could not even open the listing: nothing to spare
                return False  # an unreadable listing for another reason refuses no one
            if count is None:
                return False
            self._fd_count, self._fd_counted_at, self._admitted_since_count = count, now, 0
            free = limit - count
        return free < reserve

    def _report(self, refusal: Refusal, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        where = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "?"
        limits = self.limits
        if refusal is Refusal.CAPACITY:
            why = (f"{self.capacity} connections are already authenticating "
                   "(AdmissionLimits.max_unauthenticated, or the world size if larger)")
        else:
            why = (f"fewer than {limits.fd_reserve} file descriptors are left below the "
                   f"limit of {self._fd_limit()} (AdmissionLimits.fd_reserve)")
        stats = self.stats()
        self.log.warning("netdist: %s refused a connection from %s before its handshake: %s;"
                         " %d refused so far", self.owner, where, why, stats.refused)


@dataclass(slots=True)
class RefusalEntry:
    """Refused handshakes that claimed one rank (or, for ``RefusalRecord.other``, none
    of the ranks kept apart): how many, and the last one's reason and address."""

    count: int
    reason: str
    address: str
    sequence: int
    """Order of the last refusal counted here among all of the record's refusals."""

    def describe(self, claiming: str = "", *, other: bool = False) -> str:
        """``"refused 2 connections claiming rank 1, the last from ADDR: REASON"``
        (``claiming`` is `` claiming rank 1``; ``other`` says "other connections")."""
        plural = "s" if self.count != 1 else ""
        which = " other" if other else ""
        last = ", the last" if self.count != 1 else ""
        return (f"refused {self.count}{which} connection{plural}{claiming}{last} from "
                f"{self.address}: {self.reason}")


class RefusalRecord:
    """Handshakes a coordinator refused, per claimed rank, in bounded memory.

    Why: a rank started with the wrong ``NETDIST_TOKEN`` fails at once, but rank 0 only
    sees that it never registered; when the rendezvous times out, ``describe`` tells
    rank 0's user which connections were refused and why (the coordinator's
    ``RendezvousTimeoutError`` message).

    The rank a refused connection claimed is unproven (its AUTH frame did not verify),
    and anyone who reaches the port may claim anything, so memory is bounded whatever
    strangers send: only ranks in ``0..world_size-1`` are kept apart, at most
    ``max_ranks`` of them (the first ones refused); every other refusal is counted in
    the one ``other`` entry. Each entry holds a count and the last reason and address,
    each cut to a fixed length. Not thread-safe: it lives on the coordinator's loop.
    """

    def __init__(self, world_size: int, *, max_ranks: int = MAX_REFUSAL_RANKS) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if max_ranks < 0:
            raise ValueError(f"max_ranks must be >= 0, got {max_ranks}")
        self.world_size = world_size
        self.max_ranks = max_ranks
        self._by_rank: dict[int, RefusalEntry] = {}
        self._other: RefusalEntry | None = None
        self._sequence = 0

    @property
    def total(self) -> int:
        """Refusals recorded so far, all entries together."""
        other = 0 if self._other is None else self._other.count
        return other + sum(entry.count for entry in self._by_rank.values())

    @property
    def ranks(self) -> tuple[int, ...]:
        """The claimed ranks kept apart (sorted); never more than ``max_ranks``."""
        return tuple(sorted(self._by_rank))

    @property
    def other(self) -> RefusalEntry | None:
        """Refusals that claimed no rank kept apart (out of range, beyond ``max_ranks``,
        or none: the connection failed before its AUTH frame)."""
        return self._other

    def get(self, rank: int) -> RefusalEntry | None:
        """The refusals of connections that claimed ``rank``, if any were kept apart."""
        return self._by_rank.get(rank)

    def add(self, address: str, reason: str, claimed_rank: int | None = None) -> None:
        """Count one refused connection from ``address`` (``host:port``) for ``reason``."""
        self._sequence += 1
        address, reason = _cut(address), _cut(reason)
        entry: RefusalEntry | None
        if (claimed_rank is not None and 0 <= claimed_rank < self.world_size
                and (claimed_rank in self._by_rank or len(self._by_rank) < self.max_ranks)):
            entry = self._by_rank.get(claimed_rank)
            if entry is None:
                entry = self._by_rank[claimed_rank] = RefusalEntry(0, reason, address, 0)
        else:
            entry = self._other
            if entry is None:
                entry = self._other = RefusalEntry(0, reason, address, 0)
        entry.count += 1
        entry.reason, entry.address, entry.sequence = reason, address, self._sequence

    def describe(self, ranks: Iterable[int], *, limit: int = 3) -> str:
        """What was refused, the refusals claiming ``ranks`` first (at most ``limit`` of
        them named), the rest summed up: ``"refused 1 connection claiming rank 1 from
        127.0.0.1:5555: bad token (...)"``. Empty when nothing was refused."""
        parts: list[str] = []
        shown: set[int] = set()
        for rank in ranks:
            entry = self._by_rank.get(rank)
            if entry is None or rank in shown:
                continue
            if len(shown) == limit:
                break
            shown.add(rank)
            parts.append(entry.describe(f" claiming rank {rank}"))
        rest = [entry for rank, entry in self._by_rank.items() if rank not in shown]
        if self._other is not None:
            rest.append(self._other)
        if rest:
            last = max(rest, key=lambda entry: entry.sequence)
            summary = RefusalEntry(sum(entry.count for entry in rest), last.reason,
                                   last.address, last.sequence)
            parts.append(summary.describe(other=bool(parts)))
        return "; ".join(parts)


def _cut(text: str) -> str:
    """``text``, cut to ``_MAX_REFUSAL_TEXT`` characters."""
    return text if len(text) <= _MAX_REFUSAL_TEXT else text[:_MAX_REFUSAL_TEXT - 3] + "..."
