"""``netdist.transport.links``: the bookkeeping of connections on first use, no sockets.

Senders waiting for a peer's connection are released in call order, one at a time (each
hands the turn on as it starts its frame); one that gives up does not disturb the
others; a sender arriving after the connection came up still queues behind earlier
waiters. Tie refusals are told apart from real authentication failures.
"""

from __future__ import annotations

import asyncio

import pytest

from netdist.errors import AuthenticationError, ConnectError
from netdist.transport.links import (
    PeerLinks,
    is_tie_refusal,
    tie_refusal,
    unreachable_reason,
)
from tests.ranks import start_until_blocked

WAIT = 5.0


async def test_waiting_senders_are_released_in_call_order_one_at_a_time():
    loop = asyncio.get_running_loop()
    links = PeerLinks(loop)
    started: list[int] = []

    async def sender(i: int) -> None:
        await links.wait_turn(3, loop.time() + WAIT, settled=False)
        started.append(i)  # "starts its frame" before the next one may run

    tasks = [await start_until_blocked(sender(i)) for i in range(5)]  # queued, in order
    assert links.has_senders(3) and started == []
    links.settle(3)
    await asyncio.gather(*tasks)
    assert started == [0, 1, 2, 3, 4]
    assert not links.has_senders(3)


async def test_a_sender_arriving_after_settling_queues_behind_earlier_waiters():
    loop = asyncio.get_running_loop()
    links = PeerLinks(loop)
    order: list[str] = []

    async def sender(name: str, settled: bool) -> None:
        await links.wait_turn(1, loop.time() + WAIT, settled=settled)
        order.append(name)

    early = await start_until_blocked(sender("early", False))
    links.settle(1)  # "early" is released but has not run yet
    late = asyncio.ensure_future(sender("late", True))
    await asyncio.gather(early, late)
    assert order == ["early", "late"]
    await sender("alone", True)  # nobody waits: no suspension at all
    assert order == ["early", "late", "alone"] and not links.has_senders(1)


async def test_a_sender_that_times_out_or_is_cancelled_leaves_the_order_intact():
    loop = asyncio.get_running_loop()
    links = PeerLinks(loop)
    order: list[int] = []

    async def sender(i: int, deadline: float) -> None:
        await links.wait_turn(2, deadline, settled=False)
        order.append(i)

    first = await start_until_blocked(sender(0, loop.time() + WAIT))
    expiring = await start_until_blocked(sender(1, loop.time()))  # its deadline has passed
    cancelled = await start_until_blocked(sender(2, loop.time() + WAIT))
    last = await start_until_blocked(sender(3, loop.time() + WAIT))
    with pytest.raises(TimeoutError):
        await expiring
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    links.settle(2)
    await asyncio.gather(first, last)
    assert order == [0, 3] and not links.has_senders(2)


async def test_closing_releases_every_waiter_and_watcher():
    loop = asyncio.get_running_loop()
    links = PeerLinks(loop)
    senders = [await start_until_blocked(links.wait_turn(p, loop.time() + WAIT,
                                                         settled=False)) for p in (1, 1, 2)]
    watcher = await start_until_blocked(links.wait_settled(4, WAIT))
    links.close()
    await asyncio.gather(*senders, watcher)
    await links.wait_turn(5, loop.time() + WAIT, settled=False)  # closed: no wait


async def test_a_watcher_gives_up_quietly_at_its_timeout():
    links = PeerLinks(asyncio.get_running_loop())
    await links.wait_settled(7, 0.01)  # returns, never raises


def test_tie_refusals_are_told_apart_from_authentication_failures():
    refused = AuthenticationError(f"rank 2 at 127.0.0.1:4000 refused rank 5: "
                                  f"{tie_refusal(2, 5)}")
    assert is_tie_refusal(refused)
    assert not is_tie_refusal(AuthenticationError("... token mismatch", code="token"))
    assert not is_tie_refusal(AuthenticationError("duplicate connection from rank 5"))
    assert not is_tie_refusal(ConnectError(tie_refusal(2, 5)))
    assert tie_refusal(2, 5) == ("simultaneous connect: rank 2 keeps the connection it is "
                                 "making to rank 5 (the lower rank's connection wins)")


def test_unreachable_reasons_say_what_happened():
    try:
        raise ConnectError("rank 0 connecting to rank 3: cannot connect") from \
            ConnectionRefusedError(111, "Connection refused")
    except ConnectError as exc:
        refused = exc
    assert unreachable_reason(3, "127.0.0.1:4000", refused) == (
        "rank 3 refused the connection at 127.0.0.1:4000: nothing listens there any more "
        "(it exited, crashed or closed its transport)")
    other = AuthenticationError("rank 3 at 127.0.0.1:4000 refused rank 0: rank 3 is closing")
    assert unreachable_reason(3, "127.0.0.1:4000", other) == (
        "could not connect to rank 3 at 127.0.0.1:4000: rank 3 at 127.0.0.1:4000 refused "
        "rank 0: rank 3 is closing")
