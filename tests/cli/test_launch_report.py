"""``netdist.launch_report``: the failure summary, built from plain records (no processes).

The real launcher runs are in ``test_launch_blame.py``; here every blame rule is pinned
with exact lines.
"""

from __future__ import annotations

import signal

from netdist.launch_report import (
    RankExit,
    error_block,
    error_line,
    is_consequence,
    summarize_failure,
    worth_printing,
)

OWN_TRACEBACK = (
    "Traceback (most recent call last):",
    '  File "/job/train.py", line 30, in <module>',
    "    asyncio.run(main())",
    '  File "/usr/lib/python3.11/asyncio/runners.py", line 190, in run',
    "    return runner.run(main)",
    "           ^^^^^^^^^^^^^^^^",
    '  File "/job/train.py", line 12, in main',
    '    raise RuntimeError("boom at step 3")',
    "RuntimeError: boom at step 3",
)

CHAINED_PEER_LOST = (
    "Traceback (most recent call last):",
    '  File "/work/netdist/transport/mailbox.py", line 220, in _wait',
    "    return await future",
    "netdist.errors.PeerLostError: rank 1 closed its transport",
    "",
    "The above exception was the direct cause of the following exception:",
    "",
    "Traceback (most recent call last):",
    '  File "/job/train.py", line 14, in main',
    "    await g.all_reduce(a)",
    "netdist.errors.PeerLostError: all_reduce: lost group rank 1: rank 1 closed its transport",
)


def test_error_line_reads_python_and_cli_errors() -> None:
    assert error_line(OWN_TRACEBACK) == "RuntimeError: boom at step 3"
    assert error_line(CHAINED_PEER_LOST) == (
        "PeerLostError: all_reduce: lost group rank 1: rank 1 closed its transport")
    assert error_line(["netdist worker: error: PeerLostError: lost rank 2"]) == (
        "PeerLostError: lost rank 2")
    assert error_line(["netdist bench (rank 1): error: --sizes: bad"]) == "--sizes: bad"
    assert error_line(["KeyboardInterrupt"]) == "KeyboardInterrupt"
    assert error_line(["netdist: rank 0 lost rank 1: rank 1 aborted: RuntimeError: boom"]) == (
        "lost rank 1: rank 1 aborted: RuntimeError: boom")
    # ExceptionGroup members are indented behind "| "
    assert error_line(["  | ValueError: bad shard", "  +------------"]) == "ValueError: bad shard"
    # source lines and plain log lines are not errors
    assert error_line(["    raise ValueError(x)", "loss 0.25", "    except KeyError:"]) is None
    assert error_line(["x" * 50 + ": " + "y" * 1000]) is None
    long = error_line(["RuntimeError: " + "z" * 1000])
    assert long is not None and len(long) == 300 and long.endswith("...")


def test_consequences_are_lost_peers_only() -> None:
    assert is_consequence("PeerLostError: lost rank 1")
    assert is_consequence("TransportClosedError: closed")
    assert is_consequence("lost rank 1: rank 1 aborted: RuntimeError: boom")
    assert not is_consequence("RuntimeError: boom")
    assert not is_consequence(None)


def test_error_block_keeps_the_end_of_the_last_traceback() -> None:
    assert error_block(OWN_TRACEBACK, limit=6) == [
        "Traceback (most recent call last):",
        "  ...",
        "    return runner.run(main)",  # the ^^^^ marker line is dropped
        '  File "/job/train.py", line 12, in main',
        '    raise RuntimeError("boom at step 3")',
        "RuntimeError: boom at step 3",
    ]
    assert error_block(["starting", "netdist worker: error: cannot resume"]) == ["cannot resume"]
    assert error_block(["a", "b", "", "c"]) == ["a", "b", "c"]


def test_first_failure_is_shown_with_its_own_error_then_one_line_per_rank() -> None:
    exits = [
        RankExit(1, 1, order=0, stderr_tail=OWN_TRACEBACK),
        RankExit(2, 1, order=1, stderr_tail=CHAINED_PEER_LOST),
        RankExit(0, -signal.SIGTERM, order=2, after_terminate=True),
        RankExit(3, -signal.SIGTERM, order=3, stderr_tail=CHAINED_PEER_LOST,
                 after_terminate=True),
    ]
    assert summarize_failure(exits) == [
        "job failed; first failure: rank 1 exited with code 1:",
        *(f"  rank 1 | {line}" for line in error_block(OWN_TRACEBACK)),
        "then, in the order they exited:",
        "  rank 2: PeerLostError: all_reduce: lost group rank 1: rank 1 closed its transport"
        " (exit code 1; a consequence)",
        "  rank 0: terminated by the launcher (SIGTERM)",
        "  rank 3: PeerLostError: all_reduce: lost group rank 1: rank 1 closed its transport"
        " (then terminated by the launcher with SIGTERM; a consequence)",
    ]
    assert worth_printing(exits)


def test_a_consequence_reaped_first_does_not_take_the_blame() -> None:
    # Two ranks exiting within a millisecond may be reaped in either order.
    exits = [
        RankExit(0, 1, order=0, stderr_tail=CHAINED_PEER_LOST),
        RankExit(1, 1, order=1, stderr_tail=OWN_TRACEBACK),
    ]
    lines = summarize_failure(exits)
    assert lines[0] == "job failed; first failure: rank 1 exited with code 1:"
    assert lines[-1] == ("  rank 0: PeerLostError: all_reduce: lost group rank 1: rank 1 closed"
                         " its transport (exit code 1; a consequence)")


def test_own_error_still_shutting_down_at_sigterm_takes_the_blame() -> None:
    # Rank 1 raised and printed its traceback, but rank 2's consequence was reaped first
    # and the launcher's SIGTERM caught rank 1 in its interpreter shutdown.
    exits = [
        RankExit(2, 1, order=0, stderr_tail=CHAINED_PEER_LOST),
        RankExit(0, -signal.SIGTERM, order=1, after_terminate=True),
        RankExit(1, -signal.SIGTERM, order=2, stderr_tail=OWN_TRACEBACK, after_terminate=True),
    ]
    lines = summarize_failure(exits)
    assert lines[0] == ("job failed; first failure: rank 1 failed with its own error (then was "
                        "killed by signal 15 (SIGTERM) after the launcher's SIGTERM):")
    assert lines[-3:] == [
        "then, in the order they exited:",
        "  rank 2: PeerLostError: all_reduce: lost group rank 1: rank 1 closed its transport"
        " (exit code 1; a consequence)",
        "  rank 0: terminated by the launcher (SIGTERM)",
    ]


def test_rank_that_exits_0_while_others_run_is_named_first() -> None:
    exits = [
        RankExit(3, 0, order=0),
        RankExit(0, 1, order=1, stderr_tail=("netdist worker: error: PeerLostError: "
                                             "lost connection to rank 3",)),
        RankExit(1, 1, order=2, stderr_tail=CHAINED_PEER_LOST),
        RankExit(2, -signal.SIGTERM, order=3, after_terminate=True),
    ]
    assert summarize_failure(exits) == [
        "job failed; first to go: rank 3 exited (code 0) while ranks 0, 1, 2 were still running",
        "first error: rank 0 exited with code 1:",
        "  rank 0 | PeerLostError: lost connection to rank 3",
        "then, in the order they exited:",
        "  rank 1: PeerLostError: all_reduce: lost group rank 1: rank 1 closed its transport"
        " (exit code 1; a consequence)",
        "  rank 2: terminated by the launcher (SIGTERM)",
    ]
    # no stderr anywhere, but the blame differs from "rank 0 exited with code 1"
    assert worth_printing([RankExit(1, 0, order=0), RankExit(0, 1, order=1)])


def test_stopped_rank_is_named_first() -> None:
    exits = [
        RankExit(0, 1, order=0, stderr_tail=CHAINED_PEER_LOST),
        RankExit(1, -signal.SIGTERM, order=1, after_terminate=True, stopped=True),
    ]
    lines = summarize_failure(exits)
    assert lines[0] == ("job failed; first to go: rank 1 was stopped (process state T, "
                        "e.g. SIGSTOP) while rank 0 ran")
    assert lines[1] == "first error: rank 0 exited with code 1:"


def test_nothing_to_add_means_no_summary() -> None:
    # One rank failed without a word; the launcher's one-line report says it all.
    exits = [RankExit(1, 5, order=0), RankExit(0, -signal.SIGTERM, order=1, after_terminate=True)]
    assert not worth_printing(exits)
    assert summarize_failure(exits)[0] == ("job failed; first failure: rank 1 exited with "
                                           "code 5 (nothing on stderr)")
    assert summarize_failure([]) == []
    # a one-rank job's traceback is right above; no need to repeat it
    assert not worth_printing([RankExit(0, 1, order=0, stderr_tail=OWN_TRACEBACK)])
