"""Blaming the rank that actually went away (issue 12, item 13: the transport side).

A rank that aborts or leaves after losing a peer tells its other peers who went away
first (an ERROR frame with ``origin``), so ``PeerLostError.origin_rank`` names the same
rank everywhere. These tests use real TCP connections on 127.0.0.1 inside one process;
``test_blame_multiprocess.py`` does the same with real processes, SIGKILL and SIGSTOP.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from netdist.collectives import Group
from netdist.errors import PeerLostError
from netdist.transport import InProcessTransport
from netdist.transport.blame import (
    MAX_REASON_CHARS,
    Departure,
    LossOrigin,
    describe_failure,
    farewell_fields,
    one_line,
    read_farewell,
)
from netdist.wire import FrameKind, encode_control
from tests.ranks import start_until_blocked

WAIT = 10.0
"""Bound on every receive in these tests (the failures under test arrive at once)."""


async def lost_while_waiting(transport, src: int, tag: int = 7) -> PeerLostError:
    """Post a receive from ``src`` and return the ``PeerLostError`` it fails with."""
    with pytest.raises(PeerLostError) as info:
        await transport.recv(src, tag=tag, timeout=WAIT)
    return info.value


async def waiting(transport, src: int, tag: int = 7) -> asyncio.Task[PeerLostError]:
    """A task waiting on a receive from ``src``, posted before this returns."""
    task = await start_until_blocked(lost_while_waiting(transport, src, tag))
    assert transport._mailboxes[src].has_posted(tag)
    return task


def crash(transport) -> None:
    """Drop every socket of ``transport`` without a goodbye, as a killed process would."""
    for conn in transport._connections:
        if conn is not None and conn.transport is not None:
            conn.transport.abort()


# -- the pure part: fields, messages, parsing ------------------------------------------


def test_peer_lost_error_defaults_to_being_its_own_origin():
    exc = PeerLostError(3, "rank 3 closed the connection (EOF)")
    assert (exc.rank, exc.origin_rank, exc.via) == (3, 3, None)
    assert exc.origin_reason == "rank 3 closed the connection (EOF)"
    relayed = PeerLostError(0, "text", origin_rank=5, origin_reason="rank 5 closed")
    assert (relayed.rank, relayed.origin_rank, relayed.via) == (0, 5, 0)
    again = relayed.with_message("all_reduce: text")
    assert (str(again), again.rank, again.origin_rank, again.origin_reason) == (
        "all_reduce: text", 0, 5, "rank 5 closed")


def test_farewell_round_trip_and_messages():
    eof = LossOrigin(5, "rank 5 closed the connection (EOF)", seen_by=0)
    fields = farewell_fields(0, eof, Departure.ABORTED)
    assert fields == {
        "reason": "rank 0 aborted because rank 5 was lost: rank 5 closed the connection (EOF)",
        "rank": 0, "origin": 5, "origin_reason": "rank 5 closed the connection (EOF)",
        "seen_by": 0, "code": "aborted"}
    told = read_farewell(fields, sender=0)
    assert told.origin == eof and told.how is Departure.ABORTED
    assert told.message() == "rank 5 closed the connection (EOF) — seen by rank 0, which aborted"
    closed = read_farewell(farewell_fields(0, eof, Departure.CLOSED), sender=0)
    assert closed.message() == ("rank 5 closed the connection (EOF) — seen by rank 0, "
                                "which then closed its transport")
    # a second hop: rank 1 heard it from rank 0 and aborted too
    hop = read_farewell(farewell_fields(1, eof, Departure.ABORTED), sender=1)
    assert hop.message() == ("rank 5 closed the connection (EOF) (first seen by rank 0) — "
                             "rank 1 aborted in turn")
    own = LossOrigin(2, "rank 2 aborted: RuntimeError: boom", seen_by=2)
    assert read_farewell(farewell_fields(2, own, Departure.ABORTED), 2).message() == \
        "rank 2 aborted: RuntimeError: boom"
    assert read_farewell(farewell_fields(0, own, Departure.ABORTED), 0).message() == \
        "rank 2 aborted: RuntimeError: boom — rank 0 aborted in turn"


def test_farewell_frame_golden_bytes():
    """docs/PROTOCOL.md section 7.1, pinned: prefix, then the msgpack map in this order."""
    eof = LossOrigin(5, "rank 5 closed the connection (EOF)", seen_by=0)
    frame = encode_control(FrameKind.ERROR, farewell_fields(0, eof, Departure.ABORTED))
    assert frame == (
        bytes.fromhex("4e440105aa0000000000000000000000")
        + b"\x86\xa6reason\xd9Jrank 0 aborted because rank 5 was lost: rank 5 closed the "
          b"connection (EOF)\xa4rank\x00\xa6origin\x05\xadorigin_reason\xd9\"rank 5 closed "
          b"the connection (EOF)\xa7seen_by\x00\xa4code\xa7aborted")


@pytest.mark.parametrize("fields", [
    {"reason": "disk full"},
    {"reason": "disk full", "origin": "5", "origin_reason": "rank 5 left"},
    {"reason": "disk full", "origin": True, "origin_reason": "rank 5 left"},
    {"reason": "disk full", "origin": -1, "origin_reason": "rank 5 left"},
    {"reason": "disk full", "origin": 5, "origin_reason": 17},
    {"reason": "disk full", "origin": 5},
])
def test_a_plain_or_malformed_error_frame_blames_its_sender(fields):
    told = read_farewell(fields, sender=4)
    assert told.origin == LossOrigin(
        4, "rank 4 reported an error and dropped the connection: disk full", 4)
    assert told.message() == "rank 4 reported an error and dropped the connection: disk full"


def test_reasons_are_one_bounded_line_and_always_fit_a_header():
    assert one_line("a\n  b\tc\n") == "a b c"
    long = one_line("x" * 10_000)
    assert len(long) == MAX_REASON_CHARS and long.endswith("...")
    assert describe_failure(2, RuntimeError("boom\nat step 3")) == \
        "rank 2 aborted: RuntimeError: boom at step 3"
    assert describe_failure(2, KeyboardInterrupt()) == \
        "rank 2 aborted: interrupted (KeyboardInterrupt)"
    assert describe_failure(2, asyncio.CancelledError()) == "rank 2 aborted: CancelledError"

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    assert describe_failure(2, Unprintable()) == "rank 2 aborted: Unprintable: <unprintable>"
    huge = LossOrigin(9, one_line("rank 9 " + "y" * 100_000), seen_by=1)
    frame = encode_control(FrameKind.ERROR, farewell_fields(1, huge, Departure.ABORTED))
    assert len(frame) < 2048


# -- over real TCP connections ----------------------------------------------------------


async def test_a_rank_failing_on_its_own_error_names_itself_and_the_next_hop_keeps_it(
        tcp_group):
    a, b, c = await tcp_group(3)
    at_a = await waiting(a, 2)
    at_b = await waiting(b, 0)
    await c.abort(RuntimeError("boom"))
    lost = await at_a
    assert (lost.rank, lost.origin_rank, lost.via) == (2, 2, None)
    assert str(lost) == "rank 2 aborted: RuntimeError: boom while this rank waited for tag 7"
    await a.abort(lost)  # rank 0 fails because of it
    relayed = await at_b
    assert (relayed.rank, relayed.origin_rank, relayed.via) == (0, 2, 0)
    assert relayed.origin_reason == "rank 2 aborted: RuntimeError: boom"
    assert str(relayed) == ("rank 2 aborted: RuntimeError: boom — rank 0 aborted in turn "
                            "while this rank waited for tag 7")


async def test_a_crashed_rank_is_the_origin_for_ranks_that_only_lost_the_messenger(
        tcp_group):
    a, b, c = await tcp_group(3)
    at_a = await waiting(a, 2)
    at_b = await waiting(b, 0)
    crash(c)  # no BYE, no ERROR: the sockets just go away
    lost = await at_a
    assert (lost.rank, lost.origin_rank, lost.via) == (2, 2, None)
    assert lost.origin_reason.startswith(("rank 2 closed the connection (EOF)",
                                          "connection to rank 2 was lost"))
    # rank 0 fails with an error of its own that merely wraps the loss
    try:
        raise RuntimeError("training step failed") from lost
    except RuntimeError as wrapped:
        await a.abort(wrapped)
    relayed = await at_b
    assert (relayed.rank, relayed.origin_rank, relayed.via) == (0, 2, 0)
    assert str(relayed) == (f"{lost.origin_reason} — seen by rank 0, which aborted "
                            "while this rank waited for tag 7")


async def test_a_rank_that_closes_cleanly_is_named_as_having_left(tcp_group):
    a, b, c = await tcp_group(3)
    at_a = await waiting(a, 2)
    at_b = await waiting(b, 0)
    await c.aclose()  # exits normally while rank 0 still waits on it
    lost = await at_a
    assert (lost.rank, lost.origin_rank) == (2, 2)
    assert str(lost) == ("rank 2 closed its transport (left the job) "
                         "while this rank waited for tag 7")
    await a.abort(lost)
    relayed = await at_b
    assert (relayed.rank, relayed.origin_rank, relayed.via) == (0, 2, 0)
    assert str(relayed) == ("rank 2 closed its transport (left the job) — seen by rank 0, "
                            "which aborted while this rank waited for tag 7")


async def test_closing_cleanly_after_a_crash_still_names_the_crashed_rank(tcp_group):
    a, b, c = await tcp_group(3)
    crash(c)
    first = await lost_while_waiting(a, 2, tag=99)  # rank 0 has registered the loss
    at_b = await waiting(b, 0)
    await a.aclose()  # no exception: but rank 0 leaves after losing rank 2
    relayed = await at_b
    assert (relayed.rank, relayed.origin_rank, relayed.via) == (0, 2, 0)
    assert str(relayed) == (f"{first.origin_reason} — seen by rank 0, which then closed "
                            "its transport while this rank waited for tag 7")


async def test_closing_after_a_goodbye_that_cut_a_wait_short_names_the_leaver(tcp_group):
    """Rank 2 leaves politely while rank 0 waits on it; rank 0 then closes (no exception,
    as a failed process does on its way out): rank 1 learns that rank 2 went first."""
    a, b, c = await tcp_group(3)
    at_a = await waiting(a, 2)
    at_b = await waiting(b, 0)
    await c.aclose()
    assert (await at_a).origin_rank == 2
    await a.aclose()
    relayed = await at_b
    assert (relayed.rank, relayed.origin_rank, relayed.via) == (0, 2, 0)
    assert str(relayed).startswith("rank 2 closed its transport (left the job) — seen by "
                                   "rank 0, which then closed its transport")


async def test_a_goodbye_nobody_waited_on_is_nobodys_fault(tcp_group):
    """Rank 2 finishes and leaves while rank 0 waits on nothing from it: rank 0's own
    clean close later is a plain goodbye, not a relay of rank 2's departure."""
    a, b, c = await tcp_group(3)
    await c.aclose()
    await a._connections[2].wait_closed(WAIT)  # rank 2's goodbye has arrived at rank 0
    assert isinstance(a.lost_peer_error(2), PeerLostError)
    at_b = await waiting(b, 0)
    await a.aclose()
    lost = await at_b
    assert (lost.rank, lost.origin_rank, lost.via) == (0, 0, None)
    assert str(lost) == ("rank 0 closed its transport (left the job) "
                         "while this rank waited for tag 7")


async def test_a_clean_close_with_nothing_lost_is_a_plain_goodbye(tcp_group):
    a, b = await tcp_group(2)
    at_b = await waiting(b, 0)
    await a.abort(SystemExit(0))  # exit code 0 is a clean exit, not a failure
    lost = await at_b
    assert (lost.rank, lost.origin_rank, lost.via) == (0, 0, None)
    assert str(lost) == ("rank 0 closed its transport (left the job) "
                         "while this rank waited for tag 7")
    with pytest.raises(PeerLostError, match=r"^rank 0 closed its transport \(left the job\) "
                                            r"before this rank's recv on tag 3$"):
        await b.recv(0, tag=3, timeout=WAIT)


async def test_leaving_async_with_on_an_exception_aborts_with_it(tcp_group):
    a, b = await tcp_group(2)
    at_b = await waiting(b, 0)
    with pytest.raises(ValueError, match="bad batch"):
        async with a:
            raise ValueError("bad batch 17")
    lost = await at_b
    assert (lost.rank, lost.origin_rank) == (0, 0)
    assert str(lost) == "rank 0 aborted: ValueError: bad batch 17 while this rank waited for tag 7"


async def test_a_malformed_origin_from_a_peer_is_ignored_not_raised(tcp_group):
    a, b = await tcp_group(2)
    at_a = await waiting(a, 1)
    b._connections[0].write_control(encode_control(
        FrameKind.ERROR, {"reason": "out of memory", "origin": "five", "seen_by": []}))
    lost = await at_a
    assert (lost.rank, lost.origin_rank, lost.via) == (1, 1, None)
    assert str(lost) == ("rank 1 reported an error and dropped the connection: out of memory "
                         "while this rank waited for tag 7")


async def test_collectives_keep_the_origin_and_lead_with_it(tcp_group):
    transports = await tcp_group(3)
    groups = [Group(t, timeout=WAIT) for t in transports]
    data = [np.full(8, r, np.float64) for r in range(3)]
    await asyncio.gather(*(g.all_reduce(d) for g, d in zip(groups, data)))  # all healthy

    async def survivor(r: int) -> PeerLostError:
        with pytest.raises(PeerLostError) as info:
            await groups[r].all_reduce(data[r])
        await transports[r].abort(info.value)  # as its process would, on the way out
        return info.value

    await transports[2].abort(RuntimeError("boom"))
    for r, lost in zip((0, 1), await asyncio.gather(survivor(0), survivor(1))):
        assert lost.origin_rank == 2, (r, str(lost))
        assert lost.origin_reason == "rank 2 aborted: RuntimeError: boom"
        assert str(lost).startswith("all_reduce on group "), str(lost)
        assert "rank 2 aborted: RuntimeError: boom" in str(lost)


async def test_every_transport_can_abort_and_async_with_uses_it():
    a, b = InProcessTransport.create_group(2, timeout=WAIT)
    with pytest.raises(ValueError, match="bad batch"):
        async with a:  # the default abort closes; in-process peers have nothing to relay
            raise ValueError("bad batch")
    assert a.closed
    await b.abort("giving up")
    assert b.closed
