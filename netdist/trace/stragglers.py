"""PURE: which rank keeps arriving last at the collectives of a group, and by how much.

The live straggler report (``netdist.trace.straggler_monitor``) feeds a
``StragglerWindow`` with arrivals: a rank issued call ``seq`` of group ``gid`` at a time on
the job's aligned clock. Once every member's arrival at ``(gid, seq)`` is known, the
collective is complete and is judged as ``docs/tracing.md`` defines it (trace format,
section 4): the last rank is the one that arrived latest, and it was late by its arrival
minus the second-latest arrival (the moment the rest of the group could have gone on
without it). A rank is a straggler of a group when it was last in at least ``share`` of the
group's recent collectives (a window of at least ``min_collectives``); its lateness is
the median ``late_by`` over the collectives where it was last.

A tie for last goes to the lower rank, late by 0, as the offline summary
(``netdist.trace.analysis.arrivals``) has it. Groups of one rank have no second arrival
and are not judged. Unlike that summary, which judges each rank over every collective of
the trace, the window judges each group on its own (a rank late in one group only is
named there).

Memory is bounded however long the job runs and whatever ranks fail to report: per group
the last ``window`` complete collectives and at most ``max_incomplete`` incomplete ones
(the oldest dropped first, counted in ``dropped``), and at most ``max_groups`` groups (the
one idle longest forgotten first).
"""

from __future__ import annotations

import heapq
import statistics
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

__all__ = ["Straggler", "StragglerWindow", "describe", "last_arrival", "DEFAULT_WINDOW",
           "DEFAULT_MAX_INCOMPLETE", "DEFAULT_MAX_GROUPS"]

T = TypeVar("T", int, float)

DEFAULT_WINDOW = 200
"""Complete collectives kept per group: the window the definition judges."""
DEFAULT_MAX_INCOMPLETE = 1024
"""Collectives per group still waiting for some member's arrival, at most."""
DEFAULT_MAX_GROUPS = 1024
"""Groups tracked at once, at most."""


@dataclass(frozen=True)
class Straggler:
    """A rank that arrived last at ``last_count`` of a group's last ``collectives``."""

    rank: int
    """Transport rank."""
    group: int
    """Group id (as ``Recorder.groups`` and the flight recorder name it)."""
    last_count: int
    collectives: int
    """Complete collectives of the group in the window."""
    median_late_ms: float
    """Median of ``late_by`` over the collectives where ``rank`` arrived last."""
    group_size: int = 0

    def describe(self) -> str:
        """One line: ``rank 2 arrived last at 48 of 50 collectives of group 0x... (4
        ranks), late by 50.3 ms (median)``."""
        return (f"rank {self.rank} arrived last at {self.last_count} of {self.collectives} "
                f"collectives of group {self.group:#018x} ({self.group_size} ranks), "
                f"late by {self.median_late_ms:.1f} ms (median)")


def describe(stragglers: Iterable[Straggler]) -> str:
    """One line per straggler (``Straggler.describe``)."""
    return "\n".join(straggler.describe() for straggler in stragglers)


@dataclass
class _Group:
    ranks: tuple[int, ...]
    members: frozenset[int]
    done: deque[tuple[int, int]]
    """(last rank, late_by ns) of the newest complete collectives."""
    pending: dict[int, dict[int, int]] = field(default_factory=dict)
    """seq -> {rank: arrival ns} of collectives not every member has reported yet."""


class StragglerWindow:
    """Arrivals in, stragglers out (see the module docstring); not thread-safe."""

    def __init__(self, window: int = DEFAULT_WINDOW,
                 max_incomplete: int = DEFAULT_MAX_INCOMPLETE,
                 max_groups: int = DEFAULT_MAX_GROUPS) -> None:
        for name, value in (("window", window), ("max_incomplete", max_incomplete),
                            ("max_groups", max_groups)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.window = window
        self.max_incomplete = max_incomplete
        self.max_groups = max_groups
        self._groups: OrderedDict[int, _Group] = OrderedDict()
        self.completed = 0
        """Collectives judged since the start."""
        self.dropped = 0
        """Incomplete collectives given up on (a member never reported, or too many)."""
        self.ignored = 0
        """Arrivals not taken: an unknown group, a rank not a member, a repeat."""

    def set_group(self, gid: int, ranks: Sequence[int]) -> None:
        """Declare group ``gid``'s member transport ranks (again: no change)."""
        if gid in self._groups:
            return
        members = tuple(int(rank) for rank in ranks)
        if len(set(members)) < 2:
            return  # one rank: nobody to arrive before it
        while len(self._groups) >= self.max_groups:
            _, forgotten = self._groups.popitem(last=False)
            self.dropped += len(forgotten.pending)
        self._groups[gid] = _Group(members, frozenset(members), deque(maxlen=self.window))

    def knows(self, gid: int) -> bool:
        """Whether group ``gid``'s members are known."""
        return gid in self._groups

    def arrive(self, gid: int, seq: int, rank: int, arrival_ns: int) -> bool:
        """Transport ``rank`` issued call ``seq`` of group ``gid`` at ``arrival_ns`` (the
        job's aligned clock); whether that completed the collective."""
        group = self._groups.get(gid)
        if group is None or rank not in group.members:
            self.ignored += 1
            return False
        self._groups.move_to_end(gid)
        arrivals = group.pending.get(seq)
        if arrivals is None:
            if len(group.pending) >= self.max_incomplete:
                del group.pending[next(iter(group.pending))]  # the oldest
                self.dropped += 1
            arrivals = group.pending[seq] = {}
        elif rank in arrivals:
            self.ignored += 1
            return False
        arrivals[rank] = arrival_ns
        if len(arrivals) < len(group.members):
            return False
        del group.pending[seq]
        group.done.append(last_arrival(arrivals))
        self.completed += 1
        return True

    def stragglers(self, min_collectives: int = 10, share: float = 0.5,
                   min_late_ms: float = 0.0) -> list[Straggler]:
        """Every rank that arrived last at ``share`` or more of its group's window of at
        least ``min_collectives`` complete collectives (and, with ``min_late_ms``, was
        late by at least that much in the median), group by group, most often last
        first."""
        found: list[Straggler] = []
        for gid, group in self._groups.items():
            total = len(group.done)
            if total < max(min_collectives, 1):
                continue
            late: dict[int, list[int]] = {}
            for last, late_by in group.done:
                late.setdefault(last, []).append(late_by)
            named = []
            for rank, lateness in late.items():
                if len(lateness) < share * total:
                    continue
                median_ms = statistics.median(lateness) / 1e6
                if median_ms < min_late_ms:
                    continue
                named.append(Straggler(rank, gid, len(lateness), total, median_ms,
                                       len(group.ranks)))
            found.extend(sorted(named, key=lambda s: (-s.last_count, s.rank)))
        return found

    def incomplete(self, gid: int) -> int:
        """Collectives of ``gid`` waiting for some member's arrival."""
        group = self._groups.get(gid)
        return 0 if group is None else len(group.pending)

    def complete(self, gid: int) -> int:
        """Complete collectives of ``gid`` in the window."""
        group = self._groups.get(gid)
        return 0 if group is None else len(group.done)


def last_arrival(arrivals: Mapping[int, T]) -> tuple[int, T]:
    """(last rank, late_by) of one collective from its members' arrival times (two or
    more, any unit): late_by is the last arrival minus the second latest, and a tie for
    last goes to the lower rank. The one definition the live report and the offline
    summary (``netdist.trace.analysis.arrivals``) share."""
    (last_rank, last), (_, second) = heapq.nlargest(2, arrivals.items(),
                                                    key=lambda item: (item[1], -item[0]))
    return last_rank, last - second
