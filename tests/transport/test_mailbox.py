"""A receive that gives up after its frame was matched loses nothing: the message goes to
the next receive on the tag, in order. (Short polling receives, as torch's receive from
any source makes, once dropped a message that matched a poll just before it expired.)"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from netdist.errors import NetdistTimeoutError
from netdist.transport.mailbox import PeerMailbox
from tests.ranks import start_until_blocked


def _land(landing, array: np.ndarray) -> None:
    """What a frame reader does once a frame's payload is in: fill, complete."""
    landing.buffer[...] = array.reshape(-1).view(np.uint8)
    landing.complete()


async def _posted(box: PeerMailbox, tag: int, out=None, timeout: float = 5.0) -> asyncio.Task:
    """A recv on ``tag``, started and posted (it has run up to its wait)."""
    task = await start_until_blocked(box.recv(tag, out, timeout))
    assert box.has_posted(tag)
    return task


@pytest.mark.parametrize("give_up", ["timeout", "cancel"])
async def test_a_message_matched_as_its_receive_gives_up_goes_to_the_next(give_up: str) -> None:
    box = PeerMailbox(0)
    first = await _posted(box, 3, timeout=0.05 if give_up == "timeout" else 5.0)
    landing = box.claim(3, np.dtype(np.float32), (4,))  # the header matched the recv
    if give_up == "timeout":
        with pytest.raises(NetdistTimeoutError, match=r"tag 3"):
            await first
    else:
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
    _land(landing, np.arange(4, dtype=np.float32))  # ... and its payload lands after
    got = await asyncio.wait_for(box.recv(3, None, 5.0), 5)
    np.testing.assert_array_equal(got, np.arange(4, dtype=np.float32))


async def test_a_message_that_landed_as_its_receive_was_cancelled_is_kept() -> None:
    box = PeerMailbox(0)
    first = await _posted(box, 5)
    _land(box.claim(5, np.dtype(np.int32), (1,)), np.array([9], np.int32))
    first.cancel()  # before the receive woke up to take it
    with pytest.raises(asyncio.CancelledError):
        await first
    np.testing.assert_array_equal(await asyncio.wait_for(box.recv(5, None, 5.0), 5), [9])


async def test_a_receive_posted_while_it_lands_adopts_it_and_order_holds() -> None:
    box = PeerMailbox(0)
    first = await _posted(box, 3, timeout=0.05)
    landing = box.claim(3, np.dtype(np.int64), (2,))
    with pytest.raises(NetdistTimeoutError):
        await first
    second = await start_until_blocked(box.recv(3, None, 5.0))  # while it still lands
    later = box.claim(3, np.dtype(np.int64), (2,))  # the next frame on the same tag
    _land(landing, np.array([1, 1]))
    _land(later, np.array([2, 2]))
    np.testing.assert_array_equal(await asyncio.wait_for(second, 5), [1, 1])
    np.testing.assert_array_equal(await asyncio.wait_for(box.recv(3, None, 5.0), 5), [2, 2])


async def test_a_message_landed_in_an_abandoned_out_is_kept_as_a_copy() -> None:
    box = PeerMailbox(0)
    out = np.zeros(3, np.float64)
    first = await _posted(box, 7, out=out, timeout=0.05)
    landing = box.claim(7, np.dtype(np.float64), (3,))
    with pytest.raises(NetdistTimeoutError):
        await first
    assert landing.withdrawn  # over TCP the link is dropped if this lands any further
    _land(landing, np.array([1.0, 2.0, 3.0]))
    out[...] = -1  # the caller reuses its buffer: the kept message is unaffected
    got = await asyncio.wait_for(box.recv(7, None, 5.0), 5)
    np.testing.assert_array_equal(got, [1.0, 2.0, 3.0])


async def test_polling_with_tiny_timeouts_over_tcp_loses_nothing(tcp_group) -> None:
    """Over real sockets: one large message, received by a loop of 1 ms polls (most
    expire while it lands), then a small one on the same tag; both arrive, in order."""
    a, b = await tcp_group(2)
    big = np.arange(8 * 1024 * 1024, dtype=np.float32)
    sends = asyncio.ensure_future(asyncio.gather(a.send(1, big, tag=11),
                                                 a.send(1, np.array([7.0]), tag=11)))
    received = []
    polls = 0
    async with asyncio.timeout(60):
        while len(received) < 2:
            polls += 1
            try:
                received.append(await b.recv(0, tag=11, timeout=0.001))
            except NetdistTimeoutError:
                continue
        await sends
    assert polls > 2  # some polls did expire
    np.testing.assert_array_equal(received[0], big)
    np.testing.assert_array_equal(received[1], [7.0])
