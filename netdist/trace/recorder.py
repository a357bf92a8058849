"""``Recorder``: what one rank is doing, always (the flight recorder) and, when asked, in
full (the trace).

Every transport owns one (``Transport.recorder``); every ``Group`` over it reports each
collective call twice, at issue (``begin``) and when it returns (``end``). The flight
recorder keeps the last ``flight_records`` calls in a ring: a small list per call, no
formatting, no I/O, so it stays on in production. When a collective fails because a peer
was lost or a deadline expired, or on ``SIGUSR1``, the ring is written out as
self-describing JSON (``flight_rank_NNNNN.json``, see ``docs/tracing.md``): which
operation of which group this rank was in, which sequence number it had reached in every
group, whom it was waiting for and which peers its transport knew were gone. The
survivors' dumps together say who stopped where (``netdist trace why``).

While tracing (``NETDIST_TRACE=DIR`` from the start, or ``start_trace``/``stop_trace`` at
run time) the same calls, every send and receive of the TCP transport, subsystem spans
(``span``) and connection events (``instant``) are recorded too (``TraceBuffer``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from netdist.trace.clock import ClockAlignment
from netdist.trace.settings import TraceSettings
from netdist.trace.tracer import TraceBuffer

__all__ = ["Recorder", "flight_file_name", "OpState", "ERROR_DUMP_INTERVAL", "ROUTE_FIELD"]

logger = logging.getLogger("netdist.trace")

ERROR_DUMP_INTERVAL = 2.0
"""Seconds after an error dump during which further errors write none: the first failure
of a burst is the informative one, the rest are its consequences."""


class OpState:
    """The states of a recorded call (plain strings: they go into JSON as they are)."""

    IN_FLIGHT = "in_flight"
    OK = "ok"
    ERROR = "error"
    CANCELLED = "cancelled"


# positions in a flight record (a list, the cheapest mutable record Python has)
_GID, _SEQ, _OP, _GROUP_RANK, _BYTES, _ROUTE, _T0, _T1, _STATE, _WAITED = range(10)
ROUTE_FIELD = _ROUTE
"""Where a record holds its route: a call whose turn settles the algorithm sets it."""


def flight_file_name(rank: int) -> str:
    """The file name of ``rank``'s flight-recorder dump."""
    return f"flight_rank_{rank:05d}.json"


class Recorder:
    """The flight recorder and the trace of one rank (one transport)."""

    def __init__(self, rank: int, world_size: int, job_id: str = "netdist",
                 settings: TraceSettings | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.job_id = job_id
        self.settings = TraceSettings.from_env() if settings is None else settings
        self.clock = ClockAlignment(reference_rank=rank)
        """This rank's clock against the job's (set at rendezvous)."""
        self.ring: deque[list[Any]] = deque(maxlen=self.settings.flight_records)
        self.recorded = 0
        """Collective calls recorded since the start (the ring keeps the newest)."""
        self.groups: dict[int, tuple[int, ...]] = {}
        """Group id -> transport ranks, of every group made over the transport."""
        self.trace: TraceBuffer | None = None
        """The trace being recorded, or ``None``."""
        self.peer_status: Callable[[], dict[int, str]] = dict
        """Set by the transport: the peers it knows are gone, each with why."""
        self.on_end: Callable[[list[Any]], None] | None = None
        """Called with each finished call's record (the live straggler report)."""
        self.wait_ns = [0] * world_size
        """Per transport rank: nanoseconds this rank's collectives spent whose last wait
        was for that rank (the call's whole duration is counted against it)."""
        self.waits = [0] * world_size
        """Per transport rank: collectives whose last wait was for that rank."""
        self._last_error_dump = -ERROR_DUMP_INTERVAL
        self.last_dump: Path | None = None
        self.dumps = 0
        """Flight-recorder dumps written so far."""

    # -- collectives (hot path) ----------------------------------------------------------

    def register_group(self, gid: int, ranks: tuple[int, ...]) -> None:
        """Make the group ``gid`` (transport ``ranks``) known, once, before its calls."""
        self.groups[gid] = ranks

    def begin(self, gid: int, seq: int, op: str, group_rank: int, nbytes: int,
              route: str) -> list[Any]:
        """Record a call of the registered group ``gid`` as it is issued; the record to
        pass to ``end``."""
        record = [gid, seq, op, group_rank, nbytes, route, time.monotonic_ns(), 0,
                  OpState.IN_FLIGHT, -1]
        self.ring.append(record)
        self.recorded += 1
        return record

    def end(self, record: list[Any], state: str, waited_on: int = -1) -> None:
        """Record that the call of ``record`` returned (``state``), having last waited for
        transport rank ``waited_on`` (-1: none)."""
        ended = record[_T1] = time.monotonic_ns()
        record[_STATE] = state
        record[_WAITED] = waited_on
        if waited_on >= 0:
            self.wait_ns[waited_on] += ended - record[_T0]
            self.waits[waited_on] += 1
        trace = self.trace
        if trace is not None:
            gid = record[_GID]
            trace.collective(record[_T0], ended, gid, self.groups[gid], record[_SEQ],
                             record[_BYTES], record[_OP], record[_ROUTE], state, waited_on)
        if self.on_end is not None:
            self.on_end(record)

    # -- spans and events (rare) ---------------------------------------------------------

    @contextlib.contextmanager
    def span(self, cat: str, name: str, **args: Any) -> Iterator[dict[str, Any]]:
        """Trace the block as one span of subsystem ``cat`` (``"ps"``, ``"fsdp"``,
        ``"pipeline"``, ``"checkpoint"``, ...); the block may add to the dict it gets,
        which becomes the span's ``args``. Free when not tracing."""
        trace = self.trace
        if trace is None:
            yield args
            return
        started = time.monotonic_ns()
        try:
            yield args
        finally:
            trace.rare.append(("X", cat, name, started, time.monotonic_ns(), args))

    def instant(self, cat: str, name: str, **args: Any) -> None:
        """Trace one event at this moment (a connection made, a peer lost, ...)."""
        trace = self.trace
        if trace is not None:
            trace.rare.append(("i", cat, name, time.monotonic_ns(), args))

    # -- tracing on and off --------------------------------------------------------------

    def start_trace(self, directory: str | os.PathLike[str] | None = None) -> Path:
        """Start tracing into ``directory`` (default: ``NETDIST_TRACE``); its path. A trace
        already running goes on (same directory) or is an error (another one)."""
        target = Path(directory) if directory is not None else self.settings.trace_dir
        if target is None:
            raise ValueError("start_trace needs a directory (or NETDIST_TRACE)")
        if self.trace is not None:
            if self.trace.directory != target:
                raise RuntimeError(f"rank {self.rank} is already tracing into "
                                   f"{self.trace.directory}")
            return target
        self.trace = TraceBuffer(target, self.rank, self.world_size, self.job_id,
                                 self.settings.trace_buffer)
        return target

    def stop_trace(self) -> Path | None:
        """Stop tracing and write this rank's trace file; its path (``None``: not
        tracing)."""
        trace, self.trace = self.trace, None
        if trace is None:
            return None
        return trace.finish(self.clock)

    # -- the flight recorder's dump ------------------------------------------------------

    def failed(self, error: BaseException) -> Path | None:
        """A collective failed with ``error`` (a lost peer or an expired deadline): dump
        the flight recorder, unless an error dump was written moments ago."""
        now = time.monotonic()
        if now - self._last_error_dump < ERROR_DUMP_INTERVAL or self.settings.flight_records == 0:
            return None
        self._last_error_dump = now
        return self.dump("error", error)

    def dump(self, trigger: str, error: BaseException | None = None,
             directory: str | os.PathLike[str] | None = None) -> Path | None:
        """Write the flight recorder to ``flight_rank_NNNNN.json`` in ``directory``
        (default ``TraceSettings.dump_dir``); its path, or ``None`` if it could not be
        written (logged: a full disk must not turn a clear error into another one)."""
        target = Path(directory) if directory is not None else self.settings.dump_dir(
            self.job_id)
        try:
            target.mkdir(parents=True, exist_ok=True)
            path = target / flight_file_name(self.rank)
            temporary = path.with_name(path.name + f".{os.getpid()}.tmp")
            temporary.write_text(json.dumps(self.snapshot(trigger, error), indent=1),
                                 encoding="utf-8")
            os.replace(temporary, path)
        except OSError as exc:
            logger.warning("netdist: rank %d could not write its flight record to %s: %s",
                           self.rank, target, exc)
            return None
        self.last_dump = path
        self.dumps += 1
        logger.warning("netdist: rank %d wrote its flight record (%s) to %s", self.rank,
                       trigger, path)
        return path

    def snapshot(self, trigger: str, error: BaseException | None = None) -> dict[str, Any]:
        """The flight recorder as the JSON object ``dump`` writes."""
        records = list(self.ring)  # one C call: no other thread mutates it meanwhile
        offset = self.clock.offset_ns
        groups: dict[str, dict[str, Any]] = {}
        for gid, ranks in list(self.groups.items()):
            groups[f"{gid:#018x}"] = {"ranks": list(ranks), "started": -1, "completed": -1}
        operations = []
        for record in records:
            entry = groups[f"{record[_GID]:#018x}"]
            entry["started"] = max(entry["started"], record[_SEQ])
            if record[_STATE] == OpState.OK:
                entry["completed"] = max(entry["completed"], record[_SEQ])
            operations.append({
                "group": f"{record[_GID]:#018x}", "seq": record[_SEQ], "op": record[_OP],
                "group_rank": record[_GROUP_RANK], "bytes": record[_BYTES],
                "route": record[_ROUTE], "started_us": (record[_T0] + offset) / 1000.0,
                "ended_us": (record[_T1] + offset) / 1000.0 if record[_T1] else None,
                "state": record[_STATE], "waited_on": record[_WAITED]})
        peers = {str(peer): {"lost": True, "reason": reason}
                 for peer, reason in sorted(self.peer_status().items())}
        return {
            "format": "netdist-flight", "version": 1, "rank": self.rank,
            "world_size": self.world_size, "job_id": self.job_id,
            "host": os.uname().nodename, "pid": os.getpid(), "written_unix": time.time(),
            "now_us": (time.monotonic_ns() + offset) / 1000.0,
            "clock": self.clock.describe(), "trigger": trigger,
            "error": None if error is None else {
                "type": type(error).__name__, "message": str(error),
                "peer": getattr(error, "rank", None)},
            "capacity": self.settings.flight_records, "recorded": self.recorded,
            "groups": groups, "peers": peers, "operations": operations}
