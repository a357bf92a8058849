"""netdist.trace.schema: every rule of the Trace Event Format, the netdist fields and the
flight-recorder dump has a case it rejects, with the problem line saying which."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from netdist.trace.schema import (
    PHASES,
    validate_flight,
    validate_netdist_trace,
    validate_trace,
)
from tests.trace import synth

Mutation = Callable[[dict[str, Any]], None]


def _minimal() -> dict[str, Any]:
    return {"traceEvents": [
        {"ph": "X", "name": "work", "cat": "c", "pid": 1, "tid": 2, "ts": 10.0, "dur": 5.0},
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "p"}},
    ]}


def _event(**fields: Any) -> Mutation:
    """Append an event made of ``fields`` (a field set to ... is left out)."""
    base: dict[str, Any] = {"ph": "X", "name": "e", "pid": 1, "tid": 1, "ts": 1.0, "dur": 1.0}
    base.update(fields)
    event = {k: v for k, v in base.items() if v is not ...}
    return lambda trace: trace["traceEvents"].append(event)


def _set(key: str, value: Any) -> Mutation:
    def mutate(trace: dict[str, Any]) -> None:
        if value is ...:
            del trace[key]
        else:
            trace[key] = value
    return mutate


def test_a_minimal_trace_and_the_synthetic_rank_file_are_valid() -> None:
    assert validate_trace(_minimal()) == []
    assert validate_trace({"traceEvents": []}) == []
    assert validate_trace({"traceEvents": [], "displayTimeUnit": "ns", "otherData": {}}) == []
    rank_file = synth.rank_trace(1)
    assert validate_trace(rank_file) == []
    assert validate_netdist_trace(rank_file) == []


@pytest.mark.parametrize("ph", sorted(PHASES))
def test_every_phase_of_the_table_is_accepted(ph: str) -> None:
    event: dict[str, Any] = {"ph": ph, "name": "x", "pid": 0, "tid": 0, "ts": 0, "id": 1,
                             "dur": 0, "args": {}}
    if ph == "M":
        event.update(name="thread_name", args={"name": "t"})
    trace = {"traceEvents": [event]}
    assert validate_trace(trace) == []


@pytest.mark.parametrize(("mutate", "problem"), [
    (lambda t: t.clear(), "missing 'traceEvents'"),
    (_set("traceEvents", {}), "'traceEvents' must be a list, got dict"),
    (_set("displayTimeUnit", "us"), "displayTimeUnit must be \"ms\" or \"ns\", got 'us'"),
    (_set("otherData", []), "otherData must be an object, got list"),
    (_set("stackFrames", []), "stackFrames must be an object, got list"),
    (_set("samples", {}), "samples must be a list, got dict"),
    (_set("systemTraceEvents", 3), "systemTraceEvents must be a string, got int"),
    (lambda t: t["traceEvents"].append(7), "traceEvents[2]: an event must be an object, got int"),
    (_event(ph=...), "traceEvents[2] (e): missing 'ph'"),
    (_event(ph="Z"), "traceEvents[2] (e): 'ph' 'Z' is not a Trace Event Format phase"),
    (_event(ph="XX"), "traceEvents[2] (e): 'ph' 'XX' is not a Trace Event Format phase"),
    (_event(name=...), "traceEvents[2]: missing 'name'"),
    (_event(name=3), "traceEvents[2]: 'name' must be a string, got int"),
    (_event(cat=1), "traceEvents[2] (e): 'cat' must be a string, got int"),
    (_event(cname=1), "traceEvents[2] (e): 'cname' must be a string, got int"),
    (_event(pid=...), "traceEvents[2] (e): missing 'pid'"),
    (_event(pid="1"), "traceEvents[2] (e): 'pid' must be an integer, got str"),
    (_event(tid=1.5), "traceEvents[2] (e): 'tid' must be an integer, got float"),
    (_event(tid=True), "traceEvents[2] (e): 'tid' must be an integer, got bool"),
    (_event(ts=...), "traceEvents[2] (e): missing 'ts'"),
    (_event(ts="1"), "traceEvents[2] (e): 'ts' must be a finite number, got str"),
    (_event(ts=-1.0), "traceEvents[2] (e): 'ts' must be >= 0, got -1.0"),
    (_event(ts=float("nan")), "traceEvents[2] (e): 'ts' must be a finite number, got float"),
    (_event(tts=-2), "traceEvents[2] (e): 'tts' must be >= 0, got -2"),
    (_event(dur=...), "traceEvents[2] (e): missing 'dur'"),
    (_event(dur=-0.5), "traceEvents[2] (e): 'dur' must be >= 0, got -0.5"),
    (_event(tdur=-1), "traceEvents[2] (e): 'tdur' must be >= 0, got -1"),
    (_event(args=[1]), "traceEvents[2] (e): 'args' must be an object, got list"),
    (_event(sf=1, stack=["0x1"]), "traceEvents[2] (e): 'sf' and 'stack' are mutually exclusive"),
    (_event(ph="i", dur=..., s="x"),
     "traceEvents[2] (e): instant scope 's' must be one of ['g', 'p', 't'], got 'x'"),
    (_event(ph="I", dur=..., s="process"),
     "traceEvents[2] (e): instant scope 's' must be one of ['g', 'p', 't'], got 'process'"),
    (_event(ph="C", dur=...), "traceEvents[2] (e): a counter event needs 'args' with its series values"),
    (_event(ph="C", dur=..., args={"a": "1"}),
     "traceEvents[2] (e): counter series 'a' must be a number, got str"),
    (_event(ph="b", dur=...), "traceEvents[2] (e): phase 'b' (async nestable begin) needs an 'id'"),
    (_event(ph="s", dur=...), "traceEvents[2] (e): phase 's' (flow begin) needs an 'id'"),
    (_event(ph="N", dur=...), "traceEvents[2] (e): phase 'N' (object created) needs an 'id'"),
    (_event(ph="e", dur=..., id=1.5),
     "traceEvents[2] (e): 'id' must be a string or an integer, got float"),
    (_event(ph="n", dur=..., id2={"x": 1}),
     "traceEvents[2] (e): 'id2' must be {\"local\": id} or {\"global\": id}"),
    (_event(ph="f", dur=..., id=1, bp="x"),
     "traceEvents[2] (e): flow binding point 'bp' must be \"e\", got 'x'"),
    (_event(ph="M", name="process_title", ts=..., dur=..., args={"name": "x"}),
     "traceEvents[2] (process_title): metadata name 'process_title' is not one of"),
    (_event(ph="M", name="thread_name", ts=..., dur=...),
     "traceEvents[2] (thread_name): metadata event thread_name needs 'args' with 'name'"),
    (_event(ph="M", name="process_name", ts=..., dur=..., args={}),
     "traceEvents[2] (process_name): metadata event process_name needs args.name"),
    (_event(ph="M", name="thread_sort_index", ts=..., dur=..., args={"sort_index": "1"}),
     "traceEvents[2] (thread_sort_index): args.sort_index of thread_sort_index has the wrong type (str)"),
    (_event(ph="M", name="process_labels", ts=..., dur=..., args={"labels": 1}),
     "traceEvents[2] (process_labels): args.labels of process_labels has the wrong type (int)"),
])
def test_each_format_rule_rejects_its_case(mutate: Mutation, problem: str) -> None:
    trace = _minimal()
    mutate(trace)
    problems = validate_trace(trace)
    assert len(problems) == 1, problems
    assert problems[0].startswith(problem), problems


def test_optional_fields_where_the_format_allows_them() -> None:
    trace = _minimal()
    trace["traceEvents"] += [
        {"ph": "E", "pid": 1, "tid": 2, "ts": 3},          # an end event needs no name
        {"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": 2, "args": {"sort_index": -1}},
        {"ph": "i", "name": "mark", "pid": 1, "tid": 2, "ts": 4},  # scope defaults to thread
        {"ph": "b", "name": "a", "pid": 1, "tid": 2, "ts": 4, "id2": {"local": "0x1"}},
        {"ph": "t", "name": "f", "pid": 1, "tid": 2, "ts": 4, "id": "0x2", "bp": "e"},
    ]
    assert validate_trace(trace) == []


def test_not_an_object_and_many_problems_are_all_reported() -> None:
    assert validate_trace([]) == ["the trace must be a JSON object (Object Format), got list"]
    trace: dict[str, Any] = {"traceEvents": [{"ph": "X"} for _ in range(300)]}
    problems = validate_trace(trace)
    assert len(problems) == 201  # 200 lines, then how many more
    assert problems[-1] == "... and 1300 more problems"  # 5 per event: name, pid, tid, ts, dur


# --------------------------------------------------------------------------- netdist fields

def _rank_file() -> dict[str, Any]:
    return synth.rank_trace(1, collectives=2, messages=1)


def _other(key: str, value: Any) -> Mutation:
    def mutate(trace: dict[str, Any]) -> None:
        if value is ...:
            del trace["otherData"][key]
        else:
            trace["otherData"][key] = value
    return mutate


def _collective_args(key: str, value: Any) -> Mutation:
    def mutate(trace: dict[str, Any]) -> None:
        event = next(e for e in trace["traceEvents"] if e.get("cat") == "collective")
        if value is ...:
            del event["args"][key]
        else:
            event["args"][key] = value
    return mutate


def _first(cat: str, **fields: Any) -> Mutation:
    def mutate(trace: dict[str, Any]) -> None:
        event = next(e for e in trace["traceEvents"] if e.get("cat") == cat)
        for key, value in fields.items():
            if value is ...:
                del event[key]
            else:
                event[key] = value
    return mutate


@pytest.mark.parametrize(("mutate", "problem"), [
    (lambda t: t.pop("otherData"), "missing 'otherData' (the netdist header)"),
    (_other("format", "chrome"), "otherData: 'format' is 'chrome', not one of"),
    (_other("version", 2), "otherData: version 2 is not 1"),
    (_other("rank", ...), "otherData: missing 'rank'"),
    (_other("rank", 4), "otherData: rank 4 is not below world_size 4"),
    (_other("world_size", 0), "otherData: 'world_size' must be >= 1, got 0"),
    (_other("clock", ...), "otherData: missing 'clock'"),
    (_other("clock", {"offset_us": 1.0, "error_us": -1.0, "reference_rank": 0}),
     "otherData.clock: 'error_us' must be >= 0, got -1.0"),
    (_other("clock", {"offset_us": 1.0, "error_us": 1.0}),
     "otherData.clock: missing 'reference_rank'"),
    (_other("dropped", -1), "otherData: 'dropped' must be >= 0, got -1"),
    (_first("collective", pid=2), "traceEvents[4] (all_reduce): pid 2 is not a rank of this file ([1])"),
    (_first("collective", ph="B"), "traceEvents[4] (all_reduce): a collective event has phase \"X\""),
    (_first("collective", name="allreduce"), "traceEvents[4] (allreduce): 'allreduce' is not a collective op"),
    (_first("collective", args=...), "traceEvents[4] (all_reduce): a collective event needs 'args'"),
    (_collective_args("group", ...), "traceEvents[4] (all_reduce): missing 'group'"),
    (_collective_args("group", "0x1"), "traceEvents[4] (all_reduce): group '0x1' is not \"0x\" and 16 hex digits"),
    (_collective_args("seq", -1), "traceEvents[4] (all_reduce): 'seq' must be >= 0, got -1"),
    (_collective_args("seq", "3"), "traceEvents[4] (all_reduce): 'seq' must be an integer, got str"),
    (_collective_args("bytes", ...), "traceEvents[4] (all_reduce): missing 'bytes'"),
    (_collective_args("bytes", 1.5), "traceEvents[4] (all_reduce): 'bytes' must be an integer, got float"),
    (_collective_args("group_size", 0), "traceEvents[4] (all_reduce): 'group_size' must be >= 1, got 0"),
    (_collective_args("state", "done"), "traceEvents[4] (all_reduce): 'state' is 'done', not one of"),
    (_collective_args("waited_on", -2), "traceEvents[4] (all_reduce): 'waited_on' must be >= -1, got -2"),
    (_first("p2p", name="write"), "traceEvents[6] (write): a p2p event is named \"send\" or \"recv\""),
    (_first("p2p", ph="i"), "traceEvents[6] (send): a p2p event has phase \"X\", got 'i'"),
    (_first("p2p", args={"peer": 2, "tag": 7, "bytes": 1, "wait_us": 0.0}),
     "traceEvents[6] (send): missing 'move_us'"),
    (_first("connection", ph="X", dur=1.0), "traceEvents[2] (connect): a connection event has phase \"i\""),
    (_first("connection", name="hello"), "traceEvents[2] (hello): 'hello' is not a connection event"),
])
def test_each_netdist_rule_rejects_its_case(mutate: Mutation, problem: str) -> None:
    trace = _rank_file()
    mutate(trace)
    problems = validate_netdist_trace(trace)
    assert len(problems) == 1, problems
    assert problems[0].startswith(problem), problems


def test_subsystem_spans_and_counters_carry_free_form_args() -> None:
    trace = _rank_file()
    trace["traceEvents"].append({"ph": "X", "cat": "fsdp", "name": "all_gather", "pid": 1,
                                 "tid": 3, "ts": 5.0, "dur": 1.0})
    trace["traceEvents"].append({"ph": "X", "cat": "checkpoint", "name": "write", "pid": 1,
                                 "tid": 4, "ts": 5.0, "dur": 1.0, "args": {"file": "a"}})
    assert validate_netdist_trace(trace) == []


def _merged() -> dict[str, Any]:
    events = synth.rank_trace(0, collectives=1)["traceEvents"] + \
        synth.rank_trace(2, collectives=1)["traceEvents"]
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"format": "netdist-trace-merged", "version": 1, "world_size": 4,
                          "ranks": [0, 2], "missing_ranks": [1, 3],
                          "clocks": {"0": {"offset_us": 0.0, "error_us": 1.0},
                                     "2": {"offset_us": 3.0, "error_us": 1.0}}}}


@pytest.mark.parametrize(("mutate", "problem"), [
    (lambda t: t["otherData"].update(ranks=[0], clocks={"0": {"offset_us": 0, "error_us": 1}}),
     "traceEvents[11] (process_name): pid 2 is not a rank of this file ([0])"),
    (_other("ranks", "0,2"), "otherData: 'ranks' must be a list of ranks"),
    (_other("missing_ranks", [1, 4]), "otherData: 'missing_ranks' has a rank outside 0..3"),
    (_other("clocks", {"0": {"offset_us": 0.0, "error_us": 1.0}}),
     "otherData: 'clocks' must have one entry per rank in 'ranks'"),
    (_other("clocks", {"0": {"offset_us": 0.0, "error_us": 1.0}, "2": {"error_us": 1.0}}),
     "otherData.clocks['2']: missing 'offset_us'"),
])
def test_merged_header_rules(mutate: Mutation, problem: str) -> None:
    trace = _merged()
    assert validate_netdist_trace(trace) == []
    mutate(trace)
    problems = validate_netdist_trace(trace)
    assert problems[0].startswith(problem), problems
    rank_2_events = len(synth.rank_trace(2, collectives=1)["traceEvents"])  # 11, one each
    assert len(problems) == (rank_2_events if "pid" in problem else 1), problems


# --------------------------------------------------------------------------- flight dumps

def _dump() -> dict[str, Any]:
    return synth.sigstop_dumps()[0]


def _dump_set(path: str, value: Any) -> Mutation:
    """Set (or with ... delete) the field at ``a.b.0.c``."""
    def mutate(dump: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = dump
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        key: Any = int(last) if isinstance(node, list) else last
        if value is ...:
            del node[key]
        else:
            node[key] = value
    return mutate


G = synth.GROUP


@pytest.mark.parametrize(("mutate", "problem"), [
    (_dump_set("format", "netdist-trace"), "dump: 'format' is 'netdist-trace', not one of"),
    (_dump_set("version", 3), "dump: version 3 is not 1"),
    (_dump_set("rank", 9), "dump: rank 9 is not below world_size 4"),
    (_dump_set("now_us", None), "dump: 'now_us' must be a finite number, got null"),
    (_dump_set("clock", ...), "dump: missing 'clock'"),
    (_dump_set("trigger", "crash"), "dump: 'trigger' is 'crash', not one of"),
    (_dump_set("error", ...), "dump: missing 'error' (null when there was none)"),
    (_dump_set("error", "boom"), "dump: 'error' must be an object or null"),
    (_dump_set("error.type", ...), "dump.error: missing 'type'"),
    (_dump_set("error.peer", "2"), "dump.error: 'peer' must be an integer, got str"),
    (_dump_set("capacity", 2), "dump: 4 operations exceed capacity 2"),
    (_dump_set("recorded", 3), "dump: 4 operations but only 3 recorded"),
    (_dump_set("groups", []), "dump: 'groups' must be an object, got list"),
    (_dump_set(f"groups.{G}.ranks", []), f"dump.groups['{G}']: 'ranks' must be a non-empty list"),
    (_dump_set(f"groups.{G}.ranks", [0, 7]), f"dump.groups['{G}']: 'ranks' has a rank outside 0..3"),
    (_dump_set(f"groups.{G}.started", -2), f"dump.groups['{G}']: 'started' must be >= -1, got -2"),
    (_dump_set(f"groups.{G}.completed", 43), f"dump.groups['{G}']: completed 43 is past started 42"),
    (_dump_set("groups.world", {"ranks": [0], "started": -1, "completed": -1}),
     "dump.groups['world']: group 'world' is not \"0x\" and 16 hex digits"),
    (_dump_set("peers.2.lost", "yes"), "dump.peers['2']: 'lost' must be true or false"),
    (_dump_set("peers.2.reason", 5), "dump.peers['2']: 'reason' must be a string"),
    (_dump_set("peers.2.last_heard_us", "x"), "dump.peers['2']: 'last_heard_us' must be a finite number"),
    (_dump_set("peers.2.heard_seq", {G: "41"}), "dump.peers['2']: 'heard_seq' must map group ids"),
    (_dump_set("peers.9", {"lost": False}), "dump.peers['9']: the key must be a rank below world_size"),
    (_dump_set("operations", {}), "dump: 'operations' must be a list, got dict"),
    (_dump_set("operations.0", 3), "dump.operations[0]: must be an object"),
    (_dump_set("operations.0.op", "allreduce"), "dump.operations[0]: 'op' is 'allreduce', not one of"),
    (_dump_set("operations.0.seq", ...), "dump.operations[0]: missing 'seq'"),
    (_dump_set("operations.0.state", "running"), "dump.operations[0]: 'state' is 'running', not one of"),
    (_dump_set("operations.0.ended_us", ...), "dump.operations[0]: missing 'ended_us'"),
    (_dump_set("operations.3.ended_us", 5.0), "dump.operations[3]: an in_flight operation has no 'ended_us'"),
    (_dump_set("operations.0.waited_on", None), "dump.operations[0]: 'waited_on' must be an integer, got null"),
])
def test_each_flight_rule_rejects_its_case(mutate: Mutation, problem: str) -> None:
    dump = _dump()
    assert validate_flight(copy.deepcopy(dump)) == []
    mutate(dump)
    problems = validate_flight(dump)
    assert len(problems) == 1, problems
    assert problems[0].startswith(problem), problems


def test_a_flight_dump_must_be_an_object() -> None:
    assert validate_flight([1]) == ["a flight dump must be a JSON object, got list"]
