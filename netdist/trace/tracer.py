"""The trace of one rank: compact records while it runs, one Trace Event JSON at the end.

Tracing must cost the traced job almost nothing, so nothing is formatted while it runs:
a collective or a send/receive appends ten integers to an ``array('q')`` (about 0.3 us),
subsystem spans and connection events (rare) append a tuple. When the in-memory buffer
holds ``buffer_records`` records it is spilled, as raw bytes, to a side file next to the
trace, so memory stays bounded however long the job traces. ``finish()`` turns it all
into the rank's file ``rank_NNNNN.trace.json`` (written to a temporary name, then renamed,
so a reader never sees half a file): Trace Event Format, JSON object form, which Perfetto
and ``chrome://tracing`` open, with the netdist fields described in ``docs/tracing.md``.

Times are recorded as ``time.monotonic_ns()`` and written on the job's aligned clock
(``ClockAlignment``), in microseconds.
"""

from __future__ import annotations

import json
import os
import time
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from netdist.trace.clock import ClockAlignment

__all__ = ["TraceBuffer", "trace_file_name", "KIND_COLLECTIVE", "KIND_SEND", "KIND_RECV",
           "TID_COLLECTIVES", "TID_CONNECTIONS", "SPAN_TIDS", "RECV_TID_BASE",
           "SEND_TID_BASE"]

KIND_COLLECTIVE, KIND_SEND, KIND_RECV = 0, 1, 2
FIELDS = 10
"""Integers per record: kind, start, end, then seven that depend on the kind."""

TID_COLLECTIVES = 1
TID_CONNECTIONS = 2
SPAN_TIDS: dict[str, int] = {"ps": 3, "fsdp": 4, "pipeline": 5, "checkpoint": 6,
                             "elastic": 7, "user": 8}
"""The track (``tid``) of each subsystem's spans."""
RECV_TID_BASE = 1000
SEND_TID_BASE = 2000

_COLLECTIVE = ('{"ph":"X","cat":"collective","name":"%s","pid":%d,"tid":1,"ts":%.3f,'
               '"dur":%.3f,"args":{"group":"%s","group_size":%d,"group_rank":%d,"seq":%d,'
               '"bytes":%d,"route":"%s","state":"%s","waited_on":%d}}')
_P2P = ('{"ph":"X","cat":"p2p","name":"%s","pid":%d,"tid":%d,"ts":%.3f,"dur":%.3f,'
        '"args":{"peer":%d,"tag":%d,"bytes":%d,"wait_us":%.3f,"move_us":%.3f}}')


def trace_file_name(rank: int) -> str:
    """The file name of ``rank``'s trace in the trace directory."""
    return f"rank_{rank:05d}.trace.json"


class TraceBuffer:
    """Everything one rank traced between ``start`` and ``finish``."""

    def __init__(self, directory: Path, rank: int, world_size: int, job_id: str,
                 buffer_records: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.rank = rank
        self.world_size = world_size
        self.job_id = job_id
        self.records = array("q")
        self._limit = buffer_records * FIELDS
        self._spill_path = directory / f".rank_{rank:05d}.trace.spill"
        self._spill: IO[bytes] | None = None
        self._spilled = 0
        self.rare: list[tuple[Any, ...]] = []
        """Spans ``("X", cat, name, t0, t1, args)`` and instants ``("i", cat, name, t,
        args)``."""
        self._names: dict[str, int] = {}
        self._name_list: list[str] = []
        self.groups: dict[int, tuple[str, tuple[int, ...]]] = {}
        """Group index -> (group id as text, transport ranks)."""
        self._group_index: dict[int, int] = {}
        self.started_unix = time.time()
        self.started_ns = time.monotonic_ns()

    # -- recording (hot path) ------------------------------------------------------------

    def code(self, name: str) -> int:
        """A small integer standing for ``name`` in records."""
        found = self._names.get(name)
        if found is None:
            found = self._names[name] = len(self._name_list)
            self._name_list.append(name)
        return found

    def group_code(self, gid: int, ranks: tuple[int, ...]) -> int:
        """A small integer standing for the group ``gid`` in records."""
        found = self._group_index.get(gid)
        if found is None:
            found = self._group_index[gid] = len(self.groups)
            self.groups[found] = (f"{gid:#018x}", ranks)
        return found

    def collective(self, t0: int, t1: int, gid: int, ranks: tuple[int, ...], seq: int,
                   nbytes: int, op: str, route: str, state: str, waited_on: int) -> None:
        """Append one collective call (the hot path of a traced job: one method call, the
        names looked up in one dict)."""
        names = self._names
        group = self._group_index.get(gid)
        if group is None:
            group = self.group_code(gid, ranks)
        op_code = names.get(op)
        if op_code is None:
            op_code = self.code(op)
        route_code = names.get(route)
        if route_code is None:
            route_code = self.code(route)
        state_code = names.get(state)
        if state_code is None:
            state_code = self.code(state)
        records = self.records
        records.extend((KIND_COLLECTIVE, t0, t1, group, seq, nbytes, op_code, route_code,
                        state_code, waited_on))
        if len(records) >= self._limit:
            self._spill_now()

    def add(self, record: tuple[int, ...]) -> None:
        """Append one record of ``FIELDS`` integers; spill when the buffer is full."""
        records = self.records
        records.extend(record)
        if len(records) >= self._limit:
            self._spill_now()

    def _spill_now(self) -> None:
        if self._spill is None:
            self._spill = open(self._spill_path, "wb")
        self.records.tofile(self._spill)
        self._spilled += len(self.records) // FIELDS
        del self.records[:]

    # -- output --------------------------------------------------------------------------

    def _all_records(self) -> Iterator[array[int]]:
        """The records in order, a chunk at a time: spilled ones first."""
        if self._spill is not None:
            self._spill.flush()
            with open(self._spill_path, "rb") as spilled:
                while True:
                    chunk = array("q")
                    try:
                        chunk.fromfile(spilled, self._limit or FIELDS)
                    except EOFError:
                        pass  # the last, partial chunk was read into ``chunk``
                    if not chunk:
                        break
                    yield chunk
        yield self.records

    def finish(self, clock: ClockAlignment, host: str | None = None) -> Path:
        """Write ``rank_NNNNN.trace.json`` (aligned on ``clock``), drop the side file and
        the buffer; the file's path."""
        path = self.directory / trace_file_name(self.rank)
        temporary = path.with_name(path.name + ".tmp")
        written = 0
        with open(temporary, "w", encoding="utf-8") as out:
            out.write('{"traceEvents":[\n')
            for line in self._metadata(host):
                out.write(line)
                out.write(",\n")
            for lines in self._records_as_json(clock):
                for line in lines:
                    out.write(line)
                    out.write(",\n")
                    written += 1
            for line in self._rare_as_json(clock):
                out.write(line)
                out.write(",\n")
                written += 1
            # a last metadata event, so every event line above may end with a comma
            out.write(json.dumps({"ph": "M", "name": "process_sort_index", "pid": self.rank,
                                  "tid": 0, "args": {"sort_index": self.rank}}))
            other = {"format": "netdist-trace", "version": 1, "rank": self.rank,
                     "world_size": self.world_size, "job_id": self.job_id,
                     "host": host or os.uname().nodename, "pid": os.getpid(),
                     "clock": clock.describe(), "started_unix": self.started_unix,
                     "events": written, "dropped": 0}
            out.write('\n],"displayTimeUnit":"ms","otherData":')
            out.write(json.dumps(other))
            out.write("}\n")
        os.replace(temporary, path)
        self.discard()
        return path

    def discard(self) -> None:
        """Drop everything recorded (and the side file)."""
        if self._spill is not None:
            self._spill.close()
            self._spill = None
            self._spill_path.unlink(missing_ok=True)
        del self.records[:]
        self.rare.clear()

    def _metadata(self, host: str | None) -> Iterator[str]:
        pid = self.rank
        name = f"rank {self.rank} ({host or os.uname().nodename})"
        yield json.dumps({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                          "args": {"name": name}})
        tracks = {TID_COLLECTIVES: "collectives", TID_CONNECTIONS: "connections"}
        tracks.update({tid: cat for cat, tid in SPAN_TIDS.items()})
        for peer in range(self.world_size):
            if peer != self.rank:
                tracks[RECV_TID_BASE + peer] = f"recv from rank {peer}"
                tracks[SEND_TID_BASE + peer] = f"send to rank {peer}"
        for tid, label in tracks.items():
            yield json.dumps({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                              "args": {"name": label}})

    def _records_as_json(self, clock: ClockAlignment) -> Iterator[list[str]]:
        names = self._name_list
        groups = self.groups
        offset = clock.offset_ns
        pid = self.rank
        for chunk in self._all_records():
            lines = []
            for i in range(0, len(chunk) - FIELDS + 1, FIELDS):
                kind, t0, t1, a, b, c, d, e, f, g = chunk[i:i + FIELDS]
                ts = (t0 + offset) / 1000.0
                dur = max(t1 - t0, 0) / 1000.0
                if kind == KIND_COLLECTIVE:
                    gid_text, ranks = groups[a]
                    lines.append(_COLLECTIVE % (
                        names[d], pid, ts, dur, gid_text, len(ranks),
                        ranks.index(pid) if pid in ranks else -1, b, c, names[e], names[f],
                        g))
                else:
                    receive = kind == KIND_RECV
                    wait = min(max(d, 0), t1 - t0) / 1000.0
                    lines.append(_P2P % (
                        "recv" if receive else "send", pid,
                        (RECV_TID_BASE if receive else SEND_TID_BASE) + a, ts, dur, a, b, c,
                        wait, dur - wait))
            yield lines

    def _rare_as_json(self, clock: ClockAlignment) -> Iterator[str]:
        offset = clock.offset_ns
        for entry in self.rare:
            if entry[0] == "X":
                _, cat, name, t0, t1, args = entry
                yield json.dumps({"ph": "X", "cat": cat, "name": name, "pid": self.rank,
                                  "tid": SPAN_TIDS.get(cat, SPAN_TIDS["user"]),
                                  "ts": (t0 + offset) / 1000.0,
                                  "dur": max(t1 - t0, 0) / 1000.0, "args": _plain(args)})
            else:
                _, cat, name, t, args = entry
                yield json.dumps({"ph": "i", "s": "p", "cat": cat, "name": name,
                                  "pid": self.rank, "tid": TID_CONNECTIONS,
                                  "ts": (t + offset) / 1000.0, "args": _plain(args)})


def _plain(args: dict[str, Any]) -> dict[str, Any]:
    """``args`` with every value JSON can carry as is, the rest as text."""
    return {key: value if isinstance(value, (int, float, str, bool)) or value is None
            else str(value) for key, value in args.items()}
