"""The live straggler report: the PURE window (exact values) and a real 4-process job.

``StragglerWindow`` judges each complete collective as the trace format defines it
(section 4): the last arrival, late by its distance to the second-latest; a rank last at
half the window or more is a straggler, late by the median. The job test runs 4 ranks as
processes over TCP on 127.0.0.1, rank 2 computing 50 ms longer before every all-reduce,
and checks that rank 0's log names rank 2, late by 50 ms, and nobody else.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import re

import msgpack
import numpy as np
import pytest

from netdist.trace.settings import TraceSettings
from netdist.trace.stragglers import Straggler, StragglerWindow, describe
from tests.ranks import finish_ranks, start_ranks

MS = 1_000_000
G = 0x1234


def feed(window: StragglerWindow, seq: int, arrivals: dict[int, int], gid: int = G) -> None:
    for rank, arrival in arrivals.items():
        window.arrive(gid, seq, rank, arrival)


# -------------------------------------------------------------------------- PURE window


def test_one_rank_50ms_late_on_every_collective_is_named_with_50ms() -> None:
    window = StragglerWindow()
    window.set_group(G, (0, 1, 2, 3))
    for seq in range(50):
        base = seq * 1000 * MS
        feed(window, seq, {0: base, 1: base + 2 * MS, 2: base + 52 * MS, 3: base + MS})
    assert window.completed == 50
    assert window.stragglers() == [Straggler(2, G, 50, 50, 50.0, 4)]
    assert describe(window.stragglers()) == (
        "rank 2 arrived last at 50 of 50 collectives of group 0x0000000000001234 "
        "(4 ranks), late by 50.0 ms (median)")


def test_lateness_is_the_median_over_the_collectives_where_it_was_last() -> None:
    window = StragglerWindow()
    window.set_group(G, (0, 1, 2))
    lateness = [10, 30, 20, 40, 50, 60]  # ms, rank 1 last each time: median 35 ms
    for seq, late in enumerate(lateness):
        feed(window, seq, {0: 0, 1: late * MS, 2: 0})
    for seq in range(6, 10):  # rank 0 last 4 times: 40% < 50%, not named
        feed(window, seq, {0: 7 * MS, 1: 0, 2: 0})
    assert window.stragglers() == [Straggler(1, G, 6, 10, 35.0, 3)]
    assert window.stragglers(share=0.7) == []
    assert window.stragglers(min_collectives=11) == []
    assert window.stragglers(min_late_ms=36.0) == []
    # at exactly half, both ranks are named, most often last first
    both = window.stragglers(share=0.4)
    assert [(s.rank, s.last_count, s.median_late_ms) for s in both] == [(1, 6, 35.0),
                                                                      (0, 4, 7.0)]


def test_late_by_is_measured_from_the_second_latest_arrival() -> None:
    window = StragglerWindow()
    window.set_group(G, (0, 1, 2, 3))
    for seq in range(10):
        feed(window, seq, {0: 0, 1: 40 * MS, 2: 45 * MS, 3: 100 * MS})
    assert window.stragglers() == [Straggler(3, G, 10, 10, 55.0, 4)]


def test_a_tie_for_last_goes_to_the_lower_rank_late_by_0() -> None:
    window = StragglerWindow()
    window.set_group(G, (0, 1, 2))
    for seq in range(10):  # as the offline summary has it (analysis.arrivals)
        feed(window, seq, {0: 0, 2: 9 * MS, 1: 9 * MS})
    assert window.stragglers() == [Straggler(1, G, 10, 10, 0.0, 3)]
    assert window.stragglers(min_late_ms=0.001) == []
    for seq in range(10, 20):  # rank 2 last by 1 ms: half of the window each
        feed(window, seq, {0: 0, 1: 9 * MS, 2: 10 * MS})
    assert window.stragglers() == [Straggler(1, G, 10, 20, 0.0, 3),
                                   Straggler(2, G, 10, 20, 1.0, 3)]
    assert window.stragglers(min_late_ms=0.5) == [Straggler(2, G, 10, 20, 1.0, 3)]


def test_incomplete_collectives_are_not_judged_until_every_member_arrived() -> None:
    window = StragglerWindow()
    window.set_group(G, (0, 1, 2))
    for seq in range(20):
        assert not window.arrive(G, seq, 0, 0)
        assert not window.arrive(G, seq, 2, 80 * MS)  # rank 1 never reports
    assert window.incomplete(G) == 20 and window.complete(G) == 0
    assert window.stragglers() == []
    for seq in range(9):
        assert window.arrive(G, seq, 1, MS)
    assert window.stragglers() == []  # 9 complete: fewer than 10
    assert window.arrive(G, 9, 1, MS)
    assert window.stragglers() == [Straggler(2, G, 10, 10, 79.0, 3)]
    assert window.incomplete(G) == 10


def test_arrivals_that_do_not_count_are_ignored() -> None:
    window = StragglerWindow()
    window.set_group(G, (0, 2))
    window.set_group(G, (0, 1, 2))  # declared already: no change
    window.set_group(0x99, (5,))  # one rank: not judged
    assert not window.knows(0x99)
    assert not window.arrive(0x77, 0, 0, 0)  # unknown group
    assert not window.arrive(G, 0, 1, 0)  # not a member
    assert not window.arrive(G, 0, 0, 0)
    assert not window.arrive(G, 0, 0, 5)  # a repeat
    assert window.arrive(G, 0, 2, 3)
    assert window.ignored == 3 and window.completed == 1


def test_memory_is_bounded() -> None:
    window = StragglerWindow(window=20, max_incomplete=5, max_groups=2)
    window.set_group(G, (0, 1))
    for seq in range(100):
        feed(window, seq, {0: 0, 1: (seq + 1) * MS})
    assert window.complete(G) == 20  # the newest 20: lateness 81..100 ms
    assert window.stragglers() == [Straggler(1, G, 20, 20, 90.5, 2)]
    for seq in range(100, 110):  # rank 1 stops reporting
        window.arrive(G, seq, 0, 0)
    assert window.incomplete(G) == 5 and window.dropped == 5
    assert window.arrive(G, 109, 1, MS)  # the newest are kept
    assert not window.arrive(G, 100, 1, MS)  # the oldest were dropped (a new entry now)
    window.set_group(0x1, (0, 1))
    window.set_group(0x2, (0, 1))  # a third group: the one idle longest goes
    assert not window.knows(G) and window.knows(0x1) and window.knows(0x2)


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="window"):
        StragglerWindow(window=0)


def test_the_report_is_off_unless_asked_for_or_tracing() -> None:
    assert TraceSettings.from_env({}).straggler_interval == 0
    assert TraceSettings.from_env({"NETDIST_STRAGGLER_REPORT": "5"}).straggler_interval == 5
    assert TraceSettings.from_env({"NETDIST_TRACE": "/tmp/t"}).straggler_interval == 60
    assert TraceSettings.from_env({"NETDIST_TRACE": "/tmp/t",
                                   "NETDIST_STRAGGLER_REPORT": "0"}).straggler_interval == 0


# ------------------------------------------------------------- the monitor, in one loop

SENTINEL = 7
"""An application tag: a peer's message on it arrives after everything it sent before."""


async def test_monitor_is_off_by_default(monkeypatch) -> None:
    from netdist.trace.straggler_monitor import monitor_of, straggler_report
    from netdist.transport.local_tcp import create_local_tcp_group

    monkeypatch.delenv("NETDIST_STRAGGLER_REPORT", raising=False)
    monkeypatch.delenv("NETDIST_TRACE", raising=False)
    transports = await create_local_tcp_group(2, timeout=10.0)
    try:
        assert all(monitor_of(t) is None for t in transports)
        assert straggler_report(transports[0]) == []
        assert transports[0]._connections[1] is None  # lazy: nothing connected for it
    finally:
        await asyncio.gather(*(t.aclose() for t in transports))


async def test_monitor_feeds_rank_0_and_stops_quietly(monkeypatch, caplog) -> None:
    from netdist.collectives import Group
    module = importlib.import_module("netdist.trace.straggler_monitor")
    from netdist.transport.local_tcp import create_local_tcp_group

    monkeypatch.setenv("NETDIST_STRAGGLER_REPORT", "1")
    monkeypatch.setattr(module, "DEFAULT_PERIOD", 3600.0)  # batches sent by the test
    transports = await create_local_tcp_group(3, timeout=10.0)
    monitors = [module.monitor_of(t) for t in transports]
    groups = [Group(t) for t in transports]
    try:
        zero, one, two = monitors
        assert zero is not None and one is not None and two is not None
        assert zero.window is not None and one.window is None
        assert zero.tag == one.tag == two.tag

        async def flush(*peers: module.StragglerMonitor) -> None:
            for peer in peers:
                for message in peer._batches():
                    await peer.transport.send(0, message, tag=peer.tag)
                await peer.transport.send(0, np.zeros(1), tag=SENTINEL)
            for peer in peers:
                await transports[0].recv(peer.rank, tag=SENTINEL)

        for _ in range(12):
            await asyncio.gather(*(g.all_reduce(np.ones(4)) for g in groups))
        await flush(one, two)
        await zero.collect()
        assert zero.window.completed == 12 and not zero.silenced

        # a message that is not one: rank 0 stops reading that peer, nothing else
        await transports[2].send(0, np.frombuffer(b"\xc1 not msgpack", np.uint8),
                                 tag=zero.tag)
        await transports[1].send(0, np.frombuffer(msgpack.packb([1, 2]), np.uint8),
                                 tag=zero.tag)
        await flush(one, two)
        with caplog.at_level(logging.DEBUG, logger="netdist.trace"):
            await zero.collect()
        assert zero.silenced == {1, 2}
        assert caplog.text.count("a message that is not one") == 2

        # a peer that leaves: its loop ends quietly, and rank 0 is not blamed for it
        await groups[2].aclose()
        await transports[2].aclose()
        assert two._task is not None and two._task.done()
        await zero.collect()
        assert not transports[0]._mailboxes[2].interrupted
    finally:
        for group in groups:
            await group.aclose()
        await asyncio.gather(*(t.aclose() for t in transports))
    assert all(m is not None and m._task is not None and m._task.done() for m in monitors)
    assert all(t.recorder.on_end is None for t in transports)


# ------------------------------------------------------------------ a real 4-rank job

REPORT_LINE = re.compile(r"WARNING netdist\.trace netdist: straggler report: (.*)")
NAMED = re.compile(r"rank (\d+) arrived last at (\d+) of (\d+) collectives of group "
                   r"(0x[0-9a-f]+) \((\d+) ranks\), late by ([\d.]+) ms \(median\)")


@pytest.mark.timeout(120)
def test_four_processes_rank_0_names_the_rank_that_computes_50ms_longer() -> None:
    procs = start_ranks(4, "tests.trace._straggler_worker", ["2", "0.05", "30", "400"],
                        timeout=30.0, job_prefix="straggler",
                        env={"NETDIST_STRAGGLER_REPORT": "1"})
    done = finish_ranks(procs, 90.0)
    outputs = [p.stdout for p in done]
    for rank, p in enumerate(done):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{p.stdout}"
        assert f"DONE {rank} " in p.stdout, p.stdout
        assert "lost rank" not in p.stdout, p.stdout  # the report changes no goodbye
    named = [NAMED.fullmatch(part) for line in outputs[0].splitlines()
             if (found := REPORT_LINE.fullmatch(line)) for part in found.group(1).split("; ")]
    assert named, f"rank 0 logged no straggler report:\n{outputs[0]}"
    assert all(m is not None for m in named), outputs[0]
    ranks = {int(m.group(1)) for m in named if m is not None}
    assert ranks == {2}, outputs[0]
    for m in named:
        assert m is not None
        last, total, size = int(m.group(2)), int(m.group(3)), int(m.group(5))
        assert size == 4 and total >= 10 and last >= total / 2, m.group(0)
        assert 45.0 <= float(m.group(6)) <= 55.0, m.group(0)
    reported = [line.split() for line in outputs[0].splitlines() if line.startswith("REPORT ")]
    assert [int(fields[1]) for fields in reported] == [2], outputs[0]
    assert 45.0 <= float(reported[0][2]) <= 55.0, outputs[0]
    assert not any(REPORT_LINE.search(out) for out in outputs[1:])  # only rank 0 reports
