"""Traces and flight records of real jobs: 4 processes over TCP on 127.0.0.1.

- A traced job's per-rank files merge into one trace that passes the Trace Event Format
  check; every collective appears on every rank with the same group and sequence number;
  the clocks were aligned at rendezvous; sends and receives name their peers.
- One rank 50 ms late at every step is named by ``netdist trace summary`` with its
  lateness within 10%.
- A rank stopped (SIGSTOP) mid-job: the survivors dump their flight recorders when they
  lose it, and ``netdist trace why`` names it and the operation it never joined.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from netdist.trace.analysis import load_flight_dir, load_trace_dir, merge, summarize
from netdist.trace.schema import validate_netdist_trace, validate_trace
from tests.ranks import REPO, finish_ranks, start_ranks

pytestmark = pytest.mark.slow

MODULE = "tests.trace._member"


def _netdist(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "netdist", *args], cwd=REPO, text=True,
                          capture_output=True, timeout=120)


def _traced_job(tmp_path: Path, steps: int, *extra: str) -> Path:
    trace_dir = tmp_path / "trace"
    procs = start_ranks(4, MODULE, [str(steps), *extra], timeout=30.0,
                        env={"NETDIST_TRACE": str(trace_dir)})
    results = finish_ranks(procs, 120.0)
    assert [r.returncode for r in results] == [0, 0, 0, 0], [p.text() for p in procs]
    return trace_dir


def test_a_traced_job_merges_into_one_valid_trace(tmp_path: Path) -> None:
    trace_dir = _traced_job(tmp_path, 8, "--size", "65536")
    files = sorted(p.name for p in trace_dir.glob("rank_*.trace.json"))
    assert files == [f"rank_{r:05d}.trace.json" for r in range(4)]
    assert not list(trace_dir.glob(".*spill"))  # the side files are gone

    merged_path = tmp_path / "merged.json"
    done = _netdist("trace", "merge", str(trace_dir), "-o", str(merged_path))
    assert done.returncode == 0, done.stderr
    merged = json.loads(merged_path.read_text())
    assert validate_trace(merged) == []
    assert validate_netdist_trace(merged) == []

    traces = load_trace_dir(trace_dir)
    collectives: dict[int, list[tuple[str, str, int]]] = {}
    for event in merged["traceEvents"]:
        if event.get("cat") == "collective":
            args = event["args"]
            collectives.setdefault(event["pid"], []).append(
                (event["name"], args["group"], args["seq"]))
            assert args["state"] == "ok" and args["group_size"] == 4
    # 8 all-reduces, 2 broadcasts and the closing barrier on every rank, in one order
    assert sorted(collectives) == [0, 1, 2, 3]
    assert all(calls == collectives[0] for calls in collectives.values())
    assert [name for name, _, _ in collectives[0]].count("all_reduce") == 8
    assert [name for name, _, _ in collectives[0]].count("broadcast") == 2
    assert [seq for _, _, seq in collectives[0]] == list(range(11))
    # clocks aligned at rendezvous against rank 0, on one host: offset within its error
    for rank in range(4):
        other = json.loads((trace_dir / f"rank_{rank:05d}.trace.json").read_text())
        clock = other["otherData"]["clock"]
        assert clock["samples"] == 8 and clock["reference_rank"] == 0
        assert abs(clock["offset_us"]) <= clock["error_us"] + 1.0
        received = [e for e in other["traceEvents"] if e.get("name") == "recv"]
        assert received and all(e["args"]["peer"] != rank for e in received)
        assert all(e["args"]["wait_us"] + e["args"]["move_us"] == pytest.approx(e["dur"],
                   abs=0.01) for e in received)
    assert merge(traces)["otherData"]["missing_ranks"] == []


def test_summary_names_the_rank_that_is_late_at_every_step(tmp_path: Path) -> None:
    trace_dir = _traced_job(tmp_path, 30, "--late", "2", "50")
    summary = summarize(load_trace_dir(trace_dir))
    stragglers = {s.rank: s for s in summary.stragglers}
    assert list(stragglers) == [2]
    assert 45_000 <= stragglers[2].median_late_by_us <= 55_000
    done = _netdist("trace", "summary", str(trace_dir))
    assert done.returncode == 0, done.stderr
    line = next(l for l in done.stdout.splitlines() if "rank 2" in l and "late" in l)
    late = float(re.search(r"late by ([0-9.]+) ms", line).group(1))  # type: ignore[union-attr]
    assert 45.0 <= late <= 55.0


def test_the_survivors_dumps_name_the_stopped_rank_and_the_operation(tmp_path: Path) -> None:
    dump_dir = tmp_path / "flight"
    procs = start_ranks(4, MODULE, ["400", "--size", "1024"], timeout=30.0,
                        env={"NETDIST_FLIGHT_DIR": str(dump_dir),
                             "NETDIST_HEARTBEAT_INTERVAL": "0.2",
                             "NETDIST_HEARTBEAT_MISSES": "5"})
    stopped = procs[2]
    try:
        stopped.expect("step 20", timeout=60.0)
        stopped.proc.send_signal(signal.SIGSTOP)
        survivors = [p for p in procs if p is not stopped]
        results = finish_ranks(survivors, 60.0)
        assert all(r.returncode != 0 for r in results)
    finally:
        stopped.kill()
    files = sorted(p.name for p in dump_dir.glob("flight_rank_*.json"))
    assert files == ["flight_rank_00000.json", "flight_rank_00001.json",
                     "flight_rank_00003.json"]
    dumps = load_flight_dir(dump_dir)
    assert len(dumps) == 3
    done = _netdist("trace", "why", str(dump_dir))
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "rank 2" in text and ("all_reduce" in text or "broadcast" in text), text
    # every survivor failed in a collective; the earliest of them is the one rank 2 never
    # joined (a broadcast's ranks outside rank 2's subtree may already be one call on)
    stuck_at = []
    for path in dump_dir.glob("flight_rank_*.json"):
        record = json.loads(path.read_text())
        stuck = [op for op in record["operations"] if op["state"] != "ok"]
        assert stuck, record["operations"][-3:]
        stuck_at.append((stuck[-1]["seq"], stuck[-1]["op"]))
    seq, op = min(stuck_at)
    assert f"{op} seq {seq}" in text, text


def test_sigusr1_dumps_a_blocking_rank_s_flight_recorder(tmp_path: Path) -> None:
    dump_dir = tmp_path / "flight"
    procs = start_ranks(2, "tests.trace._signal_member", [], timeout=30.0,
                        env={"NETDIST_FLIGHT_DIR": str(dump_dir)})
    results = finish_ranks(procs, 60.0)
    assert [r.returncode for r in results] == [0, 0], [p.text() for p in procs]
    path = dump_dir / "flight_rank_00000.json"
    assert f"dumped {path}" in procs[0].text()
    record = json.loads(path.read_text())
    assert record["trigger"] == "signal" and record["error"] is None
    assert [(op["op"], op["seq"], op["state"]) for op in record["operations"]] == [
        ("all_reduce", 0, "ok")]
    assert not (dump_dir / "flight_rank_00001.json").exists()
