"""Offline analysis of netdist traces and flight-recorder dumps (PURE: no asyncio, no socket).

Reads the files of trace format v1 (per-rank ``rank_*.trace.json``, ``flight_rank_*.json``
dumps) and answers the questions ``netdist trace`` asks:

* :func:`merge`: one Trace Event Format file of every rank, for chrome://tracing or
  Perfetto (the events are already on the job's aligned clock, ``pid`` = rank).
* :func:`summarize` / :func:`format_summary`: per collective kind and group, how many and
  how long; per collective, which rank arrived last and by how much; the stragglers
  (section 4 of the format); per link, bytes, messages and achieved bandwidth.
* :func:`explain`: from the flight-recorder dumps of a hung or failed job, one paragraph
  saying which rank stopped, in which operation the others were waiting for it, and the
  last operation it is known to have completed.

Every file problem is a :class:`~netdist.errors.TraceError` naming the file, so a
truncated dump from a killed rank gives one clear line instead of a ``KeyError``.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from netdist.errors import TraceError
from netdist.trace.stragglers import last_arrival
from netdist.trace.schema import (
    FLIGHT_FORMAT,
    FORMAT_VERSION,
    MERGED_FORMAT,
    TRACE_FORMAT,
    validate_flight,
    validate_netdist_trace,
)

__all__ = [
    "TRACE_GLOB",
    "FLIGHT_GLOB",
    "STRAGGLER_MIN_COLLECTIVES",
    "STRAGGLER_SHARE",
    "Clock",
    "RankTrace",
    "TraceSet",
    "CollectiveCall",
    "Arrival",
    "CollectiveStats",
    "Straggler",
    "LinkStats",
    "Summary",
    "FlightOp",
    "GroupProgress",
    "PeerState",
    "FlightDump",
    "load_trace_dir",
    "merge",
    "collective_calls",
    "arrivals",
    "summarize",
    "format_summary",
    "load_flight_dir",
    "explain",
]

TRACE_GLOB = "rank_*.trace.json"
FLIGHT_GLOB = "flight_rank_*.json"
_TRACE_NAME = re.compile(r"rank_(\d+)\.trace\.json")
_FLIGHT_NAME = re.compile(r"flight_rank_(\d+)\.json")

STRAGGLER_MIN_COLLECTIVES = 10
"""A rank is judged a straggler only over a window of at least this many collectives."""
STRAGGLER_SHARE = 0.5
"""... and only when it arrived last in at least this share of them."""


# --------------------------------------------------------------------------- loaded files

@dataclass(frozen=True)
class Clock:
    """A rank's offset to the reference rank's clock, measured at rendezvous."""

    offset_us: float
    error_us: float
    reference_rank: int


@dataclass
class RankTrace:
    """One ``rank_NNNNN.trace.json``: the rank's header and its events (aligned clock)."""

    path: str
    rank: int
    world_size: int
    clock: Clock
    events: list[dict[str, Any]]
    other_data: dict[str, Any]

    @property
    def dropped(self) -> int:
        """Events the recorder could not keep (its buffer cap)."""
        value = self.other_data.get("dropped", 0)
        return value if isinstance(value, int) else 0


@dataclass
class TraceSet:
    """The per-rank trace files of one job, by rank."""

    directory: str
    world_size: int
    ranks: dict[int, RankTrace]

    @property
    def present_ranks(self) -> list[int]:
        return sorted(self.ranks)

    @property
    def missing_ranks(self) -> list[int]:
        """Ranks of the job that left no trace file (killed, or never started)."""
        return [r for r in range(self.world_size) if r not in self.ranks]

    def events(self) -> list[dict[str, Any]]:
        """Every rank's events, rank by rank."""
        return [event for rank in self.present_ranks for event in self.ranks[rank].events]


def _read_json(path: Path, what: str) -> Any:
    """The JSON in ``path``; a missing, unreadable, empty or truncated file is a TraceError."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise TraceError(f"{what} {path} does not exist", str(path)) from None
    except OSError as exc:
        raise TraceError(f"cannot read {what} {path}: {exc.strerror or exc}", str(path)) from None
    if not text.strip():
        raise TraceError(f"{what} {path} is empty (the rank died while writing it?)", str(path))
    try:
        decoded = text.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceError(f"{what} {path} is not UTF-8 JSON (byte {exc.start})",
                         str(path)) from None
    try:
        return json.loads(decoded)
    except json.JSONDecodeError as exc:
        body = decoded.strip()
        cut = body[:1] in ("{", "[") and body[-1:] not in ("}", "]")
        hint = " (truncated?)" if cut else ""
        raise TraceError(f"{what} {path} is not valid JSON{hint}: {exc.msg} at line "
                         f"{exc.lineno} column {exc.colno}", str(path)) from None


def _reject(path: Path, what: str, problems: list[str]) -> TraceError:
    more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
    return TraceError(f"{path} is not a {what} (format v{FORMAT_VERSION}): "
                      f"{problems[0]}{more}", str(path))


def _clock(obj: Mapping[str, Any]) -> Clock:
    return Clock(float(obj["offset_us"]), float(obj["error_us"]),
                 int(obj.get("reference_rank", 0)))


def _numbered_files(directory: Path, glob: str, pattern: re.Pattern[str],
                    what: str) -> dict[int, Path]:
    """``{rank: path}`` of the files named ``pattern`` in ``directory``."""
    if not directory.exists():
        raise TraceError(f"{what} directory {directory} does not exist", str(directory))
    if not directory.is_dir():
        raise TraceError(f"{directory} is not a directory", str(directory))
    found: dict[int, Path] = {}
    for path in sorted(directory.glob(glob)):
        match = pattern.fullmatch(path.name)
        if match is None:
            continue
        rank = int(match.group(1))
        if rank in found:
            raise TraceError(f"{found[rank]} and {path} are both rank {rank}", str(path))
        found[rank] = path
    return found


def load_trace_dir(path: str | Path) -> TraceSet:
    """Read every ``rank_*.trace.json`` in ``path`` and check it against the format.

    Raises :class:`TraceError` naming the file when one is unreadable, truncated, not a
    netdist trace, or disagrees with its name or the other files (rank, world size), and
    when the directory holds none.
    """
    directory = Path(path)
    files = _numbered_files(directory, TRACE_GLOB, _TRACE_NAME, "trace")
    if not files:
        raise TraceError(f"no {TRACE_GLOB} files in {directory} (run the job with "
                         f"NETDIST_TRACE={directory})", str(directory))
    ranks: dict[int, RankTrace] = {}
    world_sizes: dict[int, Path] = {}
    for rank, file in files.items():
        obj = _read_json(file, "trace file")
        problems = validate_netdist_trace(obj)
        if not problems and obj["otherData"]["format"] != TRACE_FORMAT:
            problems = [f"otherData.format is {obj['otherData']['format']!r}, a per-rank "
                        f"file has {TRACE_FORMAT!r}"]
        if problems:
            raise _reject(file, "netdist per-rank trace", problems)
        other = obj["otherData"]
        if other["rank"] != rank:
            raise TraceError(f"{file} holds rank {other['rank']}, but its name says rank "
                             f"{rank}", str(file))
        world_sizes.setdefault(other["world_size"], file)
        ranks[rank] = RankTrace(str(file), rank, other["world_size"], _clock(other["clock"]),
                                obj["traceEvents"], other)
    if len(world_sizes) > 1:
        (a, fa), (b, fb) = sorted(world_sizes.items())[:2]
        raise TraceError(f"the trace files disagree on the world size: {fa} says {a}, "
                         f"{fb} says {b}", str(fb))
    world_size = next(iter(world_sizes))
    return TraceSet(str(directory), world_size, dict(sorted(ranks.items())))


def merge(trace_set: TraceSet) -> dict[str, Any]:
    """One Trace Event Format object of every rank's events (format section 2).

    The events are on the aligned clock already and ``pid`` = rank keeps the ranks apart,
    so merging is concatenation; ``otherData`` says which ranks are present, which are
    missing, and each rank's clock offset and error (the resolution of any comparison of
    times across ranks).
    """
    return {
        "traceEvents": trace_set.events(),
        "displayTimeUnit": "ms",
        "otherData": {
            "format": MERGED_FORMAT,
            "version": FORMAT_VERSION,
            "world_size": trace_set.world_size,
            "ranks": trace_set.present_ranks,
            "missing_ranks": trace_set.missing_ranks,
            "clocks": {str(rank): {"offset_us": trace.clock.offset_us,
                                   "error_us": trace.clock.error_us}
                       for rank, trace in trace_set.ranks.items()},
        },
    }


# --------------------------------------------------------------------------- collectives

@dataclass(frozen=True)
class CollectiveCall:
    """One rank's call of one collective: arrival (``ts``) and how long it took."""

    rank: int
    op: str
    group: str
    seq: int
    arrival_us: float
    dur_us: float
    bytes: int
    group_size: int
    state: str


@dataclass(frozen=True)
class Arrival:
    """One collective (``group``, ``seq``) across the ranks that recorded it.

    ``last_rank`` arrived last, ``late_by_us`` after the second-to-last (format section
    4); both are None when fewer than two ranks recorded it.
    """

    group: str
    seq: int
    op: str
    ranks: tuple[int, ...]
    group_size: int
    last_rank: int | None
    late_by_us: float | None


def collective_calls(events: Iterable[Mapping[str, Any]]) -> list[CollectiveCall]:
    """The collective events (``cat`` ``"collective"``, ``ph`` ``"X"``) of ``events``."""
    calls = []
    for event in events:
        if event.get("cat") != "collective" or event.get("ph") != "X":
            continue
        args = event["args"]
        calls.append(CollectiveCall(int(event["pid"]), str(event["name"]), str(args["group"]),
                                    int(args["seq"]), float(event["ts"]), float(event["dur"]),
                                    int(args["bytes"]), int(args["group_size"]),
                                    str(args.get("state", "ok"))))
    return calls


def arrivals(calls: Iterable[CollectiveCall]) -> list[Arrival]:
    """One :class:`Arrival` per (group, seq), in order of the collective's first arrival.

    Ties for last go to the lower rank (late by 0).
    """
    by_key: dict[tuple[str, int], list[CollectiveCall]] = defaultdict(list)
    for call in calls:
        by_key[(call.group, call.seq)].append(call)
    result = []
    for (group, seq), members in by_key.items():
        last_rank: int | None = None
        late_by: float | None = None
        if len(members) >= 2:
            last_rank, late_by = last_arrival({c.rank: c.arrival_us for c in members})
        op = next(c.op for c in members if c.rank == last_rank) if last_rank is not None \
            else members[0].op
        result.append(Arrival(group, seq, op, tuple(sorted(c.rank for c in members)),
                              max(c.group_size for c in members), last_rank, late_by))
    first = {key: min(c.arrival_us for c in members) for key, members in by_key.items()}
    result.sort(key=lambda a: (first[(a.group, a.seq)], a.group, a.seq))
    return result


# --------------------------------------------------------------------------- summary

@dataclass(frozen=True)
class CollectiveStats:
    """One collective kind in one group: how many, how long, how late the last rank was."""

    op: str
    group: str
    count: int
    calls: int
    mean_dur_us: float
    mean_late_by_us: float | None
    bytes: int


@dataclass(frozen=True)
class Straggler:
    """A rank that arrived last in ``last_in`` of the ``of`` collectives it took part in
    (>= ``STRAGGLER_SHARE`` of >= ``STRAGGLER_MIN_COLLECTIVES``), late by the median
    ``late_by_us`` of those."""

    rank: int
    last_in: int
    of: int
    median_late_by_us: float


@dataclass(frozen=True)
class LinkStats:
    """Traffic from rank ``src`` to rank ``dst``.

    ``messages``, ``bytes`` and ``move_us`` come from the receiver's ``recv`` events
    (``source`` ``"recv"``), or from the sender's ``send`` events when the receiver's
    file has none (``"send"``). ``bandwidth_Bps`` is bytes over the summed ``move_us``
    (how fast the bytes moved once they flowed); ``span_bandwidth_Bps`` is bytes over
    ``span_us``, from the first send (or first byte received) to the end of the last
    message on either side (what the link delivered over the run). None when the time
    is 0.
    """

    src: int
    dst: int
    messages: int
    bytes: int
    move_us: float
    span_us: float
    bandwidth_Bps: float | None
    span_bandwidth_Bps: float | None
    source: str


@dataclass
class Summary:
    """What :func:`summarize` found; :func:`format_summary` prints it, ``to_dict`` is JSON."""

    world_size: int
    ranks: list[int]
    missing_ranks: list[int]
    events: int
    dropped: dict[int, int]
    clock_error_us: float
    collectives: list[CollectiveStats]
    arrivals: list[Arrival]
    stragglers: list[Straggler]
    links: list[LinkStats]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (tuples become lists, dict keys strings)."""
        data = asdict(self)
        data["dropped"] = {str(rank): n for rank, n in self.dropped.items()}
        return data


def summarize(trace_set: TraceSet) -> Summary:
    """Collective statistics, last arrivals, stragglers and link bandwidth of a trace set."""
    calls = collective_calls(trace_set.events())
    found = arrivals(calls)
    return Summary(
        world_size=trace_set.world_size,
        ranks=trace_set.present_ranks,
        missing_ranks=trace_set.missing_ranks,
        events=sum(len(t.events) for t in trace_set.ranks.values()),
        dropped={rank: t.dropped for rank, t in trace_set.ranks.items() if t.dropped},
        clock_error_us=max(t.clock.error_us for t in trace_set.ranks.values()),
        collectives=_collective_stats(calls, found),
        arrivals=found,
        stragglers=_stragglers(found),
        links=_links(trace_set),
    )


def _collective_stats(calls: Sequence[CollectiveCall],
                      found: Sequence[Arrival]) -> list[CollectiveStats]:
    by_kind: dict[tuple[str, str], list[CollectiveCall]] = defaultdict(list)
    for call in calls:
        by_kind[(call.op, call.group)].append(call)
    late: dict[tuple[str, str], list[float]] = defaultdict(list)
    for arrival in found:
        if arrival.late_by_us is not None:
            late[(arrival.op, arrival.group)].append(arrival.late_by_us)
    stats = []
    for (op, group), members in sorted(by_kind.items()):
        lateness = late.get((op, group))
        stats.append(CollectiveStats(
            op, group, count=len({c.seq for c in members}), calls=len(members),
            mean_dur_us=statistics.fmean(c.dur_us for c in members),
            mean_late_by_us=statistics.fmean(lateness) if lateness else None,
            bytes=sum(c.bytes for c in members)))
    return stats


def _stragglers(found: Sequence[Arrival]) -> list[Straggler]:
    """Format section 4 over the whole trace as the window: ranks last in >= 50% of the
    >= 10 collectives (with two or more arrivals) they took part in."""
    taken: dict[int, int] = defaultdict(int)
    lateness: dict[int, list[float]] = defaultdict(list)
    for arrival in found:
        if arrival.last_rank is None or arrival.late_by_us is None:
            continue
        for rank in arrival.ranks:
            taken[rank] += 1
        lateness[arrival.last_rank].append(arrival.late_by_us)
    result = []
    for rank, late in sorted(lateness.items()):
        of = taken[rank]
        if of >= STRAGGLER_MIN_COLLECTIVES and len(late) >= STRAGGLER_SHARE * of:
            result.append(Straggler(rank, len(late), of, float(statistics.median(late))))
    result.sort(key=lambda s: (-s.last_in / s.of, -s.median_late_by_us, s.rank))
    return result


def _links(trace_set: TraceSet) -> list[LinkStats]:
    sends: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for event in trace_set.events():
        if event.get("cat") != "p2p" or event.get("ph") != "X":
            continue
        rank, peer = int(event["pid"]), int(event["args"]["peer"])
        if event.get("name") == "send":
            sends[(rank, peer)].append(event)
        elif event.get("name") == "recv":
            recvs[(peer, rank)].append(event)
    links = []
    for src, dst in sorted(set(sends) | set(recvs)):
        sent, received = sends.get((src, dst), []), recvs.get((src, dst), [])
        counted, source = (received, "recv") if received else (sent, "send")
        nbytes = sum(int(e["args"]["bytes"]) for e in counted)
        move_us = sum(float(e["args"]["move_us"]) for e in counted)
        starts = [float(e["ts"]) for e in sent]
        starts += [float(e["ts"]) + float(e["args"]["wait_us"]) for e in received]
        ends = [float(e["ts"]) + float(e["dur"]) for e in sent + received]
        span_us = max(ends) - min(starts)
        links.append(LinkStats(
            src, dst, len(counted), nbytes, move_us, span_us,
            bandwidth_Bps=nbytes / (move_us * 1e-6) if move_us > 0 else None,
            span_bandwidth_Bps=nbytes / (span_us * 1e-6) if span_us > 0 else None,
            source=source))
    return links


def _duration(us: float) -> str:
    if abs(us) < 1000:
        return f"{us:.1f} us"
    if abs(us) < 1_000_000:
        return f"{us / 1000:.1f} ms"
    return f"{us / 1_000_000:.2f} s"


def _size(n: float) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _rate(bps: float | None) -> str:
    if bps is None:
        return "-"
    if bps >= 1e9:
        return f"{bps / 1e9:.2f} GB/s"
    if bps >= 1e6:
        return f"{bps / 1e6:.1f} MB/s"
    return f"{bps / 1e3:.1f} kB/s"


def _ranks_text(ranks: Iterable[int]) -> str:
    """``rank 3``; ``ranks 0, 1 and 3``; runs of three or more as ``0-7``."""
    ordered = sorted(set(ranks))
    if len(ordered) == 1:
        return f"rank {ordered[0]}"
    runs: list[list[int]] = []
    for rank in ordered:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    parts: list[str] = []
    for run in runs:
        if len(run) >= 3:
            parts.append(f"{run[0]}-{run[-1]}")
        else:
            parts.extend(str(r) for r in run)
    text = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"ranks {text}"


def format_summary(summary: Summary) -> str:
    """The summary as readable text, the straggler verdict first."""
    lines = [f"trace of {len(summary.ranks)} of {summary.world_size} ranks, "
             f"{summary.events} events; clocks aligned to within "
             f"{_duration(summary.clock_error_us)}"]
    if summary.missing_ranks:
        lines.append(f"missing: {_ranks_text(summary.missing_ranks)} left no trace file")
    for rank, n in sorted(summary.dropped.items()):
        lines.append(f"dropped: rank {rank} dropped {n} events (recorder buffer full)")
    if summary.stragglers:
        for s in summary.stragglers:
            lines.append(f"straggler: rank {s.rank} arrived last in {s.last_in} of {s.of} "
                         f"collectives, late by {_duration(s.median_late_by_us)} (median)")
    else:
        lines.append(f"no straggler: no rank arrived last in >= {STRAGGLER_SHARE:.0%} of "
                     f">= {STRAGGLER_MIN_COLLECTIVES} collectives")
    if summary.collectives:
        lines.append("collectives:")
        for c in summary.collectives:
            late = ("" if c.mean_late_by_us is None
                    else f", last rank late by {_duration(c.mean_late_by_us)} (mean)")
            lines.append(f"  {c.op:<18} group {c.group}: {c.count} calls, mean "
                         f"{_duration(c.mean_dur_us)}{late}")
    else:
        lines.append("collectives: none recorded")
    if summary.links:
        lines.append("links:")
        for link in summary.links:
            lines.append(f"  {link.src} -> {link.dst}: {link.messages} messages, "
                         f"{_size(link.bytes)}, {_rate(link.bandwidth_Bps)} while moving, "
                         f"{_rate(link.span_bandwidth_Bps)} over {_duration(link.span_us)}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- flight dumps

@dataclass(frozen=True)
class FlightOp:
    """One recorded collective operation of a flight-recorder dump."""

    group: str
    seq: int
    op: str
    group_rank: int
    bytes: int
    route: str
    started_us: float
    ended_us: float | None
    state: str
    waited_on: int


@dataclass(frozen=True)
class GroupProgress:
    """Highest seq a rank entered (``started``) and finished (``completed``) in a group."""

    ranks: tuple[int, ...]
    started: int
    completed: int


@dataclass(frozen=True)
class PeerState:
    """What a rank knew of a peer when it dumped."""

    lost: bool
    reason: str | None
    last_heard_us: float | None
    heard_seq: dict[str, int] = field(default_factory=dict)


@dataclass
class FlightDump:
    """One ``flight_rank_NNNNN.json``."""

    path: str
    rank: int
    world_size: int
    now_us: float
    trigger: str
    error: dict[str, Any] | None
    groups: dict[str, GroupProgress]
    peers: dict[int, PeerState]
    operations: list[FlightOp]
    capacity: int
    recorded: int

    @property
    def current(self) -> list[FlightOp]:
        """The operations this rank was in when it dumped: those in flight, else the last
        one when it ended in an error or was cancelled (the one that raised)."""
        in_flight = [op for op in self.operations if op.state == "in_flight"]
        if in_flight:
            return in_flight
        if self.operations and self.operations[-1].state in ("error", "cancelled"):
            return [self.operations[-1]]
        return []


def _flight_dump(path: Path, obj: dict[str, Any]) -> FlightDump:
    groups = {gid: GroupProgress(tuple(g["ranks"]), g["started"], g["completed"])
              for gid, g in obj["groups"].items()}
    peers = {int(p): PeerState(bool(s["lost"]), s.get("reason"), s.get("last_heard_us"),
                               dict(s.get("heard_seq") or {}))
             for p, s in obj["peers"].items()}
    operations = [FlightOp(o["group"], o["seq"], o["op"], o["group_rank"], o["bytes"],
                           str(o.get("route", "")), float(o["started_us"]),
                           None if o["ended_us"] is None else float(o["ended_us"]),
                           o["state"], o["waited_on"])
                  for o in obj["operations"]]
    return FlightDump(str(path), obj["rank"], obj["world_size"], float(obj["now_us"]),
                      obj["trigger"], obj["error"], groups, peers, operations,
                      obj["capacity"], obj["recorded"])


def load_flight_dir(path: str | Path) -> list[FlightDump]:
    """Read every ``flight_rank_*.json`` in ``path``, by rank.

    Raises :class:`TraceError` naming the file for an unreadable, truncated or invalid
    dump or one whose rank disagrees with its name, and when there are no dumps.
    """
    directory = Path(path)
    files = _numbered_files(directory, FLIGHT_GLOB, _FLIGHT_NAME, "flight-recorder")
    if not files:
        raise TraceError(f"no flight-recorder dumps ({FLIGHT_GLOB}) in {directory}: ranks "
                         f"write them on a lost peer or a timeout in a collective, or on "
                         f"SIGUSR1", str(directory))
    dumps = []
    for rank, file in files.items():
        obj = _read_json(file, "flight-recorder dump")
        problems = validate_flight(obj)
        if problems:
            raise _reject(file, f"{FLIGHT_FORMAT} dump", problems)
        if obj["rank"] != rank:
            raise TraceError(f"{file} holds rank {obj['rank']}, but its name says rank "
                             f"{rank}", str(file))
        dumps.append(_flight_dump(file, obj))
    return dumps


_STATE_WORDS = {"in_flight": "in flight", "error": "failed", "ok": "completed",
                "cancelled": "cancelled"}


def _op_text(op: str | None, group: str, seq: int) -> str:
    return f"{op or 'collective'} seq {seq} of group {group}"


class _Evidence:
    """Indexes over a set of dumps that the explanation reads."""

    def __init__(self, dumps: Sequence[FlightDump]) -> None:
        self.dumps = {d.rank: d for d in dumps}
        self.members: dict[str, tuple[int, ...]] = {}
        for d in dumps:
            for gid, g in d.groups.items():
                self.members.setdefault(gid, g.ranks)
        self.names: dict[tuple[str, int], str] = {}
        for d in dumps:
            for op in d.operations:
                self.names.setdefault((op.group, op.seq), op.op)

    def name(self, group: str, seq: int) -> str | None:
        return self.names.get((group, seq))

    def current(self, d: FlightDump) -> list[tuple[str, int, str | None, FlightOp | None]]:
        """(group, seq, op, the recorded op) for each operation ``d`` was in: its in-flight
        ring entries, or a group it had started but not completed (ring overwritten)."""
        found: list[tuple[str, int, str | None, FlightOp | None]] = [
            (op.group, op.seq, op.op, op) for op in d.current]
        seen = {(g, s) for g, s, _, _ in found}
        for gid, g in sorted(d.groups.items()):
            if g.started > g.completed and (gid, g.started) not in seen:
                found.append((gid, g.started, self.name(gid, g.started), None))
        return found


def explain(dumps: Sequence[FlightDump], world_size: int | None = None) -> str:
    """One paragraph on where a hung or failed job stopped, from its flight-recorder dumps.

    Names the ranks that left no dump (or dumped but are behind the others), the
    operation (op, group, seq) the others were in and waiting on them for, whether the
    stopped rank ever joined it (``heard_seq``), who lost it and why, and the last
    operation it is known to have completed. When every rank dumped and none is behind,
    says where each is and whether they agree.
    """
    if not dumps:
        raise TraceError("no flight-recorder dumps to explain")
    sizes = {d.world_size for d in dumps}
    if len(sizes) > 1:
        raise TraceError(f"the dumps disagree on the world size ({sorted(sizes)})")
    world = world_size if world_size is not None else sizes.pop()
    outside = [d.rank for d in dumps if not 0 <= d.rank < world]
    if outside:
        raise TraceError(f"dump of rank {outside[0]} is outside world size {world}")
    ev = _Evidence(dumps)
    dumped = sorted(ev.dumps)
    missing = [r for r in range(world) if r not in ev.dumps]
    triggers = sorted({d.trigger for d in dumps})
    sentences: list[str] = []
    if missing:
        verb = "stopped: it left" if len(missing) == 1 else "stopped: they left"
        sentences.append(_sentence(
            f"{_ranks_text(missing)} {verb} no flight-recorder dump ({_ranks_text(dumped)} "
            f"did, trigger: {', '.join(triggers)})."))
        for rank in missing:
            sentences.extend(_explain_missing(ev, rank))
    behind = _behind(ev)
    for rank, lags in sorted(behind.items()):
        sentences.extend(_explain_behind(ev, rank, lags))
    sentences.extend(_explain_cycle(ev))
    if not missing and not behind:
        sentences.extend(_explain_agreeing(ev, world, triggers))
    return " ".join(sentences)


def _waiters(ev: _Evidence, rank: int, exclude: Iterable[int] = ()
             ) -> dict[tuple[str, int, str | None], list[tuple[FlightDump, FlightOp | None]]]:
    """The operations other dumped ranks were in, in groups that include ``rank``."""
    skip = set(exclude) | {rank}
    found: dict[tuple[str, int, str | None], list[tuple[FlightDump, FlightOp | None]]] = {}
    for d in ev.dumps.values():
        if d.rank in skip:
            continue
        for group, seq, name, op in ev.current(d):
            if rank in ev.members.get(group, ()):
                found.setdefault((group, seq, name), []).append((d, op))
    return found


def _explain_missing(ev: _Evidence, rank: int) -> list[str]:
    """Sentences on one rank that left no dump: where the others were waiting for it, and
    the last operation it is known to have completed."""
    out: list[str] = []
    lost_by = [d for d in ev.dumps.values()
               if (rank in d.peers and d.peers[rank].lost)
               or (d.error is not None and d.error.get("peer") == rank)]
    reasons = sorted({reason for d in lost_by
                      if rank in d.peers and (reason := d.peers[rank].reason)})
    lost = ""
    if lost_by:
        lost = (f"; {_ranks_text(d.rank for d in lost_by)} lost rank {rank}"
                + (f" ({'; '.join(reasons)})" if reasons else ""))
    waiting = _waiters(ev, rank)
    if not waiting:
        out.append(f"No rank that dumped was inside a collective with rank {rank}{lost}.")
    for (group, seq, name), holders in sorted(waiting.items(), key=lambda kv: kv[0][:2]):
        ranks = [d.rank for d, _ in holders]
        states = sorted({op.state if op is not None else "in_flight" for _, op in holders})
        longest = max((d.now_us - op.started_us for d, op in holders
                       if op is not None and op.state == "in_flight"), default=None)
        state = ", ".join(_STATE_WORDS.get(s, s) for s in states)
        if longest is not None:
            state += f" for {_duration(longest)}"
        waited = any(op is not None and op.waited_on == rank for _, op in holders)
        heard = [d.peers[rank].heard_seq[group] for d in ev.dumps.values()
                 if rank in d.peers and group in d.peers[rank].heard_seq]
        if heard and max(heard) >= seq:
            joined = (f"rank {rank} had joined it (a message of seq {max(heard)} arrived) "
                      f"but never finished it")
        elif heard:
            joined = (f"rank {rank} never joined it (its last message arrived for seq "
                      f"{max(heard)})")
        else:
            joined = f"rank {rank} never completed it"
        out.append(_sentence(
            f"{_ranks_text(ranks)} {'was' if len(ranks) == 1 else 'were'} in "
            f"{_op_text(name, group, seq)} ({state})"
            f"{f', waiting on rank {rank}' if waited else ''}; {joined}{lost}."))
        done = max((d.groups[group].completed for d in ev.dumps.values()
                    if group in d.groups), default=-1)
        done = min(done, seq - 1)
        if done >= 0:
            out.append(f"The last operation rank {rank} is known to have completed is "
                       f"{_op_text(ev.name(group, done), group, done)}.")
        else:
            out.append(f"Rank {rank} completed no operation of group {group}.")
    return out


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _behind(ev: _Evidence) -> dict[int, list[tuple[str, int, int]]]:
    """Dumped ranks that started an earlier seq of a group than another member:
    ``{rank: [(group, its started, the members' highest started), ...]}``."""
    behind: dict[int, list[tuple[str, int, int]]] = defaultdict(list)
    for group in sorted(ev.members):
        progress = {d.rank: d.groups[group].started for d in ev.dumps.values()
                    if group in d.groups}
        front = max(progress.values())
        for rank, started in sorted(progress.items()):
            if started < front:
                behind[rank].append((group, started, front))
    return dict(behind)


def _explain_behind(ev: _Evidence, rank: int, lags: list[tuple[str, int, int]]) -> list[str]:
    """Sentences on a rank that dumped but is behind the others: it is stuck elsewhere."""
    d = ev.dumps[rank]
    out = []
    for group, started, front in lags:
        where = (f"started only {_op_text(ev.name(group, started), group, started)}"
                 if started >= 0 else f"started no operation of group {group}")
        ahead = [r for r, other in ev.dumps.items()
                 if group in other.groups and other.groups[group].started == front]
        waiting = [w for (g, s, _), holders in _waiters(ev, rank).items() if g == group
                   for w, _ in holders]
        waits = (f"; {_ranks_text(w.rank for w in waiting)} "
                 f"{'is' if len(set(w.rank for w in waiting)) == 1 else 'are'} waiting on it"
                 if waiting else "")
        out.append(f"Rank {rank} is behind: it {where}, while {_ranks_text(ahead)} "
                   f"reached {_op_text(ev.name(group, front), group, front)}{waits}.")
    elsewhere = ev.current(d)
    if elsewhere:
        out.append(f"Rank {rank} is stuck elsewhere, in "
                   + "; ".join(_current_text(*entry) for entry in elsewhere) + ".")
        last = _last_done(d)
        if last:
            out.append(f"The last operation rank {rank} completed is {last}.")
    else:
        last = _last_done(d)
        after = f" after {last}" if last else ""
        out.append(f"Rank {rank} is in no collective{after}: it is stuck outside netdist's "
                   f"collectives (in its own code, I/O or another library).")
    return out


def _current_text(group: str, seq: int, name: str | None, op: FlightOp | None) -> str:
    """``all_reduce seq 42 of group 0x.. (in flight, waiting on rank 2)``."""
    text = _op_text(name, group, seq)
    if op is None:
        return text + " (started, not completed)"
    waited = f", waiting on rank {op.waited_on}" if op.waited_on >= 0 else ""
    return f"{text} ({_STATE_WORDS.get(op.state, op.state)}{waited})"


def _explain_cycle(ev: _Evidence) -> list[str]:
    """A sentence on ranks that wait on each other in a circle (a deadlock), if any: each
    dumped rank's first in-flight operation that names whom it waits on is an edge."""
    waits: dict[int, FlightOp] = {}
    for rank, d in sorted(ev.dumps.items()):
        for op in d.current:
            if op.state == "in_flight" and op.waited_on in ev.dumps and op.waited_on != rank:
                waits[rank] = op
                break
    for start in sorted(waits):
        path = [start]
        while (nxt := waits[path[-1]].waited_on) in waits and nxt not in path:
            path.append(nxt)
        if nxt not in path:
            continue
        cycle = path[path.index(nxt):]
        if min(cycle) != start:  # reported once, from its lowest rank
            continue
        parts = [f"rank {r} in {_op_text(waits[r].op, waits[r].group, waits[r].seq)} waits "
                 f"on rank {waits[r].waited_on}" for r in cycle]
        groups = {waits[r].group for r in cycle}
        why = (" the ranks called the collectives of these groups in different orders"
               if len(groups) > 1 else " they disagree on the order of the collectives")
        return [f"{_sentence(_ranks_text(cycle))} wait on each other, a deadlock: "
                f"{'; '.join(parts)} ({why.strip()})."]
    return []


def _last_done(d: FlightDump) -> str | None:
    done = [op for op in d.operations if op.state == "ok"]
    if not done:
        return None
    op = max(done, key=lambda o: (o.ended_us or o.started_us))
    return _op_text(op.op, op.group, op.seq)


def _explain_agreeing(ev: _Evidence, world: int, triggers: list[str]) -> list[str]:
    """Every rank dumped and none is behind: where each is, and whether they agree."""
    positions: dict[int, str] = {}
    for rank, d in sorted(ev.dumps.items()):
        current = ev.current(d)
        if current:
            positions[rank] = "in " + "; ".join(_current_text(*entry) for entry in current)
        else:
            last = _last_done(d)
            positions[rank] = f"in no collective (last completed: {last})" if last else \
                "in no collective (none recorded)"
    head = (f"All {world} ranks wrote a dump (trigger: {', '.join(triggers)}) and none is "
            f"behind another in any group.")
    distinct = sorted(set(positions.values()))
    if len(distinct) == 1:
        stuck = any(d.current for d in ev.dumps.values())
        tail = (" so no single rank stopped: the collective itself (or the network "
                "between the ranks) is stuck" if stuck else "")
        return [head, f"They agree: every rank is {distinct[0]}{',' if tail else ''}{tail}."]
    by_position: dict[str, list[int]] = defaultdict(list)
    for rank, text in positions.items():
        by_position[text].append(rank)
    parts = [f"{_ranks_text(ranks)} {'is' if len(ranks) == 1 else 'are'} {text}"
             for text, ranks in sorted(by_position.items(), key=lambda kv: kv[1][0])]
    return [head, "They do not agree: " + "; ".join(parts) + "."]
