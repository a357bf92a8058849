"""The blocking API on the progress thread gives the asyncio API's results, bit for bit.

Each rank's script of collectives runs twice over real TCP on loopback: once through the
asyncio API (every rank a task on one loop) and once through ``Job`` (every rank its own
progress thread, driven from its own caller thread). The results must be identical.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from netdist.collectives import Group
from netdist.types import ReduceOp

from tests.progress.jobs import JOIN_SECONDS, jobs_of, progress_threads
from tests.ranks import on_every_rank, run_ranks

Step = tuple[str, tuple[Any, ...], dict[str, Any]]


def script(rank: int, n: int) -> list[Step]:
    """The collectives every rank issues, in order, with this rank's inputs."""
    rng = np.random.default_rng(1000 * n + rank)
    steps: list[Step] = []
    for dtype in (np.float32, np.float64, np.int64):
        for size in (1, 257, 70_001):  # latency-optimal and ring paths
            for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN):
                data = (rng.standard_normal(size) * 100).astype(dtype)
                steps.append(("all_reduce", (data,), {"op": op}))
    steps.append(("all_reduce", (rng.standard_normal(4097).astype(np.float32),),
                  {"op": ReduceOp.MEAN, "async_op": True}))
    steps.append(("reduce_scatter", (rng.standard_normal(10_000),), {"op": "sum"}))
    steps.append(("all_gather", (rng.standard_normal((rank + 1, 3)),), {}))
    steps.append(("all_gather", (rng.standard_normal(5),), {"async_op": True}))
    steps.append(("broadcast", (rng.standard_normal(3000), n - 1), {}))
    steps.append(("reduce", (rng.integers(0, 9, 50), 0), {}))
    steps.append(("gather", (rng.standard_normal(rank + 2), n // 2), {}))
    arrays = [np.full(i + 1, 10.0 * i) for i in range(n)] if rank == 0 else None
    steps.append(("scatter", (arrays, 0), {}))
    steps.append(("barrier", (), {}))
    steps.append(("all_gather_object", ({"rank": rank, "tag": f"r{rank}"},), {}))
    steps.append(("broadcast_object", ([1, "two", rank], 0), {}))
    return steps


def comparable(value: Any) -> Any:
    """Results as plain data: arrays by dtype, shape and bytes."""
    if isinstance(value, np.ndarray):
        return (value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, (list, tuple)):
        return [comparable(v) for v in value]
    return value


async def run_asyncio(n: int) -> list[list[Any]]:
    async def rank_body(group: Group) -> list[Any]:
        results = []
        for name, args, kwargs in script(group.rank, n):
            result = await getattr(group, name)(*args, **kwargs)
            if kwargs.get("async_op"):
                result = await result
            results.append(comparable(result))
        return results

    return await run_ranks(n, rank_body, tcp=True, op_timeout=30.0, guard=JOIN_SECONDS)


def run_blocking(n: int) -> list[list[Any]]:
    def rank_body(job: Any) -> list[Any]:
        results = []
        for name, args, kwargs in script(job.rank, n):
            result = getattr(job.group, name)(*args, **kwargs)
            if kwargs.get("async_op"):
                result = result.wait(JOIN_SECONDS)
            results.append(comparable(result))
        return results

    with jobs_of(n) as jobs:
        return on_every_rank(jobs, rank_body)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_blocking_results_equal_the_asyncio_api_bit_for_bit(n: int) -> None:
    expected = asyncio.run(run_asyncio(n))
    got = run_blocking(n)
    assert len(got) == n
    for rank in range(n):
        for index, (a, b) in enumerate(zip(got[rank], expected[rank], strict=True)):
            assert a == b, f"rank {rank}, step {index} ({script(rank, n)[index][0]}) differs"
    assert progress_threads() == []


def test_small_blocking_all_reduces_start_on_the_callers_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On one host a blocking small all-reduce begins on the caller's thread (its
    ``eager_start`` companion, while the caller holds the loop); results stay exact,
    including those that had to finish on the loop, and with ``MEAN``."""
    started: list[bool] = []
    original = Group.all_reduce_eager

    def counting(self: Group, *args: Any, **kwargs: Any) -> Any:
        outcome = original(self, *args, **kwargs)
        started.append(outcome is not None)  # list.append: safe from every rank's thread
        return outcome

    monkeypatch.setattr(Group, "all_reduce_eager", counting)

    def rank_body(job: Any) -> list[Any]:
        out = []
        for i in range(200):
            data = np.array([job.rank + i, 3 * i], np.int64)
            result = job.group.all_reduce(data)
            assert result is data  # in place, as the coroutine path returns it
            mean = job.group.all_reduce(np.full(3, float(job.rank + i)), ReduceOp.MEAN)
            out.append((data.tolist(), mean.tolist()))
        return out

    with jobs_of(2) as jobs:
        results = on_every_rank(jobs, rank_body)
    for got in results:
        assert got == [([2 * i + 1, 6 * i], [i + 0.5] * 3) for i in range(200)]
    assert any(started)


def test_what_all_reduce_refuses_the_eager_start_leaves_to_it() -> None:
    def rank_body(job: Any) -> list[Any]:
        job.group.all_reduce(np.ones(2))  # the group's lane is set up from here on
        group = job.group.target
        refused = (np.ones(2, np.complex64),  # no wire dtype: all_reduce raises
                   np.ones(2, ">f4"),  # big-endian: all_reduce raises
                   np.ones(4)[::2],  # not contiguous: all_reduce copies
                   np.ones(0))  # empty: nothing to reduce
        declined = [group.all_reduce_eager(array) for array in refused]
        with pytest.raises(TypeError, match="not supported on the wire"):
            job.group.all_reduce(np.ones(2, np.complex64))
        assert group.has_lane is True
        return declined

    with jobs_of(2) as jobs:
        assert on_every_rank(jobs, rank_body) == [[None] * 4] * 2


def test_recv_any_and_monitored_barrier_through_the_blocking_api() -> None:
    """``job.group`` offers ``Group.recv_any`` and ``Group.monitored_barrier`` blocking,
    and as ``Handle``s with ``async_op=True``."""
    from netdist.errors import NetdistTimeoutError

    def rank_body(job: Any) -> Any:
        group = job.group
        if group.rank != 0:
            group.recv(0, tag=1)  # rank 2 sends only after rank 1's message was taken
            group.send(np.array([group.rank], np.int64), 0, tag=6)
            group.monitored_barrier(timeout=20, wait_all_ranks=True)
            return None
        group.send(b"", 1, tag=1)
        first = group.recv_any(None, 6)
        group.send(b"", 2, tag=1)
        second = group.recv_any([2, 1], 6, async_op=True).wait(JOIN_SECONDS)
        with pytest.raises(NetdistTimeoutError, match="recv_any on group"):
            group.recv_any(None, 6, timeout=0.2)
        group.monitored_barrier(timeout=20, wait_all_ranks=True)
        return [(src, message.tolist()) for src, message in (first, second)]

    with jobs_of(3) as jobs:
        assert on_every_rank(jobs, rank_body) == [[(1, [1]), (2, [2])], None, None]
