"""Validators for trace files and flight-recorder dumps (PURE: no asyncio, no socket).

Three layers, each returning every problem it finds as one line (an empty list means
valid), so a bad file is reported in full instead of by its first ``KeyError``:

* :func:`validate_trace`: the Trace Event Format, JSON Object Format (the format
  chrome://tracing and Perfetto load). The rules follow the format's definition
  (docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU): the object
  needs ``traceEvents``; ``displayTimeUnit`` is ``"ms"`` or ``"ns"``; each event has a
  one-character phase ``ph`` from the format's phase table, ``pid`` and ``tid``, and the
  fields its phase requires (``dur`` for complete events, ``id`` for async, flow and
  object events, a series of numbers in ``args`` for counters, ``args`` naming the
  process or thread for metadata events, which alone carry no timestamp).
* :func:`validate_netdist_trace`: additionally the netdist fields of the per-rank and
  merged files (``otherData``, the collective, p2p and connection events); see
  ``docs`` trace format v1, sections 1 and 2.
* :func:`validate_flight`: a flight-recorder dump (section 3).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, TypeGuard

__all__ = [
    "PHASES",
    "METADATA_NAMES",
    "COLLECTIVE_OPS",
    "TRACE_FORMAT",
    "MERGED_FORMAT",
    "FLIGHT_FORMAT",
    "FORMAT_VERSION",
    "validate_trace",
    "validate_netdist_trace",
    "validate_flight",
]

PHASES: dict[str, str] = {
    "B": "duration begin", "E": "duration end",
    "X": "complete",
    "i": "instant", "I": "instant (deprecated)",
    "C": "counter",
    "b": "async nestable begin", "n": "async nestable instant", "e": "async nestable end",
    "S": "async begin (deprecated)", "T": "async step into (deprecated)",
    "p": "async step past (deprecated)", "F": "async end (deprecated)",
    "s": "flow begin", "t": "flow step", "f": "flow end",
    "P": "sample",
    "N": "object created", "O": "object snapshot", "D": "object destroyed",
    "M": "metadata",
    "V": "memory dump (global)", "v": "memory dump (process)",
    "R": "mark",
    "c": "clock sync",
    "(": "context begin", ")": "context end",
    "=": "linked id",
}
"""Every phase of the Trace Event Format's event table, with what it marks."""

_NEEDS_ID = frozenset("bneSTpFstfNOD=")
"""Async, flow, object and linked-id events are matched by ``id`` (or ``id2``)."""

_INSTANT_SCOPES = ("g", "p", "t")

METADATA_NAMES: dict[str, tuple[str, type]] = {
    "process_name": ("name", str),
    "process_labels": ("labels", str),
    "process_sort_index": ("sort_index", int),
    "thread_name": ("name", str),
    "thread_sort_index": ("sort_index", int),
}
"""Metadata event names and the ``args`` field each must carry, with its type."""

TRACE_FORMAT = "netdist-trace"
MERGED_FORMAT = "netdist-trace-merged"
FLIGHT_FORMAT = "netdist-flight"
FORMAT_VERSION = 1

COLLECTIVE_OPS = frozenset({
    "all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "gather",
    "scatter", "all_to_all", "barrier", "monitored_barrier", "all_gather_object",
    "broadcast_object",
})
_COLLECTIVE_STATES = frozenset({"ok", "error", "cancelled"})
_FLIGHT_STATES = frozenset({"ok", "in_flight", "error", "cancelled"})
_P2P_NAMES = frozenset({"send", "recv"})
_CONNECTION_NAMES = frozenset({"connect", "accept", "heartbeat_gap", "lost", "closed"})
_TRIGGERS = frozenset({"error", "signal", "api"})
_GROUP_ID = re.compile(r"0x[0-9a-f]{16}")

_MAX_PROBLEMS = 200
"""A file with thousands of bad events is reported by its first ones, then a count."""


# --------------------------------------------------------------------------- helpers

def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


class _Problems:
    """Collects problem lines, up to ``_MAX_PROBLEMS`` and a count of the rest."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.more = 0

    def add(self, line: str) -> None:
        if len(self.lines) < _MAX_PROBLEMS:
            self.lines.append(line)
        else:
            self.more += 1

    def result(self) -> list[str]:
        tail = [f"... and {self.more} more problems"] if self.more else []
        return self.lines + tail

    def need_int(self, where: str, obj: Mapping[str, Any], key: str, *,
                 minimum: int | None = None) -> None:
        if key not in obj:
            self.add(f"{where}: missing {key!r}")
        elif not _is_int(obj[key]):
            self.add(f"{where}: {key!r} must be an integer, got {_type_name(obj[key])}")
        elif minimum is not None and obj[key] < minimum:
            self.add(f"{where}: {key!r} must be >= {minimum}, got {obj[key]}")

    def need_number(self, where: str, obj: Mapping[str, Any], key: str, *,
                    minimum: float | None = None, nullable: bool = False) -> None:
        if key not in obj:
            self.add(f"{where}: missing {key!r}")
        elif obj[key] is None and nullable:
            return
        elif not _is_number(obj[key]):
            self.add(f"{where}: {key!r} must be a finite number, got "
                     f"{_type_name(obj[key])}")
        elif minimum is not None and obj[key] < minimum:
            self.add(f"{where}: {key!r} must be >= {minimum:g}, got {obj[key]!r}")

    def need_str(self, where: str, obj: Mapping[str, Any], key: str, *,
                 choices: frozenset[str] | None = None) -> None:
        if key not in obj:
            self.add(f"{where}: missing {key!r}")
        elif not isinstance(obj[key], str):
            self.add(f"{where}: {key!r} must be a string, got {_type_name(obj[key])}")
        elif choices is not None and obj[key] not in choices:
            self.add(f"{where}: {key!r} is {obj[key]!r}, not one of {sorted(choices)}")

    def need_dict(self, where: str, obj: Mapping[str, Any], key: str) -> dict[str, Any] | None:
        if key not in obj:
            self.add(f"{where}: missing {key!r}")
            return None
        value = obj[key]
        if not isinstance(value, dict):
            self.add(f"{where}: {key!r} must be an object, got {_type_name(value)}")
            return None
        return value


def _event_where(index: int, event: Mapping[str, Any]) -> str:
    name = event.get("name")
    return f"traceEvents[{index}]" + (f" ({name})" if isinstance(name, str) else "")


# --------------------------------------------------------------------------- Trace Event Format

def validate_trace(obj: object) -> list[str]:
    """Every way ``obj`` breaks the Trace Event Format's JSON Object Format (empty: valid).

    Checks the container (``traceEvents`` a list, ``displayTimeUnit``, ``otherData``,
    ``stackFrames``, ``samples``, ``systemTraceEvents``) and each event by its phase.
    """
    problems = _Problems()
    _check_trace(obj, problems)
    return problems.result()


def _check_trace(obj: object, problems: _Problems) -> list[dict[str, Any]]:
    """Checks the container and every event; returns the events that are objects."""
    if not isinstance(obj, dict):
        problems.add(f"the trace must be a JSON object (Object Format), got {_type_name(obj)}")
        return []
    if "displayTimeUnit" in obj and obj["displayTimeUnit"] not in ("ms", "ns"):
        problems.add(f"displayTimeUnit must be \"ms\" or \"ns\", got {obj['displayTimeUnit']!r}")
    for key, kind, label in (("otherData", dict, "an object"),
                             ("stackFrames", dict, "an object"),
                             ("samples", list, "a list"),
                             ("systemTraceEvents", str, "a string")):
        if key in obj and not isinstance(obj[key], kind):
            problems.add(f"{key} must be {label}, got {_type_name(obj[key])}")
    if "traceEvents" not in obj:
        problems.add("missing 'traceEvents'")
        return []
    events = obj["traceEvents"]
    if not isinstance(events, list):
        problems.add(f"'traceEvents' must be a list, got {_type_name(events)}")
        return []
    good: list[dict[str, Any]] = []
    for index, event in enumerate(events):
        if not isinstance(event, dict):
            problems.add(f"traceEvents[{index}]: an event must be an object, got "
                         f"{_type_name(event)}")
            continue
        _check_event(index, event, problems)
        good.append(event)
    return good


def _check_event(index: int, event: Mapping[str, Any], problems: _Problems) -> None:
    where = _event_where(index, event)
    ph = event.get("ph")
    if "ph" not in event:
        problems.add(f"{where}: missing 'ph'")
        return
    if not isinstance(ph, str) or ph not in PHASES:
        problems.add(f"{where}: 'ph' {ph!r} is not a Trace Event Format phase")
        return
    # name: every event is named except an end event, which closes the open begin
    if "name" in event or ph != "E":
        problems.need_str(where, event, "name")
    for key in ("cat", "cname"):
        if key in event and not isinstance(event[key], str):
            problems.add(f"{where}: {key!r} must be a string, got {_type_name(event[key])}")
    problems.need_int(where, event, "pid")
    problems.need_int(where, event, "tid")
    if ph != "M" or "ts" in event:  # metadata events alone carry no timestamp
        problems.need_number(where, event, "ts", minimum=0)
    if "tts" in event:
        problems.need_number(where, event, "tts", minimum=0)
    args = event.get("args")
    if "args" in event and not isinstance(args, dict):
        problems.add(f"{where}: 'args' must be an object, got {_type_name(args)}")
        args = None
    if "sf" in event and "stack" in event:
        problems.add(f"{where}: 'sf' and 'stack' are mutually exclusive")
    if ph == "X":
        problems.need_number(where, event, "dur", minimum=0)
        if "tdur" in event:
            problems.need_number(where, event, "tdur", minimum=0)
    elif ph in ("i", "I"):
        if "s" in event and event["s"] not in _INSTANT_SCOPES:
            problems.add(f"{where}: instant scope 's' must be one of "
                         f"{list(_INSTANT_SCOPES)}, got {event['s']!r}")
    elif ph == "C":
        _check_counter(where, event, args, problems)
    elif ph == "M":
        _check_metadata(where, event, args, problems)
    if ph in _NEEDS_ID:
        _check_id(where, event, problems)
    if ph in "stf" and "bp" in event and event["bp"] != "e":
        problems.add(f"{where}: flow binding point 'bp' must be \"e\", got {event['bp']!r}")


def _check_counter(where: str, event: Mapping[str, Any], args: dict[str, Any] | None,
                   problems: _Problems) -> None:
    if "args" not in event:
        problems.add(f"{where}: a counter event needs 'args' with its series values")
        return
    if args is None:
        return
    for series, value in args.items():
        if not _is_number(value):
            problems.add(f"{where}: counter series {series!r} must be a number, got "
                         f"{_type_name(value)}")


def _check_metadata(where: str, event: Mapping[str, Any], args: dict[str, Any] | None,
                    problems: _Problems) -> None:
    name = event.get("name")
    if not isinstance(name, str):
        return  # already reported
    if name not in METADATA_NAMES:
        problems.add(f"{where}: metadata name {name!r} is not one of {sorted(METADATA_NAMES)}")
        return
    field, kind = METADATA_NAMES[name]
    if "args" not in event:
        problems.add(f"{where}: metadata event {name} needs 'args' with {field!r}")
        return
    if args is None:
        return
    if field not in args:
        problems.add(f"{where}: metadata event {name} needs args.{field}")
    elif not isinstance(args[field], kind) or isinstance(args[field], bool):
        problems.add(f"{where}: args.{field} of {name} has the wrong type "
                     f"({_type_name(args[field])})")


def _check_id(where: str, event: Mapping[str, Any], problems: _Problems) -> None:
    if "id" in event:
        if not (_is_int(event["id"]) or isinstance(event["id"], str)):
            problems.add(f"{where}: 'id' must be a string or an integer, got "
                         f"{_type_name(event['id'])}")
    elif "id2" in event:
        id2 = event["id2"]
        if not (isinstance(id2, dict) and len(id2) == 1
                and next(iter(id2)) in ("local", "global")):
            problems.add(f"{where}: 'id2' must be {{\"local\": id}} or {{\"global\": id}}")
    else:
        problems.add(f"{where}: phase {event['ph']!r} ({PHASES[event['ph']]}) needs an 'id'")


# --------------------------------------------------------------------------- netdist traces

def validate_netdist_trace(obj: object) -> list[str]:
    """:func:`validate_trace` plus the netdist fields (trace format v1, sections 1-2).

    A per-rank file (``otherData.format == "netdist-trace"``) must carry its rank, world
    size and clock, and every event's ``pid`` is that rank; a merged file
    (``"netdist-trace-merged"``) lists its ranks and their clocks, and every event's
    ``pid`` is one of them. Collective, p2p and connection events must carry the fields
    the analysis reads.
    """
    problems = _Problems()
    events = _check_trace(obj, problems)
    if not isinstance(obj, dict):
        return problems.result()
    other = obj.get("otherData")
    if not isinstance(other, dict):
        if "otherData" not in obj:
            problems.add("missing 'otherData' (the netdist header)")
        return problems.result()
    where = "otherData"
    problems.need_str(where, other, "format", choices=frozenset({TRACE_FORMAT, MERGED_FORMAT}))
    _check_version(where, other, problems)
    problems.need_int(where, other, "world_size", minimum=1)
    pids: frozenset[int] | None = None
    world = _world_size(other)
    if other.get("format") == TRACE_FORMAT:
        problems.need_int(where, other, "rank", minimum=0)
        rank = other.get("rank")
        if _is_int(rank) and world is not None and not 0 <= rank < world:
            problems.add(f"{where}: rank {rank} is not below world_size {world}")
            rank = None
        clock = problems.need_dict(where, other, "clock")
        if clock is not None:
            _check_clock(f"{where}.clock", clock, problems, reference=True)
        for key in ("events", "dropped"):
            if key in other:
                problems.need_int(where, other, key, minimum=0)
        if _is_int(rank) and rank >= 0:
            pids = frozenset({rank})
    elif other.get("format") == MERGED_FORMAT:
        pids = _check_merged_header(where, other, world, problems)
    for index, event in enumerate(events):
        _check_netdist_event(index, event, pids, problems)
    return problems.result()


def _world_size(obj: Mapping[str, Any]) -> int | None:
    """The header's world size when it is a valid one (else other checks would cascade)."""
    world = obj.get("world_size")
    return world if _is_int(world) and world >= 1 else None


def _check_version(where: str, obj: Mapping[str, Any], problems: _Problems) -> None:
    problems.need_int(where, obj, "version")
    version = obj.get("version")
    if _is_int(version) and version != FORMAT_VERSION:
        problems.add(f"{where}: version {version} is not {FORMAT_VERSION} (this netdist "
                     f"reads format version {FORMAT_VERSION} only)")


def _check_clock(where: str, clock: Mapping[str, Any], problems: _Problems, *,
                 reference: bool) -> None:
    problems.need_number(where, clock, "offset_us")
    problems.need_number(where, clock, "error_us", minimum=0)
    if reference:
        problems.need_int(where, clock, "reference_rank", minimum=0)


def _check_merged_header(where: str, other: Mapping[str, Any], world: int | None,
                         problems: _Problems) -> frozenset[int] | None:
    ranks: list[int] | None = None
    for key in ("ranks", "missing_ranks"):
        value = other.get(key)
        if not isinstance(value, list) or not all(_is_int(r) for r in value):
            problems.add(f"{where}: {key!r} must be a list of ranks")
            continue
        if world is not None and any(not 0 <= r < world for r in value):
            problems.add(f"{where}: {key!r} has a rank outside 0..{world - 1}")
        if key == "ranks":
            ranks = list(value)
    clocks = problems.need_dict(where, other, "clocks")
    if clocks is not None:
        for key, clock in clocks.items():
            if not isinstance(clock, dict):
                problems.add(f"{where}.clocks[{key!r}] must be an object")
                continue
            _check_clock(f"{where}.clocks[{key!r}]", clock, problems, reference=False)
        if ranks is not None and sorted(clocks) != sorted(str(r) for r in ranks):
            problems.add(f"{where}: 'clocks' must have one entry per rank in 'ranks'")
    return None if ranks is None else frozenset(ranks)


def _check_netdist_event(index: int, event: Mapping[str, Any], pids: frozenset[int] | None,
                         problems: _Problems) -> None:
    where = _event_where(index, event)
    pid = event.get("pid")
    if pids is not None and _is_int(pid) and pid not in pids:
        problems.add(f"{where}: pid {pid} is not a rank of this file ({sorted(pids)})")
    cat, ph, name = event.get("cat"), event.get("ph"), event.get("name")
    args = event.get("args")
    if cat not in ("collective", "p2p", "connection"):
        return  # subsystem spans ("ps", "fsdp", ...) carry free-form args
    if not isinstance(args, dict):
        problems.add(f"{where}: a {cat} event needs 'args'")
        return
    if cat == "collective":
        if ph != "X":
            problems.add(f"{where}: a collective event has phase \"X\", got {ph!r}")
        if name not in COLLECTIVE_OPS:
            problems.add(f"{where}: {name!r} is not a collective op")
        problems.need_str(where, args, "group")
        group = args.get("group")
        if isinstance(group, str) and not _GROUP_ID.fullmatch(group):
            problems.add(f"{where}: group {group!r} is not \"0x\" and 16 hex digits")
        problems.need_int(where, args, "seq", minimum=0)
        problems.need_int(where, args, "bytes", minimum=0)
        problems.need_int(where, args, "group_size", minimum=1)
        problems.need_int(where, args, "group_rank", minimum=0)
        if "state" in args:
            problems.need_str(where, args, "state", choices=_COLLECTIVE_STATES)
        if "waited_on" in args:
            problems.need_int(where, args, "waited_on", minimum=-1)
    elif cat == "p2p":
        if ph != "X":
            problems.add(f"{where}: a p2p event has phase \"X\", got {ph!r}")
        if name not in _P2P_NAMES:
            problems.add(f"{where}: a p2p event is named \"send\" or \"recv\", got {name!r}")
        problems.need_int(where, args, "peer", minimum=0)
        problems.need_int(where, args, "bytes", minimum=0)
        problems.need_number(where, args, "wait_us", minimum=0)
        problems.need_number(where, args, "move_us", minimum=0)
    elif cat == "connection":
        if ph != "i":
            problems.add(f"{where}: a connection event has phase \"i\", got {ph!r}")
        if name not in _CONNECTION_NAMES:
            problems.add(f"{where}: {name!r} is not a connection event")
        problems.need_int(where, args, "peer", minimum=0)


# --------------------------------------------------------------------------- flight dumps

def validate_flight(obj: object) -> list[str]:
    """Every way ``obj`` breaks the flight-recorder dump format (section 3; empty: valid)."""
    problems = _Problems()
    if not isinstance(obj, dict):
        return [f"a flight dump must be a JSON object, got {_type_name(obj)}"]
    where = "dump"
    problems.need_str(where, obj, "format", choices=frozenset({FLIGHT_FORMAT}))
    _check_version(where, obj, problems)
    problems.need_int(where, obj, "world_size", minimum=1)
    problems.need_int(where, obj, "rank", minimum=0)
    world = _world_size(obj)
    rank = obj.get("rank")
    if _is_int(rank) and world is not None and not rank < world:
        problems.add(f"{where}: rank {rank} is not below world_size {world}")
    problems.need_number(where, obj, "now_us")
    clock = problems.need_dict(where, obj, "clock")
    if clock is not None:
        _check_clock(f"{where}.clock", clock, problems, reference=True)
    problems.need_str(where, obj, "trigger", choices=_TRIGGERS)
    if "error" not in obj:
        problems.add(f"{where}: missing 'error' (null when there was none)")
    elif obj["error"] is not None:
        error = obj["error"]
        if not isinstance(error, dict):
            problems.add(f"{where}: 'error' must be an object or null")
        else:
            problems.need_str(f"{where}.error", error, "type")
            problems.need_str(f"{where}.error", error, "message")
            if error.get("peer") is not None:
                problems.need_int(f"{where}.error", error, "peer", minimum=0)
    problems.need_int(where, obj, "capacity", minimum=0)
    problems.need_int(where, obj, "recorded", minimum=0)
    groups = problems.need_dict(where, obj, "groups")
    for group, state in (groups or {}).items():
        _check_flight_group(f"{where}.groups[{group!r}]", group, state, world, problems)
    peers = problems.need_dict(where, obj, "peers")
    for peer, state in (peers or {}).items():
        _check_flight_peer(f"{where}.peers[{peer!r}]", peer, state, world, problems)
    operations = obj.get("operations")
    if not isinstance(operations, list):
        problems.add(f"{where}: 'operations' must be a list, got {_type_name(operations)}")
        return problems.result()
    for index, op in enumerate(operations):
        _check_flight_op(f"{where}.operations[{index}]", op, problems)
    capacity, recorded = obj.get("capacity"), obj.get("recorded")
    if _is_int(capacity) and len(operations) > capacity:
        problems.add(f"{where}: {len(operations)} operations exceed capacity {capacity}")
    if _is_int(recorded) and len(operations) > recorded:
        problems.add(f"{where}: {len(operations)} operations but only {recorded} recorded")
    return problems.result()


def _check_flight_group(where: str, group: str, state: object, world: int | None,
                        problems: _Problems) -> None:
    if not _GROUP_ID.fullmatch(group):
        problems.add(f"{where}: group {group!r} is not \"0x\" and 16 hex digits")
    if not isinstance(state, dict):
        problems.add(f"{where}: must be an object")
        return
    ranks = state.get("ranks")
    if not isinstance(ranks, list) or not ranks or not all(_is_int(r) for r in ranks):
        problems.add(f"{where}: 'ranks' must be a non-empty list of ranks")
    elif world is not None and any(not 0 <= r < world for r in ranks):
        problems.add(f"{where}: 'ranks' has a rank outside 0..{world - 1}")
    problems.need_int(where, state, "started", minimum=-1)
    problems.need_int(where, state, "completed", minimum=-1)
    started, completed = state.get("started"), state.get("completed")
    if _is_int(started) and _is_int(completed) and -1 <= started < completed:
        problems.add(f"{where}: completed {completed} is past started {started}")


def _check_flight_peer(where: str, peer: str, state: object, world: int | None,
                       problems: _Problems) -> None:
    if not peer.isdigit() or (world is not None and not int(peer) < world):
        problems.add(f"{where}: the key must be a rank below world_size")
    if not isinstance(state, dict):
        problems.add(f"{where}: must be an object")
        return
    if not isinstance(state.get("lost"), bool):
        problems.add(f"{where}: 'lost' must be true or false")
    if "reason" in state and state["reason"] is not None and not isinstance(state["reason"], str):
        problems.add(f"{where}: 'reason' must be a string")
    if "last_heard_us" in state:
        problems.need_number(where, state, "last_heard_us", nullable=True)
    heard = state.get("heard_seq")
    if heard is not None:
        if not isinstance(heard, dict) or not all(_is_int(s) for s in heard.values()):
            problems.add(f"{where}: 'heard_seq' must map group ids to seq numbers")


def _check_flight_op(where: str, op: object, problems: _Problems) -> None:
    if not isinstance(op, dict):
        problems.add(f"{where}: must be an object")
        return
    problems.need_str(where, op, "group")
    problems.need_int(where, op, "seq", minimum=0)
    problems.need_str(where, op, "op", choices=COLLECTIVE_OPS)
    problems.need_int(where, op, "group_rank", minimum=0)
    problems.need_int(where, op, "bytes", minimum=0)
    problems.need_number(where, op, "started_us")
    problems.need_number(where, op, "ended_us", nullable=True)
    problems.need_str(where, op, "state", choices=_FLIGHT_STATES)
    problems.need_int(where, op, "waited_on", minimum=-1)
    if op.get("state") == "in_flight" and op.get("ended_us") is not None:
        problems.add(f"{where}: an in_flight operation has no 'ended_us' (null)")
