"""PURE version clock of a parameter server and its bounded-staleness rule.

``StalenessController`` counts applied updates (the server's version), tracks where
each worker is in its pull -> compute -> push cycle (``WorkerState``) and decides which
held pushes apply next, so that no applied gradient is more than ``max_staleness``
versions old (``None``: fully asynchronous; ``0``: synchronous). Every applied push is
logged as a ``VersionLogEntry``, which is what tests assert the bound from.

Two changes of membership are part of the clock: ``finish`` drops a worker that is done
or lost (the rule stops waiting for it, so a departed worker never holds the others),
and ``resume`` rebuilds the clock on a backup server that takes a shard over, where the
versions the workers last pulled are not known until each worker's next request says
(``report_base``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from netdist.errors import ParameterServerError

__all__ = ["WorkerState", "VersionLogEntry", "StalenessController"]


class WorkerState(enum.Enum):
    """Where a worker is in its pull -> compute -> push cycle, as the server sees it."""

    COMPUTING = "computing"
    """Pulled (or initialised) at ``base``; its next gradient is computed on that version."""
    PENDING = "pending"
    """Pushed a gradient the server holds until the staleness rule lets it apply."""
    APPLIED = "applied"
    """Its push was applied; it has not pulled since (it still counts at its old base)."""
    DONE = "done"


@dataclass(frozen=True, slots=True)
class VersionLogEntry:
    """One applied push: who, on which version it was computed, onto which it was applied."""

    worker: int
    """Worker index (0-based among the workers)."""
    worker_version: int
    """Server version of the parameters the gradient was computed on."""
    server_version: int
    """Server version the update was applied to (the new version is this plus one)."""

    @property
    def staleness(self) -> int:
        """Updates the gradient missed: ``server_version - worker_version``."""
        return self.server_version - self.worker_version


class StalenessController:
    """The server's version clock and the rule deciding when held pushes apply.

    The version counts applied updates. Each worker pulls parameters at some version
    (its *base*), computes a gradient on them and pushes it. The rule guarantees that
    every applied gradient is at most ``max_staleness`` versions old:

    - ``max_staleness=None`` (fully asynchronous): every push applies on arrival, alone.
    - otherwise the pending pushes with the oldest base apply together as one update,
      but only if, afterwards, no other active worker's base (the version it last
      pulled) is more than ``max_staleness`` versions behind. Workers that got ahead
      therefore wait -- their pull is answered once their push has applied -- until the
      slowest one pushes and pulls (stale synchronous parallel). A worker whose push
      has applied but who has not pulled yet still counts at its old base, so one fast
      worker cannot slip several updates in before the others have even read the last.
    - ``max_staleness=0`` is synchronous training: an update applies once every active
      worker has pushed a gradient computed on the current version, all of them
      together, so every update is the average over all workers in worker order.

    When every active worker holds a pending push the oldest ones can always apply, so
    the rule never deadlocks; a worker that stops pushing (or pulling) is caught by the
    timeout.
    """

    def __init__(self, num_workers: int, max_staleness: int | None) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if max_staleness is not None and (not isinstance(max_staleness, int)
                                          or isinstance(max_staleness, bool)
                                          or max_staleness < 0):
            raise ValueError(f"max_staleness must be None or an int >= 0, got {max_staleness!r}")
        self.num_workers = num_workers
        self.max_staleness = max_staleness
        self.version = 0
        self.log: list[VersionLogEntry] = []
        self._state = [WorkerState.COMPUTING] * num_workers
        self._base = [0] * num_workers
        self._arrival = [0] * num_workers
        self._arrivals = 0
        self._finishing: set[int] = set()
        self._unknown: set[int] = set()

    @classmethod
    def resume(cls, num_workers: int, max_staleness: int | None, version: int,
               log: Sequence[VersionLogEntry], done: Sequence[int]) -> StalenessController:
        """A clock continuing at ``version`` (a backup server taking a shard over).

        The workers in ``done`` have finished or were dropped. The others' bases (the
        version each last pulled) are unknown: each worker's next request reports it
        (``report_base``), and until every active worker has, no held push applies under
        a staleness bound -- a worker not yet heard from might be the slowest one.
        """
        clock = cls(num_workers, max_staleness)
        clock.version = version
        clock.log = list(log)
        for w in done:
            clock._state[w] = WorkerState.DONE
        clock._unknown = {w for w in range(num_workers) if w not in set(done)}
        return clock

    def base_known(self, worker: int) -> bool:
        """False on a resumed clock until ``worker`` has reported its base."""
        return worker not in self._unknown

    def report_base(self, worker: int, base: int) -> None:
        """Take ``worker``'s word for the version it last pulled (a resumed clock).

        The version must be one this clock has reached: every version a worker pulled was
        acknowledged by the backup before the worker saw it.
        """
        if worker not in self._unknown:
            return
        if not 0 <= base <= self.version:
            raise ParameterServerError(
                f"worker {worker} reports having pulled version {base}, but this server "
                f"is at version {self.version}")
        self._unknown.discard(worker)
        self._base[worker] = base
        self._state[worker] = WorkerState.COMPUTING

    def state(self, worker: int) -> WorkerState:
        return self._state[worker]

    def base(self, worker: int) -> int:
        """The version worker ``worker`` last pulled."""
        return self._base[worker]

    @property
    def active(self) -> list[int]:
        """Workers that have not finished."""
        return [w for w, s in enumerate(self._state) if s is not WorkerState.DONE]

    @property
    def all_done(self) -> bool:
        return all(s is WorkerState.DONE for s in self._state)

    @property
    def pending(self) -> list[int]:
        return [w for w, s in enumerate(self._state) if s is WorkerState.PENDING]

    @property
    def blocked(self) -> bool:
        """True when pushes are held back by a lagging worker."""
        return bool(self.pending) and self.next_update() is None

    def check_push(self, worker: int, base: int) -> None:
        """Raise ``ParameterServerError`` unless ``worker`` may push a gradient of ``base``."""
        state = self._state[worker]
        if state is WorkerState.DONE or worker in self._finishing:
            raise ParameterServerError(f"worker {worker} pushed after finishing")
        if state is WorkerState.PENDING:
            raise ParameterServerError(
                f"worker {worker} pushed again before its previous push was applied")
        if state is WorkerState.APPLIED and self.max_staleness is not None:
            raise ParameterServerError(
                f"worker {worker} pushed twice without pulling; with max_staleness="
                f"{self.max_staleness} every push must be followed by a pull")
        if base != self._base[worker]:
            raise ParameterServerError(
                f"worker {worker} pushed a gradient of version {base}, but the last "
                f"version it pulled is {self._base[worker]}")

    def on_push(self, worker: int, base: int) -> None:
        """Record a push of a gradient computed on version ``base`` (it is now pending).

        Call it only once the gradient has fully arrived: from here on, any state change
        may apply it.
        """
        self.check_push(worker, base)
        self._state[worker] = WorkerState.PENDING
        self._arrivals += 1
        self._arrival[worker] = self._arrivals

    def next_update(self) -> tuple[int, ...] | None:
        """The workers whose pending pushes apply next (as one update), or None to wait."""
        pending = self.pending
        if not pending:
            return None
        if self.max_staleness is None:
            return (min(pending, key=lambda w: self._arrival[w]),)
        if any(w in self._unknown for w in self.active):
            return None  # a resumed clock waits to hear where every worker is
        oldest = min(self._base[w] for w in pending)
        group = tuple(w for w in pending if self._base[w] == oldest)
        others = [self._base[w] for w, s in enumerate(self._state)
                  if w not in group and s is not WorkerState.DONE]
        if others and self.version + 1 - min(others) > self.max_staleness:
            return None
        return group

    def commit(self, workers: Sequence[int]) -> list[VersionLogEntry]:
        """Apply ``workers``' pending pushes as one update: log them, advance the version."""
        entries = []
        for w in workers:
            if self._state[w] is not WorkerState.PENDING:
                raise ParameterServerError(f"worker {w} has no pending push to apply")
            entry = VersionLogEntry(w, self._base[w], self.version)
            if self.max_staleness is not None and entry.staleness > self.max_staleness:
                raise ParameterServerError(
                    f"internal error: applying worker {w}'s push would exceed "
                    f"max_staleness={self.max_staleness} (staleness {entry.staleness})")
            entries.append(entry)
        for w in workers:
            if w in self._finishing:
                self._finishing.discard(w)
                self._state[w] = WorkerState.DONE
            else:
                self._state[w] = WorkerState.APPLIED
        self.version += 1
        self.log.extend(entries)
        return entries

    def can_pull(self, worker: int) -> bool:
        """A pull is answered once the worker's own push (if any) has applied."""
        return self._state[worker] is not WorkerState.PENDING

    def on_pull(self, worker: int) -> int:
        """Answer a pull: the worker now computes on the current version, returned."""
        state = self._state[worker]
        if state is WorkerState.DONE or worker in self._finishing:
            raise ParameterServerError(f"worker {worker} pulled after finishing")
        if state is WorkerState.PENDING:
            raise ParameterServerError(f"worker {worker} pulled while its push is pending")
        self._state[worker] = WorkerState.COMPUTING
        self._base[worker] = self.version
        return self.version

    def finish(self, worker: int) -> None:
        """The worker is done (or lost) and no longer holds the others back.

        A push it left pending still applies, under the usual rule (its gradient arrived
        whole, so it is a contribution like any other); the worker counts as done from
        then on.
        """
        self._unknown.discard(worker)
        if self._state[worker] is WorkerState.PENDING:
            self._finishing.add(worker)
        else:
            self._state[worker] = WorkerState.DONE

    @property
    def max_observed_staleness(self) -> int:
        return max((e.staleness for e in self.log), default=0)
