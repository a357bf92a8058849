"""netdist.trace.analysis on synthetic jobs: loading, merging, the summary (stragglers,
collective statistics, links) and the clear errors for bad files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from netdist.errors import TraceError
from netdist.trace.analysis import (
    Arrival,
    CollectiveCall,
    arrivals,
    format_summary,
    load_trace_dir,
    merge,
    summarize,
)
from netdist.trace.schema import validate_netdist_trace, validate_trace
from tests.trace import synth


def test_load_reads_every_rank_with_its_header(tmp_path: Path) -> None:
    synth.write_trace_dir(tmp_path)
    trace_set = load_trace_dir(tmp_path)
    assert trace_set.world_size == 4
    assert trace_set.present_ranks == [0, 1, 2, 3]
    assert trace_set.missing_ranks == []
    assert trace_set.ranks[3].clock.offset_us == 37.5
    assert trace_set.ranks[3].path == str(synth.trace_path(tmp_path, 3))
    assert len(trace_set.ranks[1].events) == len(synth.rank_trace(1)["traceEvents"])


def test_merge_validates_and_holds_every_ranks_events(tmp_path: Path) -> None:
    synth.write_trace_dir(tmp_path)
    merged = merge(load_trace_dir(tmp_path))
    assert validate_trace(merged) == []
    assert validate_netdist_trace(merged) == []
    expected = [e for r in range(4) for e in synth.rank_trace(r)["traceEvents"]]
    assert merged["traceEvents"] == expected
    assert merged["otherData"] == {
        "format": "netdist-trace-merged", "version": 1, "world_size": 4,
        "ranks": [0, 1, 2, 3], "missing_ranks": [],
        "clocks": {str(r): {"offset_us": 12.5 * r, "error_us": 30.0} for r in range(4)}}


def test_merge_names_the_rank_that_left_no_file(tmp_path: Path) -> None:
    synth.write_trace_dir(tmp_path, ranks=[0, 1, 3])
    trace_set = load_trace_dir(tmp_path)
    assert trace_set.missing_ranks == [2]
    merged = merge(trace_set)
    assert validate_netdist_trace(merged) == []
    assert merged["otherData"]["ranks"] == [0, 1, 3]
    assert merged["otherData"]["missing_ranks"] == [2]
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1, 3}


# --------------------------------------------------------------------------- summary

def test_the_late_rank_is_the_straggler_with_its_lateness(tmp_path: Path) -> None:
    synth.write_trace_dir(tmp_path, late_rank=2, late_us=50_000.0)
    summary = summarize(load_trace_dir(tmp_path))
    assert len(summary.stragglers) == 1
    straggler = summary.stragglers[0]
    assert (straggler.rank, straggler.last_in, straggler.of) == (2, 50, 50)
    assert straggler.median_late_by_us == pytest.approx(50_000.0, rel=0.10)
    # by construction: late_by = 50 ms + rank 2's jitter - the largest other jitter
    late = sorted(50_000.0 + synth.jitter_us(2, s) - max(synth.jitter_us(r, s) for r in (0, 1, 3))
                  for s in range(50))
    assert straggler.median_late_by_us == pytest.approx((late[24] + late[25]) / 2)
    text = format_summary(summary)
    assert ("straggler: rank 2 arrived last in 50 of 50 collectives, late by 49.9 ms "
            "(median)") in text.splitlines()


def test_no_straggler_when_the_last_rank_rotates(tmp_path: Path) -> None:
    synth.write_trace_dir(tmp_path, late_rank=None)
    summary = summarize(load_trace_dir(tmp_path))
    lasts = [a.last_rank for a in summary.arrivals]
    assert max(lasts.count(r) for r in range(4)) < 25  # nobody last in half of them
    assert summary.stragglers == []
    assert "no straggler: no rank arrived last in >= 50% of >= 10 collectives" in \
        format_summary(summary).splitlines()


def test_no_straggler_from_fewer_than_ten_collectives(tmp_path: Path) -> None:
    synth.write_trace_dir(tmp_path, collectives=9)
    summary = summarize(load_trace_dir(tmp_path))
    assert [a.last_rank for a in summary.arrivals] == [2] * 9
    assert summary.stragglers == []


def test_arrival_is_last_and_late_by_against_the_second_last() -> None:
    calls = [CollectiveCall(r, "barrier", "0x0000000000000001", 5, t, 1.0, 0, 3, "ok")
             for r, t in ((0, 10.0), (1, 40.0), (2, 25.0))]
    calls.append(CollectiveCall(0, "barrier", "0x0000000000000001", 6, 100.0, 1.0, 0, 3, "ok"))
    assert arrivals(calls) == [
        Arrival("0x0000000000000001", 5, "barrier", (0, 1, 2), 3, 1, 15.0),
        Arrival("0x0000000000000001", 6, "barrier", (0,), 3, None, None),
    ]
    tie = [CollectiveCall(r, "barrier", "0x0000000000000001", 0, 7.0, 1.0, 0, 2, "ok")
           for r in (1, 0)]
    assert arrivals(tie)[0].last_rank == 0 and arrivals(tie)[0].late_by_us == 0.0


def test_collective_stats_per_kind_and_group(tmp_path: Path) -> None:
    synth.write_trace_dir(tmp_path)
    stats = {c.op: c for c in summarize(load_trace_dir(tmp_path)).collectives}
    assert sorted(stats) == ["all_gather", "all_reduce", "broadcast", "reduce_scatter"]
    all_reduce = stats["all_reduce"]
    seqs = range(0, 50, 4)  # all_reduce is every fourth collective
    assert (all_reduce.group, all_reduce.count, all_reduce.calls) == (synth.GROUP, 13, 52)
    assert all_reduce.bytes == 52 * 4096
    durations = []
    for s in seqs:
        done = max(synth.arrival_us(r, s, 2, 50_000.0) for r in range(4)) \
            + synth.DONE_AFTER_LAST_US
        durations += [done - synth.arrival_us(r, s, 2, 50_000.0) for r in range(4)]
    assert all_reduce.mean_dur_us == pytest.approx(sum(durations) / len(durations))


def test_links_bytes_messages_and_bandwidth(tmp_path: Path) -> None:
    synth.write_trace_dir(tmp_path, messages=3)
    links = summarize(load_trace_dir(tmp_path)).links
    assert [(link.src, link.dst) for link in links] == [(0, 1), (1, 2), (2, 3), (3, 0)]
    link = links[0]
    assert (link.messages, link.bytes, link.source) == (3, 3 * synth.MESSAGE_BYTES, "recv")
    assert link.move_us == 3 * synth.MOVE_US
    assert link.bandwidth_Bps == pytest.approx(3 * synth.MESSAGE_BYTES / (3 * synth.MOVE_US * 1e-6))
    # first send leaves at BASE+50 ms; the last message ends 20 ms later + wait + move
    span = 20_000.0 + synth.WAIT_US + synth.MOVE_US
    assert link.span_us == pytest.approx(span)
    assert link.span_bandwidth_Bps == pytest.approx(3 * synth.MESSAGE_BYTES / (span * 1e-6))
    text = format_summary(summarize(load_trace_dir(tmp_path)))
    assert "  0 -> 1: 3 messages, 192.0 KiB, 131.1 MB/s while moving, 9.5 MB/s over 20.6 ms" \
        in text.splitlines()


def test_links_fall_back_to_the_senders_events_when_the_receiver_is_missing(
        tmp_path: Path) -> None:
    synth.write_trace_dir(tmp_path, ranks=[0, 2, 3])
    links = {(link.src, link.dst): link for link in summarize(load_trace_dir(tmp_path)).links}
    assert links[(0, 1)].source == "send" and links[(0, 1)].messages == 3
    assert links[(1, 2)].source == "recv" and links[(1, 2)].bytes == 3 * synth.MESSAGE_BYTES


def test_summary_json_round_trips(tmp_path: Path) -> None:
    synth.write_trace_dir(tmp_path, ranks=[0, 1, 2])
    summary = summarize(load_trace_dir(tmp_path))
    data = json.loads(json.dumps(summary.to_dict()))
    assert data["missing_ranks"] == [3]
    assert data["stragglers"][0]["rank"] == 2
    assert data["arrivals"][0]["ranks"] == [0, 1, 2]
    assert "missing: rank 3 left no trace file" in format_summary(summary).splitlines()


# --------------------------------------------------------------------------- bad files

def _one_file(tmp_path: Path, text: str | bytes) -> Path:
    synth.write_trace_dir(tmp_path)
    path = synth.trace_path(tmp_path, 1)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def test_a_truncated_file_is_named(tmp_path: Path) -> None:
    whole = json.dumps(synth.rank_trace(1))
    path = _one_file(tmp_path, whole[: len(whole) // 2])
    with pytest.raises(TraceError, match=rf"^trace file {path} is not valid JSON \(truncated\?\): ") as info:
        load_trace_dir(tmp_path)
    assert info.value.path == str(path)


@pytest.mark.parametrize(("content", "message"), [
    ("", "trace file {path} is empty (the rank died while writing it?)"),
    ("garbage{", "trace file {path} is not valid JSON: Expecting value at line 1 column 1"),
    (b"\xff\xfe{}", "trace file {path} is not UTF-8 JSON (byte 0)"),
    ("[]", "{path} is not a netdist per-rank trace (format v1): the trace must be a JSON "
           "object (Object Format), got list"),
    ('{"traceEvents": []}', "{path} is not a netdist per-rank trace (format v1): missing "
                            "'otherData' (the netdist header)"),
])
def test_garbage_is_named(tmp_path: Path, content: str | bytes, message: str) -> None:
    path = _one_file(tmp_path, content)
    with pytest.raises(TraceError) as info:
        load_trace_dir(tmp_path)
    assert str(info.value) == message.format(path=path)


def test_a_file_breaking_the_format_names_the_first_problem_and_counts_the_rest(
        tmp_path: Path) -> None:
    trace = synth.rank_trace(1)
    for event in trace["traceEvents"]:
        event.pop("pid")
    path = _one_file(tmp_path, json.dumps(trace))
    n = len(trace["traceEvents"])
    with pytest.raises(TraceError) as info:
        load_trace_dir(tmp_path)
    assert str(info.value) == (f"{path} is not a netdist per-rank trace (format v1): "
                               f"traceEvents[0] (process_name): missing 'pid' "
                               f"(and {n - 1} more problems)")


def test_a_file_whose_rank_is_not_its_name(tmp_path: Path) -> None:
    path = _one_file(tmp_path, json.dumps(synth.rank_trace(2)))
    with pytest.raises(TraceError) as info:
        load_trace_dir(tmp_path)
    assert str(info.value) == f"{path} holds rank 2, but its name says rank 1"


def test_a_merged_file_named_like_a_rank_file(tmp_path: Path) -> None:
    synth.write_trace_dir(tmp_path / "job")
    merged = merge(load_trace_dir(tmp_path / "job"))
    path = _one_file(tmp_path, json.dumps(merged))
    with pytest.raises(TraceError) as info:
        load_trace_dir(tmp_path)
    assert str(info.value) == (f"{path} is not a netdist per-rank trace (format v1): "
                               f"otherData.format is 'netdist-trace-merged', a per-rank "
                               f"file has 'netdist-trace'")


def test_files_that_disagree_on_the_world_size(tmp_path: Path) -> None:
    synth.write_trace_dir(tmp_path, world=4, ranks=[0, 1])
    synth.trace_path(tmp_path, 2).write_text(json.dumps(synth.rank_trace(2, world=8)))
    with pytest.raises(TraceError) as info:
        load_trace_dir(tmp_path)
    assert str(info.value) == (
        f"the trace files disagree on the world size: {synth.trace_path(tmp_path, 0)} says 4, "
        f"{synth.trace_path(tmp_path, 2)} says 8")


def test_no_files_and_no_directory(tmp_path: Path) -> None:
    with pytest.raises(TraceError) as info:
        load_trace_dir(tmp_path)
    assert str(info.value) == (f"no rank_*.trace.json files in {tmp_path} (run the job with "
                               f"NETDIST_TRACE={tmp_path})")
    with pytest.raises(TraceError) as info:
        load_trace_dir(tmp_path / "nope")
    assert str(info.value) == f"trace directory {tmp_path / 'nope'} does not exist"
    (tmp_path / "file").write_text("")
    with pytest.raises(TraceError, match="is not a directory$"):
        load_trace_dir(tmp_path / "file")


def test_two_files_of_one_rank(tmp_path: Path) -> None:
    synth.write_trace_dir(tmp_path)
    (tmp_path / "rank_1.trace.json").write_text(json.dumps(synth.rank_trace(1)))
    with pytest.raises(TraceError, match=r"rank_00001.trace.json and .*rank_1.trace.json are "
                                         r"both rank 1$"):
        load_trace_dir(tmp_path)
