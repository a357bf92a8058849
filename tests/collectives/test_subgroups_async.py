"""Subgroups, tags, async Work handles, point-to-point and failure handling."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from netdist.collectives import Group, Work
from netdist.collectives.group import P2P_TAG_LIMIT
from netdist.errors import (
    CollectiveError,
    NetdistTimeoutError,
    NotInGroupError,
    PeerLostError,
    TransportClosedError,
)
from netdist.transport import InProcessTransport, Transport
from tests.collectives.helpers import RING, SMALL
from tests.ranks import run_ranks


async def test_new_group_validation() -> None:
    async def body(g: Group) -> None:
        with pytest.raises(ValueError, match="duplicate ranks"):
            g.new_group([0, 1, 1])
        with pytest.raises(ValueError, match="outside"):
            g.new_group([0, 4])
        with pytest.raises(ValueError, match="outside"):
            g.new_group([-1])
        with pytest.raises(ValueError, match="at least one"):
            g.new_group([])
        with pytest.raises(TypeError):
            g.new_group([0, "1"])  # type: ignore[list-item]
        with pytest.raises(TypeError):
            g.new_group(3)  # type: ignore[arg-type]

    await run_ranks(3, body)


async def test_non_member_gets_not_in_group_error() -> None:
    async def body(g: Group) -> None:
        sub = g.new_group([2, 0])
        assert sub.ranks == (2, 0)
        if g.rank == 1:
            assert not sub.is_member and sub.rank == -1
            for call in (sub.all_reduce(np.zeros(2)), sub.barrier(), sub.broadcast(np.zeros(1), 0),
                         sub.all_gather_object(1), sub.send(np.zeros(1), 0)):
                with pytest.raises(NotInGroupError, match="not a member"):
                    await call
            with pytest.raises(NotInGroupError):
                sub.new_group([0])
        else:
            assert sub.is_member and sub.rank == (0 if g.rank == 2 else 1)
            arr = np.array([g.rank + 1.0])
            await sub.all_reduce(arr, timeout=5)
            assert arr[0] == 4.0

    await run_ranks(3, body)


@pytest.mark.parametrize("algo", [SMALL, RING])
async def test_subgroups_and_parent_run_concurrently(algo: int) -> None:
    n = 6

    async def body(g: Group) -> dict[str, Any]:
        evens = g.new_group([0, 2, 4])
        odds = g.new_group([5, 3, 1])  # group order differs from rank order
        pair = g.new_group([1, 2])
        mine = evens if g.rank % 2 == 0 else odds
        world = np.full(100, g.rank, np.int64)
        sub = np.full(50, g.rank, np.int64)
        # issue a parent op, a subgroup op and another parent op, all in flight at once
        w1 = await g.all_reduce(world, async_op=True, timeout=5)
        w2 = await mine.all_reduce(sub, async_op=True, timeout=5)
        w3 = await g.all_gather(np.array([g.rank]), async_op=True, timeout=5)
        w4 = await mine.all_gather_object(g.rank, async_op=True, timeout=5)
        pair_sum = None
        if pair.is_member:
            pair_sum = await pair.all_reduce(np.array([g.rank * 10]), timeout=5)
        await g.barrier(timeout=5)
        return {"world": await w1, "sub": await w2, "gather": await w3, "objs": await w4,
                "pair": pair_sum}

    results = await run_ranks(n, body, small_message_bytes=algo, segment_bytes=32)
    for r, res in enumerate(results):
        np.testing.assert_array_equal(res["world"], np.full(100, 15))
        np.testing.assert_array_equal(res["sub"], np.full(50, 6 if r % 2 == 0 else 9))
        np.testing.assert_array_equal(res["gather"], np.arange(n))
        assert res["objs"] == ([0, 2, 4] if r % 2 == 0 else [5, 3, 1])
        if r in (1, 2):
            np.testing.assert_array_equal(res["pair"], [30])


async def test_nested_subgroups_and_ids() -> None:
    async def body(g: Group) -> tuple[int, int, int]:
        sub = g.new_group([0, 1, 2, 3])
        inner = sub.new_group([3, 1]) if sub.is_member else None
        sib = g.new_group([0, 1, 2, 3])  # same members, still a distinct group
        assert sib.group_id != sub.group_id
        if inner is not None and inner.is_member:
            arr = np.array([float(g.rank)])
            await inner.all_reduce(arr, timeout=5)
            assert arr[0] == 4.0
        return g.group_id, sub.group_id, sib.group_id

    results = await run_ranks(5, body)
    assert len(set(results)) == 1  # ids agree on every rank
    assert len(set(results[0])) == 3


async def test_two_root_groups_on_one_transport_do_not_mix() -> None:
    transports = InProcessTransport.create_group(2, timeout=5)
    try:
        a = [Group(t) for t in transports]
        b = [Group(t) for t in transports]
        assert a[0].group_id == a[1].group_id != b[0].group_id == b[1].group_id

        async def rank(i: int) -> tuple[np.ndarray, np.ndarray]:
            x = np.full(10, i + 1.0)
            y = np.full(10, (i + 1) * 100.0)
            wx = await a[i].all_reduce(x, async_op=True, timeout=5)
            wy = await b[i].all_reduce(y, async_op=True, timeout=5)
            return await wx, await wy

        async with asyncio.timeout(10):
            results = await asyncio.gather(rank(0), rank(1))
        for x, y in results:
            np.testing.assert_array_equal(x, np.full(10, 3.0))
            np.testing.assert_array_equal(y, np.full(10, 300.0))
    finally:
        for t in transports:
            await t.aclose()


async def test_tags_are_above_application_space_and_distinct() -> None:
    from netdist.transport.dissemination import BARRIER_TAG

    async def body(g: Group) -> None:
        sub = g.new_group([0, 1])
        tags = {g._channel("a", None).tag, g._channel("b", None).tag,
                sub._channel("c", None).tag, g._ops.p2p_tag(0),
                g._ops.p2p_tag(P2P_TAG_LIMIT - 1), sub._ops.p2p_tag(0)}
        assert len(tags) == 6
        assert all(2**32 <= t < BARRIER_TAG for t in tags)
        # keep the counters in step on both ranks (they were advanced identically)

    await run_ranks(2, body)


@pytest.mark.parametrize("algo", [SMALL, RING])
async def test_many_async_ops_in_flight(algo: int) -> None:
    async def body(g: Group) -> list[np.ndarray]:
        arrays = [np.full(64, g.rank * 10 + i, np.int64) for i in range(8)]
        works = [await g.all_reduce(a, async_op=True, timeout=5) for a in arrays]
        assert all(isinstance(w, Work) for w in works)
        results = [await w for w in reversed(works)][::-1]
        for w, a in zip(works, arrays):
            assert w.done()
            assert await w is a  # awaiting again returns the same result
            assert await w.wait(timeout=1) is a
            assert w.result() is a and w.exception() is None
        return results

    results = await run_ranks(3, body, small_message_bytes=algo, segment_bytes=64)
    for per_rank in results:
        for i, arr in enumerate(per_rank):
            np.testing.assert_array_equal(arr, np.full(64, 30 + 3 * i))


async def test_work_propagates_exceptions_and_timeouts() -> None:
    async def body(g: Group) -> None:
        if g.rank == 0:
            # rank 1 never joins this all_reduce: the handle raises the collective's timeout
            work = await g.all_reduce(np.zeros(3), async_op=True, timeout=0.3)
            with pytest.raises(NetdistTimeoutError, match="waiting for .* still running"):
                await work.wait(timeout=0.01)
            with pytest.raises(NetdistTimeoutError, match="all_reduce .* timed out"):
                await work
            with pytest.raises(NetdistTimeoutError):  # again: same exception
                await work.wait()
            assert work.done() and isinstance(work.exception(), NetdistTimeoutError)
            assert "all_reduce" in repr(work)

    await run_ranks(2, body)


async def test_aclose_cancels_outstanding_work() -> None:
    transports = InProcessTransport.create_group(2, timeout=5)
    try:
        g = Group(transports[0])
        sub = g.new_group([0, 1])
        work = await g.all_reduce(np.zeros(3), async_op=True, timeout=5)
        sub_work = await sub.barrier(async_op=True, timeout=5)
        await work.started()
        await sub_work.started()
        assert not work.done()
        async with asyncio.timeout(2):
            await g.aclose()
        assert work.done() and sub_work.done()
        with pytest.raises(asyncio.CancelledError):
            await work
        with pytest.raises(CollectiveError, match="closed"):
            await g.all_reduce(np.zeros(3))
        await g.aclose()  # idempotent
    finally:
        for t in transports:
            await t.aclose()


async def test_p2p_send_recv_namespaced_per_group() -> None:
    async def body(g: Group) -> None:
        sub = g.new_group([2, 0])
        if g.rank == 0:
            await g.send(np.array([1, 2, 3]), 2, tag=5, timeout=5)
            await sub.send(np.array([7.0]), 0, tag=5, timeout=5)  # sub rank 0 = rank 2
            await g.send(b"bytes", 1, timeout=5)
        elif g.rank == 2:
            from_sub = await sub.recv(1, tag=5, timeout=5)
            from_world = await g.recv(0, tag=5, timeout=5)
            np.testing.assert_array_equal(from_sub, [7.0])
            np.testing.assert_array_equal(from_world, [1, 2, 3])
        else:
            out = np.empty(5, np.uint8)
            work = await g.recv(0, out=out, async_op=True, timeout=5)
            assert await work is out
            assert out.tobytes() == b"bytes"
        with pytest.raises(ValueError, match="tag"):
            await g.send(np.zeros(1), (g.rank + 1) % 3, tag=P2P_TAG_LIMIT)
        with pytest.raises(ValueError, match="this rank"):
            await g.recv(g.rank)

    await run_ranks(3, body)


class _DyingTransport(Transport):
    """Delegates to an in-process transport and closes it after ``sends_left`` sends."""

    def __init__(self, inner: InProcessTransport, sends_left: int) -> None:
        self.inner = inner
        self.rank = inner.rank
        self.world_size = inner.world_size
        self.timeout = inner.timeout
        self.sends_left = sends_left

    async def send(self, dst: int, data: Any, *, tag: int = 0,
                   timeout: float | None = None) -> None:
        if self.sends_left == 0:
            await self.inner.aclose()
        self.sends_left -= 1
        await self.inner.send(dst, data, tag=tag, timeout=timeout)

    async def recv(self, src: int, *, tag: int = 0, out: np.ndarray | None = None,
                   timeout: float | None = None) -> np.ndarray:
        return await self.inner.recv(src, tag=tag, out=out, timeout=timeout)

    async def barrier(self, *, timeout: float | None = None) -> None:
        await self.inner.barrier(timeout=timeout)

    def lost_peer_error(self, peer: int) -> Exception | None:
        return self.inner.lost_peer_error(peer)

    def host_keys(self) -> tuple[bytes, ...] | None:
        return self.inner.host_keys()  # every rank must see the same (wrapped or not)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.parametrize("algo", [SMALL, RING])
@pytest.mark.parametrize("n", [2, 3, 5])
async def test_rank_dying_mid_all_reduce_fails_everyone_within_timeout(
        n: int, algo: int, data_path: str) -> None:
    inner = InProcessTransport.create_group(n, timeout=30)
    victim = n - 1
    transports: list[Transport] = list(inner)
    # through shared memory an all-reduce this small is one round: a few signals in all
    sends = 0 if algo == SMALL else (1 if data_path == "shm" else 3)
    transports[victim] = _DyingTransport(inner[victim], sends_left=sends)
    groups = [Group(t, small_message_bytes=algo, segment_bytes=8) for t in transports]
    op_timeout = 0.5
    loop = asyncio.get_running_loop()

    async def rank(g: Group) -> tuple[BaseException | None, float]:
        started = loop.time()
        try:
            await g.all_reduce(np.ones(100), timeout=op_timeout)
        except (PeerLostError, NetdistTimeoutError, TransportClosedError) as exc:
            return exc, loop.time() - started
        return None, loop.time() - started

    try:
        async with asyncio.timeout(10):
            results = await asyncio.gather(*(rank(g) for g in groups))
    finally:
        for t in inner:
            await t.aclose()
    for r, (exc, elapsed) in enumerate(results):
        assert exc is not None, f"rank {r} finished an all_reduce whose peer died"
        assert elapsed < op_timeout + 1.0
        assert "all_reduce" in str(exc)
        if isinstance(exc, PeerLostError):
            assert exc.rank == victim and f"rank {victim}" in str(exc)
    assert any(isinstance(exc, PeerLostError) for exc, _ in results[:-1])


async def test_closed_transport_mid_collective_wakes_waiters() -> None:
    transports = InProcessTransport.create_group(3, timeout=30)
    groups = [Group(t, small_message_bytes=RING, segment_bytes=8) for t in transports]
    try:
        works = [await g.all_reduce(np.ones(1000), async_op=True, timeout=2)
                 for g in groups[:2]]
        for w in works:
            await w.started()
        await transports[2].aclose()  # rank 2 never joins and goes away
        for w in works:
            with pytest.raises((PeerLostError, NetdistTimeoutError)) as info:
                async with asyncio.timeout(5):
                    await w
            assert "all_reduce" in str(info.value)
    finally:
        for t in transports:
            await t.aclose()
