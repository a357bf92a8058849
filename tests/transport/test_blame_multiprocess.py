"""Real processes on 127.0.0.1: every survivor names the rank that actually went away.

Rank 2 of each job is killed (SIGKILL), stopped (SIGSTOP), raises, or leaves cleanly
while rank 0 waits on it and rank 1 (or a parameter-server worker) waits on rank 0. Each
rank is ``python -m tests.transport._blame_worker`` with NETDIST_* set, as a launcher
would start it; the test waits for every "READY" line before acting, and every wait on a
subprocess is bounded.
"""

from __future__ import annotations

import json
import re
import signal
from typing import Any

import pytest

from tests.ranks import RankProcess, start_ranks

VICTIM = 2
WAIT = 60.0
"""Bound on each expected output line (generous: a loaded 2-core machine)."""

pytestmark = pytest.mark.slow


def start_job(world_size: int, args: list[str]) -> list[RankProcess]:
    return start_ranks(world_size, "tests.transport._blame_worker", args, timeout=30.0,
                           job_prefix="blame")


def lost(rank: RankProcess) -> dict[str, Any]:
    """The error ``rank`` failed with, as its ``LOST <json>`` line reported it."""
    return json.loads(rank.expect("LOST ", WAIT).removeprefix("LOST "))


def first_rank_named(message: str, after: str = "") -> int:
    """The first "rank N" in ``message`` past the ``after`` prefix: whom it leads with."""
    assert message.startswith(after), message
    found = re.search(r"\brank (\d+)", message[len(after):])
    assert found is not None, message
    return int(found.group(1))


def run_chain(how: str, heartbeat: float = 5.0) -> tuple[dict[str, Any], dict[str, Any]]:
    """Rank 2 goes away ``how``; return what rank 0 and rank 1 failed with."""
    ranks = start_job(3, ["chain", how, str(heartbeat)])
    try:
        for rank in ranks:
            rank.expect("READY", WAIT)
        victim = ranks[VICTIM]
        if how == "kill":
            victim.proc.send_signal(signal.SIGKILL)
        elif how == "stop":
            victim.proc.send_signal(signal.SIGSTOP)
        else:
            victim.send_line("go")
        at_0, at_1 = lost(ranks[0]), lost(ranks[1])
        if how == "leave":
            victim.expect("LEFT", WAIT)
            assert victim.finish(WAIT) == 0, victim.text()
        assert ranks[0].finish(WAIT) == 1 and ranks[1].finish(WAIT) == 1  # they failed
        return at_0, at_1
    finally:
        for rank in ranks:
            rank.kill()


def test_sigkilled_rank_is_named_by_the_rank_that_only_lost_the_messenger():
    at_0, at_1 = run_chain("kill")
    assert (at_0["rank"], at_0["origin"], at_0["via"]) == (2, 2, None)
    assert at_0["message"].startswith(("rank 2 closed the connection (EOF)",
                                       "connection to rank 2 was lost")), at_0
    assert (at_1["rank"], at_1["origin"], at_1["via"]) == (0, 2, 0)
    assert at_1["origin_reason"] == at_0["origin_reason"]
    assert at_1["message"] == (f"{at_0['origin_reason']} — seen by rank 0, which aborted "
                               "while this rank waited for tag 7")


def test_a_rank_that_raises_is_named_with_its_error():
    at_0, at_1 = run_chain("raise")
    assert (at_0["rank"], at_0["origin"], at_0["via"]) == (2, 2, None)
    assert at_0["message"] == ("rank 2 aborted: RuntimeError: boom in step 3 "
                               "while this rank waited for tag 7")
    assert (at_1["rank"], at_1["origin"], at_1["via"]) == (0, 2, 0)
    assert at_1["message"] == ("rank 2 aborted: RuntimeError: boom in step 3 — rank 0 "
                               "aborted in turn while this rank waited for tag 7")


def test_a_rank_that_closes_its_transport_mid_job_is_named_as_having_left():
    at_0, at_1 = run_chain("leave")
    assert (at_0["rank"], at_0["origin"], at_0["via"]) == (2, 2, None)
    assert at_0["message"] == ("rank 2 closed its transport (left the job) "
                               "while this rank waited for tag 7")
    assert (at_1["rank"], at_1["origin"], at_1["via"]) == (0, 2, 0)
    assert at_1["message"] == ("rank 2 closed its transport (left the job) — seen by rank 0, "
                               "which aborted while this rank waited for tag 7")


def test_a_stopped_rank_is_the_origin_for_ranks_that_aborted_on_the_stall():
    at_0, at_1 = run_chain("stop", heartbeat=0.5)
    assert (at_0["rank"], at_0["origin"], at_0["via"]) == (2, 2, None)
    assert at_0["origin_reason"].startswith("rank 2 sent nothing for "), at_0
    assert (at_1["rank"], at_1["origin"], at_1["via"]) == (0, 2, 0)
    assert at_1["message"] == (f"{at_0['origin_reason']} — seen by rank 0, which aborted "
                               "while this rank waited for tag 7")


def test_sync_parameter_server_survivors_name_the_killed_worker_not_the_server():
    ranks = start_job(4, ["ps"])
    try:
        for rank in ranks:
            rank.expect("READY", WAIT)
        ranks[VICTIM].proc.send_signal(signal.SIGKILL)
        server = lost(ranks[0])
        assert first_rank_named(server["message"]) == VICTIM, server
        assert "worker rank 2" in server["message"], server
        for rank in (ranks[1], ranks[3]):
            seen = lost(rank)
            assert seen["type"] == "ParameterServerError", seen
            prefix = f"reduce_gradients on rank {rank.rank}: "
            assert first_rank_named(seen["message"], after=prefix) == VICTIM, seen
            assert "lost the parameter server" not in seen["message"], seen
        assert [ranks[r].finish(WAIT) for r in (0, 1, 3)] == [1, 1, 1]
    finally:
        for rank in ranks:
            rank.kill()
