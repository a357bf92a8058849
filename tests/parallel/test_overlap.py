"""OverlapSession: buckets all-reduced while backward still runs, over real TCP on loopback.

Every rank reports its gradients from a thread of its own, in an order of its own, and
the session must return bitwise what ``aggregate()`` returns, launching the buckets in
plan order on every rank. Misuse, a lost peer and an abandoned step end cleanly.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from netdist.collectives import Group
from netdist.errors import CollectiveError, CollectiveMismatchError, PeerLostError
from netdist.parallel.aggregators import (
    AllReduceAggregator,
    Fp16AllReduceAggregator,
    OverlapAggregator,
    SessionState,
    TopKAggregator,
)
from netdist.transport import local_tcp_group
from netdist.transport.inprocess import InProcessTransport

from tests.progress.jobs import jobs_of
from tests.ranks import on_every_rank

BOUND = 60.0
"""Outer bound on every multi-rank body."""


class RecordingGroup:
    """A ``Group`` that logs every all_reduce it is asked to launch (from the loop)."""

    def __init__(self, group: Group, events: list[Any]) -> None:
        self.group = group
        self.world_size = group.world_size
        self.events = events
        self.launched = asyncio.Event()

    async def all_reduce(self, array: np.ndarray, *args: Any, **kwargs: Any) -> Any:
        self.events.append(("launch", array.size))
        self.launched.set()
        return await self.group.all_reduce(array, *args, **kwargs)


def make_grads(rank: int) -> list[np.ndarray]:
    """Rank-specific gradients of an awkward layout: fused, alone, empty, strided,
    read-only (float64 and float32 buckets)."""
    rng = np.random.default_rng(100 + rank)
    base = rng.standard_normal((6, 8))
    frozen = rng.standard_normal(7)
    frozen.flags.writeable = False
    return [rng.standard_normal(5), rng.standard_normal((4, 3)).astype(np.float32),
            np.zeros(0), rng.standard_normal(300), base[:, ::2], frozen,
            rng.standard_normal(9), rng.standard_normal(40).astype(np.float32)]


def report_order(rank: int, count: int) -> list[int]:
    """A different reporting order on every rank."""
    order = list(range(count))
    np.random.default_rng(rank).shuffle(order)
    return order


async def in_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a thread of its own, like a backward pass."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if done.done():  # the awaiting task was cancelled
            return
        if exc is None:
            done.set_result(result)
        else:
            done.set_exception(exc)

    def main() -> None:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    thread = threading.Thread(target=main, name="test-backward")
    thread.start()
    try:
        return await done
    finally:
        thread.join(BOUND)


def snapshot(arrays: list[np.ndarray]) -> list[tuple[str, tuple[int, ...], bytes]]:
    return [(a.dtype.str, a.shape, a.tobytes()) for a in arrays]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("kind", [AllReduceAggregator, Fp16AllReduceAggregator])
async def test_session_from_threads_equals_aggregate_bitwise(n: int, kind: type) -> None:
    async def rank_main(group: Group) -> tuple[Any, Any, int, int]:
        rank = group.rank
        reference = kind(group, bucket_mb=200 / 2**20)  # 200-byte buckets: several
        expected = await reference.aggregate(make_grads(rank))
        agg = kind(group, bucket_mb=200 / 2**20)
        for step in range(3):  # buffers are reused across steps
            mine = make_grads(rank)
            session = agg.begin(mine)

            def backward() -> None:
                for i in report_order(rank + step, len(mine)):
                    session.ready(i, mine[i])

            await in_thread(backward)
            out = await session.finish()
            assert session.state is SessionState.FINISHED
            assert snapshot(out) == snapshot(expected), f"step {step}"
        return snapshot(out), len(agg.buckets), agg.last_bytes_sent, reference.last_bytes_sent

    async with local_tcp_group(n) as transports:
        groups = [Group(t) for t in transports]
        async with asyncio.timeout(BOUND):
            results = await asyncio.gather(*(rank_main(g) for g in groups))
    for out, buckets, sent, ref_sent in results:
        assert out == results[0][0]  # every rank holds bitwise the same averages
        # float64 / float32: (9, 7, strided 24) fused, 300 alone (reduced in place),
        # (40, 12) in float32, (5); float16 on the wire: one dtype, two buckets
        assert buckets == (4 if kind is AllReduceAggregator else 2)
        assert sent == ref_sent > 0
    grads = [make_grads(r) for r in range(n)]
    mean_of_first = sum(g[0] for g in grads) / n
    np.testing.assert_allclose(np.frombuffer(results[0][0][0][2]), mean_of_first, rtol=0,
                               atol=4e-3 if kind is Fp16AllReduceAggregator else 1e-15)


async def test_buckets_launch_in_plan_order_whatever_the_report_order() -> None:
    n = 2
    events: list[list[Any]] = [[] for _ in range(n)]

    async def rank_main(group: Group) -> list[np.ndarray]:
        rank = group.rank
        log = events[rank]
        agg = AllReduceAggregator(RecordingGroup(group, log), bucket_mb=8 * 20 / 2**20)
        grads = [np.full(20, float(rank + i)) for i in range(4)]  # one bucket each
        session = agg.begin(grads)
        plan = [bucket.entries[0].index for bucket in agg.buckets]
        assert plan == [3, 2, 1, 0]  # reverse order: the last gradient's bucket first
        # rank 0 reports the first bucket last, rank 1 in plan order
        order = [0, 1, 2, 3] if rank == 0 else [3, 2, 1, 0]
        for i in order:
            log.append(("ready", i))
            await in_thread(lambda i=i: session.ready(i))
            if rank == 0 and i != 3:
                assert session.launched == 0  # bucket 0 (gradient 3) is not final yet
        out = await session.finish()
        return out

    async with local_tcp_group(n) as transports:
        groups = [Group(t) for t in transports]
        async with asyncio.timeout(BOUND):
            outs = await asyncio.gather(*(rank_main(g) for g in groups))
    for out in outs:
        for i, o in enumerate(out):
            np.testing.assert_array_equal(o, np.full(20, i + 0.5))
    launches = [e for e in events[0] if e[0] == "launch"]
    assert len(launches) == 4
    # rank 0: nothing launched before its last report, which completed bucket 0
    assert events[0].index(("ready", 3)) < events[0].index(launches[0])
    # rank 1: bucket 0 went out as soon as gradient 3 was final, before the others
    first_launch = next(i for i, e in enumerate(events[1]) if e[0] == "launch")
    assert events[1].index(("ready", 3)) < first_launch < events[1].index(("ready", 0))


def inprocess_groups(n: int) -> list[Group]:
    return [Group(t, timeout=20.0)
            for t in InProcessTransport.create_group(n, timeout=20.0)]


async def test_misuse_is_refused_with_reasons() -> None:
    (group,) = inprocess_groups(1)
    agg = AllReduceAggregator(group)
    like = [np.zeros(3), np.zeros((2, 2), np.float32)]
    session = agg.begin(like)
    with pytest.raises(CollectiveError, match="still running"):
        agg.begin(like)
    with pytest.raises(CollectiveError, match="still running"):
        await agg.aggregate(like)
    with pytest.raises(CollectiveError, match="index 2 out of range: the session has 2"):
        session.ready(2)
    with pytest.raises(CollectiveMismatchError, match=r"gradient 1 has shape \(4,\) .*"
                                                      r"begun with shape \(2, 2\)"):
        session.ready(1, np.zeros(4, np.float32))
    with pytest.raises(CollectiveMismatchError, match="dtype float64.*dtype float32"):
        session.ready(1, np.zeros((2, 2)))
    session.ready(0)
    with pytest.raises(CollectiveError, match="gradient 0 reported ready twice"):
        session.ready(0)
    with pytest.raises(CollectiveError, match=r"1 of 2 gradients were never reported ready \(1\)"):
        await session.finish()
    assert session.state is SessionState.CLOSED
    with pytest.raises(CollectiveError, match="already closed"):
        session.ready(1)
    # the aggregator is free again, and a complete session returns the arrays themselves
    session = agg.begin(like)
    session.ready(1)
    out = await session.finish(like)
    assert out[0] is like[0] and out[1] is like[1]
    with pytest.raises(CollectiveError, match="already finished"):
        session.ready(0)
    with pytest.raises(CollectiveError, match="event loop"):
        await asyncio.to_thread(agg.begin, like)


async def test_only_the_dense_all_reduce_aggregators_overlap() -> None:
    (group,) = inprocess_groups(1)
    assert isinstance(AllReduceAggregator(group), OverlapAggregator)
    assert isinstance(Fp16AllReduceAggregator(group), OverlapAggregator)
    assert not isinstance(TopKAggregator(group, 0.1), OverlapAggregator)


async def test_lost_peer_fails_finish_and_stops_reports() -> None:
    async with local_tcp_group(2, timeout=30.0) as transports:
        group = Group(transports[0])
        Group(transports[1])
        agg = AllReduceAggregator(group, bucket_mb=8 * 100 / 2**20)
        grads = [np.ones(100), np.ones(100), np.ones(100)]
        session = agg.begin(grads)
        session.ready(2)  # bucket 0 launches and waits for rank 1 ...
        await transports[1].aclose()  # ... which goes away
        async with asyncio.timeout(BOUND):
            with pytest.raises(PeerLostError) as info:
                await session.finish(grads)
        assert info.value.origin_rank == 1
        assert session.state is SessionState.FAILED and session.error is info.value
        with pytest.raises(CollectiveError, match="after the step's all-reduce failed"):
            session.ready(0)
        # the failed step released the aggregator
        with pytest.raises(CollectiveError, match="never reported"):
            await agg.begin(grads).finish()


async def test_aclose_cancels_buckets_in_flight_and_releases_the_aggregator() -> None:
    async with local_tcp_group(2, timeout=30.0) as transports:
        groups = [Group(t) for t in transports]
        recording = RecordingGroup(groups[0], [])
        agg = AllReduceAggregator(recording, bucket_mb=8 * 100 / 2**20)
        grads = [np.ones(100), np.ones(100)]
        session = agg.begin(grads)
        session.ready(1)  # bucket 0 launches; rank 1 never joins it
        async with asyncio.timeout(BOUND):
            await recording.launched.wait()
            async with session:
                pass  # leaving the block abandons the step
        assert session.state is SessionState.CLOSED
        assert not any(t.get_name() == "netdist-overlap-session"
                       for t in asyncio.all_tasks())
        with pytest.raises(CollectiveError, match="already closed"):
            session.ready(0)
        with pytest.raises(CollectiveError, match="was closed"):
            await session.finish()
        await session.aclose()  # idempotent
        assert agg.begin(grads).state is SessionState.OPEN  # released


def test_session_through_the_blocking_api() -> None:
    """``job.make`` an aggregator on the progress thread; ``begin``/``finish`` block, and
    the session's own ``ready`` is called straight from the caller's thread."""
    from tests.progress.jobs import jobs_of
    from tests.ranks import on_every_rank

    def rank_main(job: Any) -> list[tuple[str, tuple[int, ...], bytes]]:
        agg = job.make(AllReduceAggregator, job.group, bucket_mb=200 / 2**20)
        reference = job.make(AllReduceAggregator, job.group, bucket_mb=200 / 2**20)
        expected = reference.aggregate(make_grads(job.rank))
        grads = make_grads(job.rank)
        session = agg.begin(grads)  # a blocking proxy of the OverlapSession
        for i in report_order(job.rank, len(grads)):
            session.ready(i, grads[i])  # @thread_safe: the proxy calls it directly
        out = session.finish()
        assert session.state is SessionState.FINISHED
        assert snapshot(out) == snapshot(expected)
        return snapshot(out)

    with jobs_of(2) as jobs:
        first, second = on_every_rank(jobs, rank_main)
    assert first == second
