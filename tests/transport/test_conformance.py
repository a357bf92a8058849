"""One conformance suite for every Transport: in-process and TCP, asyncio and uvloop.

Each test gets ``make_group`` (see conftest): ``await make_group(n)`` returns n connected
transports of the parametrized kind, closed after the test.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from netdist.errors import (
    LocalProtocolError,
    NetdistTimeoutError,
    PeerLostError,
    TransportClosedError,
)
from netdist.transport import Transport
from tests.ranks import start_until_blocked


async def test_rank_and_world_size(make_group):
    group = await make_group(3)
    assert [t.rank for t in group] == [0, 1, 2]
    assert {t.world_size for t in group} == {3}


async def test_order_per_pair_and_tag_with_many_messages(make_group):
    a, b = await make_group(2)
    count = 300

    async def sender() -> None:
        for i in range(count):
            await a.send(1, np.array([i, -i], dtype=np.int64), tag=5)

    async def receiver() -> list[int]:
        got = []
        for _ in range(count):
            message = await b.recv(0, tag=5)
            assert message.dtype == np.int64 and message.shape == (2,)
            assert message[1] == -message[0]
            got.append(int(message[0]))
        return got

    _, got = await asyncio.gather(sender(), receiver())
    assert got == list(range(count))


async def test_both_directions_at_once(make_group):
    a, b = await make_group(2)
    count = 50

    async def pump(src: Transport, dst: int, base: int) -> list[int]:
        async def out() -> None:
            for i in range(count):
                await src.send(dst, np.array([base + i]), tag=1)

        async def into() -> list[int]:
            return [int((await src.recv(dst, tag=1))[0]) for _ in range(count)]

        _, got = await asyncio.gather(out(), into())
        return got

    got_a, got_b = await asyncio.gather(pump(a, 1, 0), pump(b, 0, 1000))
    assert got_a == [1000 + i for i in range(count)]
    assert got_b == list(range(count))


async def test_interleaved_tags_are_independent(make_group):
    a, b = await make_group(2)
    for i in range(20):
        await a.send(1, np.array([i], np.int32), tag=1)
        await a.send(1, np.array([100 + i], np.int32), tag=2)
    # drain tag 2 first: tag 1 messages wait, order within each tag is kept
    tag2 = [int((await b.recv(0, tag=2))[0]) for _ in range(20)]
    tag1 = [int((await b.recv(0, tag=1))[0]) for _ in range(20)]
    assert tag2 == [100 + i for i in range(20)]
    assert tag1 == list(range(20))


async def test_receives_posted_on_several_tags_before_sends(make_group):
    a, b = await make_group(2)
    tasks = [await start_until_blocked(b.recv(0, tag=tag)) for tag in (7, 3, 9)]  # posted
    for tag in (9, 7, 3):
        await a.send(1, np.full(4, tag, np.int16), tag=tag)
    results = await asyncio.gather(*tasks)
    assert [r.tolist() for r in results] == [[7] * 4, [3] * 4, [9] * 4]


async def test_large_tags(make_group):
    a, b = await make_group(2)
    big = 2**40 + 3
    await a.send(1, b"x", tag=big)
    await a.send(1, b"y", tag=0)
    assert bytes(await b.recv(0, tag=big)) == b"x"
    assert bytes(await b.recv(0, tag=0)) == b"y"


async def test_out_receive_lands_in_the_given_buffer_when_posted_first(make_group):
    a, b = await make_group(2)
    out = np.zeros((64, 33), np.float32)
    pending = await start_until_blocked(b.recv(0, tag=4, out=out))  # posted: lands in out
    data = np.arange(64 * 33, dtype=np.float32).reshape(64, 33)
    await a.send(1, data, tag=4)
    result = await pending
    assert result is out
    np.testing.assert_array_equal(out, data)


async def test_unexpected_message_held_then_received_with_out(make_group):
    a, b = await make_group(2)
    data = np.linspace(0.0, 1.0, 1000)
    await a.send(1, data, tag=2)
    await a.send(1, data * 2, tag=2)
    out = np.empty(1000)
    result = await b.recv(0, tag=2, out=out)
    assert result is out
    np.testing.assert_array_equal(out, data)
    second = await b.recv(0, tag=2)
    np.testing.assert_array_equal(second, data * 2)


async def test_unexpected_message_without_out_keeps_dtype_and_shape(make_group):
    a, b = await make_group(2)
    data = np.arange(24, dtype=np.int16).reshape(2, 3, 4)
    await a.send(1, data, tag=0)
    result = await b.recv(0)
    assert result.dtype == np.int16 and result.shape == (2, 3, 4)
    np.testing.assert_array_equal(result, data)


async def test_out_of_another_dtype_receives_the_raw_bytes(make_group):
    a, b = await make_group(2)
    data = np.arange(8, dtype=np.float32)
    await a.send(1, data)
    out = np.empty(32, np.uint8)
    result = await b.recv(0, out=out)
    assert result is out
    assert out.tobytes() == data.tobytes()


async def test_sender_may_reuse_its_buffer_after_send_returns(make_group):
    a, b = await make_group(2)
    buffer = np.zeros(100_000, np.float64)
    for value in (1.0, 2.0, 3.0):
        buffer[...] = value
        await a.send(1, buffer, tag=6)
    buffer[...] = -1.0
    for value in (1.0, 2.0, 3.0):
        message = await b.recv(0, tag=6)
        assert float(message.min()) == value == float(message.max())


@pytest.mark.parametrize("array", [
    np.empty((0,), np.float32),
    np.empty((3, 0, 2), np.int64),
    np.array(3.5),
    np.array(-7, dtype=np.int8),
    np.array([True, False, True]),
    np.arange(6, dtype=np.uint64).reshape(3, 2) * (2**60),
    np.array([1.5, -2.25], dtype=np.float16),
], ids=["empty", "empty-3d", "0d-float", "0d-int8", "bool", "uint64", "float16"])
async def test_shapes_and_dtypes_round_trip(make_group, array):
    a, b = await make_group(2)
    await a.send(1, array, tag=3)
    result = await b.recv(0, tag=3)
    assert result.dtype == array.dtype
    assert result.shape == array.shape
    np.testing.assert_array_equal(result, array)


async def test_zero_size_and_0d_into_out(make_group):
    a, b = await make_group(2)
    empty_out = np.empty((0, 5), np.float32)
    scalar_out = np.empty((), np.float64)
    pending = asyncio.gather(b.recv(0, tag=1, out=empty_out), b.recv(0, tag=2, out=scalar_out))
    await a.send(1, np.empty((0, 5), np.float32), tag=1)
    await a.send(1, np.array(2.5), tag=2)
    got_empty, got_scalar = await pending
    assert got_empty is empty_out and got_scalar is scalar_out
    assert float(scalar_out) == 2.5


@pytest.mark.parametrize("payload", [b"hello world", bytearray(b"\x00\xffabc"),
                                     memoryview(b"memory view")],
                         ids=["bytes", "bytearray", "memoryview"])
async def test_bytes_payload_arrives_as_uint8(make_group, payload):
    a, b = await make_group(2)
    await a.send(1, payload, tag=8)
    result = await b.recv(0, tag=8)
    assert result.dtype == np.uint8
    assert result.tobytes() == bytes(payload)


async def test_non_contiguous_and_big_endian_input_is_normalised(make_group):
    a, b = await make_group(2)
    base = np.arange(20, dtype=np.int32).reshape(4, 5)
    await a.send(1, base[:, ::2], tag=1)
    await a.send(1, np.arange(5, dtype=">f8"), tag=2)
    np.testing.assert_array_equal(await b.recv(0, tag=1), base[:, ::2])
    big_endian = await b.recv(0, tag=2)
    np.testing.assert_array_equal(big_endian, np.arange(5, dtype=np.float64))


async def test_all_pairs_exchange_in_a_group_of_four(make_group):
    group = await make_group(4)

    async def run(t: Transport) -> dict[int, list[int]]:
        sends = [t.send(peer, np.array([t.rank * 10 + peer] * 3), tag=11)
                 for peer in range(4) if peer != t.rank]
        recvs = {peer: t.recv(peer, tag=11) for peer in range(4) if peer != t.rank}
        results = await asyncio.gather(*sends, *recvs.values())
        return {peer: r.tolist() for peer, r in zip(recvs, results[len(sends):])}

    outcomes = await asyncio.gather(*(run(t) for t in group))
    for rank, got in enumerate(outcomes):
        assert got == {peer: [peer * 10 + rank] * 3 for peer in range(4) if peer != rank}


async def test_concurrent_sends_to_one_peer_never_interleave(make_group):
    a, b = await make_group(2)
    arrays = {tag: np.full(300_000, tag, np.int32) for tag in range(1, 5)}
    await asyncio.gather(*(a.send(1, arr, tag=tag) for tag, arr in arrays.items()))
    for tag, arr in arrays.items():
        np.testing.assert_array_equal(await b.recv(0, tag=tag), arr)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
async def test_barrier(make_group, n):
    group = await make_group(n)
    arrived: list[int] = []

    async def enter(t: Transport) -> None:
        arrived.append(t.rank)
        await t.barrier(timeout=5.0)
        assert len(arrived) == n  # nobody leaves before everyone arrived

    for _ in range(3):
        arrived.clear()
        await asyncio.gather(*(enter(t) for t in group))


async def test_barrier_times_out_when_a_rank_is_missing(make_group):
    a, b, c = await make_group(3)
    with pytest.raises(NetdistTimeoutError, match="barrier timed out"):
        await asyncio.gather(a.barrier(timeout=0.3), b.barrier(timeout=0.3))


async def test_recv_timeout_names_peer_tag_and_elapsed(make_group):
    a, b = await make_group(2)
    with pytest.raises(NetdistTimeoutError,
                       match=r"recv from rank 1 \(tag 7\) timed out after 0\.\d\ds"):
        await a.recv(1, tag=7, timeout=0.05)
    # the withdrawn receive does not swallow a later message
    await b.send(0, np.array([42]), tag=7)
    assert (await a.recv(1, tag=7)).tolist() == [42]


async def test_default_timeout_comes_from_the_transport(make_group):
    a, _ = await make_group(2, timeout=0.1)
    with pytest.raises(NetdistTimeoutError, match="rank 1"):
        await a.recv(1, tag=0)


async def test_cancelled_recv_keeps_the_message_for_the_next_recv(make_group):
    a, b = await make_group(2)
    task = await start_until_blocked(b.recv(0, tag=3))  # posted, then cancelled
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await a.send(1, np.array([5]), tag=3)
    assert (await b.recv(0, tag=3)).tolist() == [5]


async def test_peer_close_fails_pending_and_later_operations_naming_the_rank(make_group):
    a, b, c = await make_group(3)
    pending = await start_until_blocked(a.recv(1, tag=0, timeout=5.0))  # waiting on rank 1
    await b.aclose()
    with pytest.raises(PeerLostError, match="rank 1") as info:
        await pending
    assert info.value.rank == 1
    with pytest.raises(PeerLostError) as later:
        await a.recv(1, tag=5, timeout=5.0)
    assert later.value.rank == 1
    with pytest.raises(PeerLostError) as on_send:
        for _ in range(100):  # the close may take a moment to be seen by a sender
            await a.send(1, np.zeros(4), tag=0)
            await asyncio.sleep(0.01)
    assert on_send.value.rank == 1
    # the rest of the job is unaffected
    await a.send(2, np.array([1, 2]), tag=0)
    assert (await c.recv(0, tag=0)).tolist() == [1, 2]


async def test_messages_sent_before_close_are_still_delivered(make_group):
    a, b = await make_group(2)
    await b.send(0, np.array([9, 9]), tag=1)
    await b.aclose()
    # wait until the close is visible, then the earlier message is still receivable
    with pytest.raises(PeerLostError):
        await a.recv(1, tag=2, timeout=5.0)
    assert (await a.recv(1, tag=1, timeout=5.0)).tolist() == [9, 9]


async def test_operations_after_aclose_raise_transport_closed(make_group):
    a, b = await make_group(2)
    await a.aclose()
    assert a.closed
    with pytest.raises(TransportClosedError):
        await a.send(1, b"x")
    with pytest.raises(TransportClosedError):
        await a.recv(1)
    with pytest.raises(TransportClosedError):
        await a.barrier()


async def test_own_close_fails_pending_recv_with_transport_closed(make_group):
    a, _ = await make_group(2)
    pending = await start_until_blocked(a.recv(1, tag=0, timeout=5.0))  # posted
    await a.aclose()
    with pytest.raises(TransportClosedError):
        await pending


async def test_aclose_is_idempotent(make_group):
    group = await make_group(2)
    for _ in range(3):
        await group[0].aclose()
    await asyncio.gather(group[1].aclose(), group[1].aclose())
    assert group[0].closed and group[1].closed


async def test_aclose_completes_under_cancellation(make_group):
    a, b = await make_group(2)
    closing = await start_until_blocked(a.aclose())  # mid-close (TCP) or done (in-process)
    closing.cancel()
    try:
        await closing
    except asyncio.CancelledError:
        pass  # cancelled mid-close (TCP) or finished first (in-process): both fine
    assert a.closed
    await a.aclose()  # finishes what the cancelled call started
    with pytest.raises(PeerLostError):
        await b.recv(0, timeout=5.0)


async def test_wrong_out_size_raises_and_the_connection_survives(make_group):
    a, b = await make_group(2)
    # posted receive with a wrong-sized buffer
    pending = await start_until_blocked(b.recv(0, tag=1, out=np.empty(3, np.float64)))
    await a.send(1, np.arange(4, dtype=np.float64), tag=1)
    with pytest.raises(LocalProtocolError, match=r"rank 0 \(tag 1\).*32"):
        await pending
    # unexpected message received into a wrong-sized buffer
    await a.send(1, np.arange(5, dtype=np.float64), tag=2)
    # it has arrived once a message rank 0 sent after it has: one ordered stream per pair
    await a.send(1, np.zeros(1), tag=6)
    await b.recv(0, tag=6)
    with pytest.raises(LocalProtocolError, match="40"):
        await b.recv(0, tag=2, out=np.empty(2, np.float64))
    # the connection still works both ways
    await a.send(1, np.array([1.5]), tag=3)
    assert (await b.recv(0, tag=3)).tolist() == [1.5]
    await b.send(0, np.array([2.5]), tag=3)
    assert (await a.recv(1, tag=3)).tolist() == [2.5]


@pytest.mark.parametrize("bad", [-1, 2, 1.0, "1", True])
async def test_invalid_peer_is_rejected(make_group, bad):
    a, _ = await make_group(2)
    with pytest.raises((ValueError, TypeError)):
        await a.send(bad, b"x")
    with pytest.raises((ValueError, TypeError)):
        await a.recv(bad)


async def test_sending_to_self_is_rejected(make_group):
    a, _ = await make_group(2)
    with pytest.raises(ValueError, match="this rank"):
        await a.send(0, b"x")


@pytest.mark.parametrize("tag", [-1, 2**63, 1.5, "t"])
async def test_invalid_tag_is_rejected(make_group, tag):
    a, _ = await make_group(2)
    with pytest.raises(ValueError):
        await a.send(1, b"x", tag=tag)
    with pytest.raises(ValueError):
        await a.recv(1, tag=tag)
