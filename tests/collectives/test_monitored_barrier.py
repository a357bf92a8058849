"""``Group.monitored_barrier``: passes when every rank comes, and otherwise rank 0 names
the ranks that did not (the first, or all with ``wait_all_ranks``) while the others say
rank 0 knows; in-process and over real TCP."""

from __future__ import annotations

from typing import Any

import pytest

from netdist.collectives import Group, Work
from netdist.errors import NetdistTimeoutError
from tests.ranks import run_ranks

TRANSPORTS = {"inprocess": False, "tcp": True}


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_monitored_barrier_passes_when_every_rank_arrives(transport: str) -> None:
    async def body(g: Group) -> Any:
        first = await g.monitored_barrier(timeout=10)
        second = await g.monitored_barrier(timeout=10, wait_all_ranks=True)
        work = await g.monitored_barrier(timeout=10, async_op=True)
        assert isinstance(work, Work)
        third = await work
        await g.barrier(timeout=10)  # the tag streams are still in step
        return first, second, third

    assert await run_ranks(3, body, tcp=TRANSPORTS[transport]) == [(None, None, None)] * 3


def _outcome(result: Any) -> Any:
    if isinstance(result, NetdistTimeoutError):
        return str(result)
    assert not isinstance(result, BaseException), repr(result)
    return result


@pytest.mark.parametrize("wait_all_ranks", [False, True])
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_monitored_barrier_names_the_ranks_that_did_not_arrive(
        transport: str, wait_all_ranks: bool) -> None:
    async def body(g: Group) -> Any:
        if g.rank in (2, 3):
            return "absent"
        await g.monitored_barrier(timeout=0.4, wait_all_ranks=wait_all_ranks)
        return "passed"

    results = await run_ranks(4, body, tcp=TRANSPORTS[transport], return_exceptions=True)
    root, other = (_outcome(r) for r in results[:2])
    assert results[2:] == ["absent", "absent"]
    missing = "Ranks 2, 3" if wait_all_ranks else "Rank 2"
    assert root.startswith("monitored_barrier on group 0x"), root
    assert root.endswith(f"(group rank 0 of 4, transport rank 0): [Rank 0]: {missing} failed "
                         "to pass monitoredBarrier in 400 ms"), root
    assert other.startswith("monitored_barrier on group 0x"), other
    assert ("(group rank 1 of 4, transport rank 1): Rank 1 successfully reached "
            "monitoredBarrier, but received errors while waiting for send/recv from rank 0. "
            "Please check rank 0 logs for faulty rank.") in other, other


async def test_monitored_barrier_of_a_subgroup_names_group_and_transport_ranks() -> None:
    async def body(g: Group) -> Any:
        sub = g.new_group([2, 0, 1])  # group rank 2 is transport rank 1
        if sub.rank == 2:
            return "absent"
        try:
            await sub.monitored_barrier(timeout=0.3, wait_all_ranks=True)
        except NetdistTimeoutError as exc:
            return str(exc)
        return "passed"

    other, absent, root = await run_ranks(3, body)  # by transport rank
    assert absent == "absent"
    assert root.endswith("[Rank 0]: Rank 2 (transport rank 1) failed to pass "
                         "monitoredBarrier in 300 ms"), root
    assert "(group rank 1 of 3, transport rank 0): Rank 1 successfully reached" in other, other


async def test_monitored_barrier_with_no_time_fails_at_once_and_refuses_negative() -> None:
    async def body(g: Group) -> str:
        with pytest.raises(ValueError, match="timeout must be > 0"):
            await g.monitored_barrier(timeout=-1)
        with pytest.raises(NetdistTimeoutError) as info:
            await g.monitored_barrier(timeout=0)  # as Gloo's: rank 0 gives no time at all
        return str(info.value)

    root, other = await run_ranks(2, body)
    assert root.endswith("(group rank 0 of 2, transport rank 0): Rank 0 timed out in "
                         "monitoredBarrier after 0 ms"), root
    assert "Rank 1 successfully reached monitoredBarrier" in other, other
