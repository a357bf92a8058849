"""The shared-memory lane of small all-reduces (``netdist.collectives.host.lane``).

In one event loop (in-process ranks, where the lane never polls: every round that
finds a peer behind sleeps on a wake-up) the results are checked bitwise against the
rank-order fold, the wake-up protocol's three cases are forced one by one, and errors
are checked by name. Between real processes (``mp_worker``) thousands of rounds run with
polling and with the tightest poll that still arms, and a peer is SIGKILLed mid-job.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from netdist.collectives import Group
from netdist.collectives.channel import Channel
from netdist.collectives.host.lane import (
    LANE_BYTES,
    SUB_LANE_WAKE,
    HostLane,
    LanePath,
    lane_segment_bytes,
    lane_supported,
)
from netdist.collectives.host.segments import SharedSegment
from netdist.errors import CollectiveMismatchError, NetdistTimeoutError
from netdist.transport import InProcessTransport
from netdist.reduce_kernels import combine
from netdist.types import ReduceOp

from .helpers import assert_bitwise_equal, assert_survivors_failed_naming
from tests.ranks import RankProcess, finish_ranks, run_ranks, start_ranks, start_until_blocked

pytestmark = pytest.mark.skipif(not lane_supported(), reason="the lane is x86-64 only")


def _lane_expected(data_path: str) -> bool:
    return data_path == "shm"


def _fold(arrays: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    """Lowest rank first, as the lane folds (MEAN: the sum, divided afterwards)."""
    out = arrays[0].copy()
    combine(op, arrays[0], arrays[1], out)
    for a in arrays[2:]:
        combine(op, out, a, out)
    if op is ReduceOp.MEAN:
        out /= len(arrays)
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.PROD, ReduceOp.MAX])
async def test_small_all_reduces_fold_lowest_rank_first_bitwise(
        n: int, op: ReduceOp, data_path: str) -> None:
    rng = np.random.default_rng(7)
    inputs = [[rng.standard_normal(1 + 13 * i).astype(np.float32) for _ in range(n)]
              for i in range(5)]  # five rounds: both slot parities, twice over

    async def body(rank: int, g: Group) -> tuple[bool | None, list[np.ndarray]]:
        outs = []
        for round_inputs in inputs:
            array = round_inputs[rank].copy()
            await g.all_reduce(array, op)
            outs.append(array)
        return g.has_lane, outs

    results = await run_ranks(n, body, with_rank=True)
    for has_lane, outs in results:
        assert has_lane is _lane_expected(data_path)
        for round_inputs, out in zip(inputs, outs, strict=True):
            if has_lane:  # the TCP algorithms fold in another (also fixed) order
                assert_bitwise_equal([out, _fold(round_inputs, op)])
            else:
                np.testing.assert_allclose(out, _fold(round_inputs, op), rtol=1e-5)
    for _, outs in results[1:]:
        for mine, theirs in zip(results[0][1], outs, strict=True):
            assert_bitwise_equal([mine, theirs])


async def test_every_dtype_and_the_largest_lane_message(data_path: str) -> None:
    dtypes = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
              np.uint64, np.float16, np.float64]

    async def body(rank: int, g: Group) -> list[np.ndarray]:
        outs = []
        for dtype in dtypes:
            array = np.full(LANE_BYTES // np.dtype(dtype).itemsize, rank + 1, dtype)
            await g.all_reduce(array)
            outs.append(array)
        flags = np.array([rank == 0, True, False])
        await g.all_reduce(flags, ReduceOp.BOR)
        outs.append(flags)
        return outs

    for outs in await run_ranks(3, body, with_rank=True):
        for dtype, out in zip(dtypes, outs, strict=False):
            assert out.dtype == dtype and np.array_equal(out, np.full(out.size, 6, dtype))
        assert outs[-1].tolist() == [True, True, False]


async def test_different_sizes_are_a_mismatch_naming_the_rank(data_path: str) -> None:
    async def body(rank: int, g: Group) -> None:
        await g.all_reduce(np.ones(3 + rank, np.float32))

    errors = await run_ranks(2, body, with_rank=True, return_exceptions=True,
                             op_timeout=10)
    assert all(isinstance(e, CollectiveMismatchError) for e in errors), errors
    assert "group rank 1" in str(errors[0]) and "all_reduce" in str(errors[0])


async def test_same_bytes_of_another_dtype_are_a_mismatch(data_path: str) -> None:
    async def body(rank: int, g: Group) -> None:
        await g.all_reduce(np.ones(2, np.float32 if rank == 0 else np.int32))

    errors = await run_ranks(2, body, with_rank=True, return_exceptions=True,
                             op_timeout=10)
    assert all(isinstance(e, CollectiveMismatchError) for e in errors), errors
    if data_path == "shm":
        assert "int32" in str(errors[0]) and "float32" in str(errors[0])


async def test_a_peer_that_never_comes_times_out_naming_it(data_path: str) -> None:
    transports = InProcessTransport.create_group(2, timeout=30)
    groups = [Group(t) for t in transports]
    try:
        await asyncio.gather(*(g.all_reduce(np.ones(2)) for g in groups))  # sets up
        started = time.monotonic()
        with pytest.raises(NetdistTimeoutError, match="waiting for group rank 1"):
            await groups[0].all_reduce(np.ones(2), timeout=0.5)
        assert time.monotonic() - started < 10
    finally:
        for g in groups:
            await g.aclose()
        for t in transports:
            await t.aclose()


async def test_group_of_one_and_empty_arrays_skip_the_lane() -> None:
    async def body(rank: int, g: Group) -> bool | None:
        await g.all_reduce(np.ones(0, np.float32))
        solo = g.new_group([rank])
        array = np.ones(3)
        await solo.all_reduce(array)
        assert np.array_equal(array, np.ones(3))
        return g.has_lane

    assert await run_ranks(2, body, with_rank=True) == [None, None]


# -- the wake-up protocol, case by case ----------------------------------------------------

class _Pair:
    """Two lanes over one segment and two in-process transports: rank 0 and rank 1."""

    def __init__(self) -> None:
        self.transports = InProcessTransport.create_group(2, timeout=10)
        self.segment = SharedSegment.create(lane_segment_bytes(2))
        self.lanes = [HostLane(self.segment, 2, r, spin_seconds=0.0) for r in range(2)]
        self.chans = [Channel(t, (0, 1), t.rank, 1 << 20, 10.0, "all_reduce")
                      for t in self.transports]

    def pending_wakeups(self, rank: int) -> int:
        """Wake-ups sent to ``rank`` that nobody received (the protocol leaves none)."""
        box = self.transports[rank]._hub.boxes[rank][1 - rank]  # noqa: SLF001
        return len(box._unexpected.get(self.chans[rank].tag + SUB_LANE_WAKE, ()))  # noqa: SLF001

    async def close(self) -> None:
        self.segment.close()
        for t in self.transports:
            await t.aclose()


async def test_a_peer_behind_after_arming_sends_the_wake_up() -> None:
    pair = _Pair()
    try:
        mine, theirs = np.array([1.0, 2.0]), np.array([10.0, 20.0])
        first = pair.lanes[0].begin(mine, ReduceOp.SUM, "all_reduce")
        assert first.behind == [1] and not first.asleep
        waiting = await start_until_blocked(pair.lanes[0].complete(pair.chans[0], first))
        second = pair.lanes[1].begin(theirs, ReduceOp.SUM, "all_reduce")
        assert second.asleep == [0] and second.settled is False  # rank 0 armed: wake it
        await pair.lanes[1].complete(pair.chans[1], second)
        await asyncio.wait_for(waiting, 10)
        assert mine.tolist() == theirs.tolist() == [11.0, 22.0]
        assert pair.pending_wakeups(0) == pair.pending_wakeups(1) == 0
    finally:
        await pair.close()


async def test_a_peer_that_published_before_the_arming_sends_nothing() -> None:
    pair = _Pair()
    try:
        mine, theirs = np.array([1, 2]), np.array([3, 4])
        first = pair.lanes[0].begin(mine, ReduceOp.MAX, "all_reduce")
        second = pair.lanes[1].begin(theirs, ReduceOp.MAX, "all_reduce")
        assert second.settled  # rank 0 had published and was not asleep
        pair.lanes[1].finish(second, "all_reduce")
        assert first.behind == [1]
        # rank 0 arms only now, sees rank 1 published, and reads that no wake-up came
        await asyncio.wait_for(pair.lanes[0].complete(pair.chans[0], first), 10)
        assert mine.tolist() == theirs.tolist() == [3, 4]
        assert pair.pending_wakeups(0) == 0
    finally:
        await pair.close()


async def test_a_peer_that_saw_the_arming_as_it_published_is_received_from() -> None:
    """Both sides see each other's store: the sleeper reads ``woke`` and takes the
    wake-up that was sent, leaving none behind for a later round to trip over."""
    pair = _Pair()
    try:
        mine, theirs = np.array([5.0]), np.array([7.0])
        first = pair.lanes[0].begin(mine, ReduceOp.SUM, "all_reduce")
        pair.lanes[0]._armed[0] = first.k  # noqa: SLF001 - the arming store lands first
        second = pair.lanes[1].begin(theirs, ReduceOp.SUM, "all_reduce")
        assert second.asleep == [0]
        await pair.lanes[1].complete(pair.chans[1], second)
        await asyncio.wait_for(pair.lanes[0].complete(pair.chans[0], first), 10)
        assert mine.tolist() == theirs.tolist() == [12.0]
        assert pair.pending_wakeups(0) == 0
    finally:
        await pair.close()


async def test_lane_turns_keep_issue_order_for_async_calls(data_path: str) -> None:
    async def body(rank: int, g: Group) -> list[np.ndarray]:
        arrays = [np.full(4, rank + 10 * i, np.int64) for i in range(6)]
        works = [await g.all_reduce(a, async_op=True) for a in arrays]
        for work in reversed(works):
            await work
        return arrays

    for arrays in await run_ranks(3, body, with_rank=True):
        assert [int(a[0]) for a in arrays] == [3 + 30 * i for i in range(6)]


def test_lane_path_without_a_lane_is_free_for_all() -> None:
    path = LanePath(enabled=False)
    assert path.idle and not path.decided and path.lane is None
    ticket = path.ticket()
    assert not path.idle
    path.done(ticket)
    assert path.idle


# -- real processes ------------------------------------------------------------------------

def _spawn(n: int, args: list[str], **extra: str) -> list[RankProcess]:
    return start_ranks(n, "tests.collectives.mp_worker", args, timeout=30,
                       job_prefix="lane", keep=["NETDIST_SHM"], env=extra)


@pytest.mark.slow
@pytest.mark.parametrize(("n", "spin_us"), [(2, "100"), (2, "1"), (3, "1")])
def test_thousands_of_rounds_between_processes_are_exact(n: int, spin_us: str,
                                                         data_path: str) -> None:
    """1 us of polling makes most rounds arm and sleep, racing the peer's publish."""
    results = finish_ranks(_spawn(n, ["lane", "3000"], NETDIST_SPIN_US=spin_us),
                           timeout=240)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank} failed:\n{result.stdout}"
        assert f"OK rank {rank}" in result.stdout
        assert f"LANE {_lane_expected(data_path)}" in result.stdout, result.stdout


@pytest.mark.slow
def test_sigkill_of_a_lane_peer_fails_the_survivors_naming_it(data_path: str) -> None:
    n, victim, op_timeout = 3, 1, 8.0
    started = time.monotonic()
    results = [(r.returncode, r.stdout) for r in finish_ranks(
        _spawn(n, ["lanekill", str(victim)], MP_OP_TIMEOUT=str(op_timeout)), timeout=90)]
    assert_survivors_failed_naming(results, victim)
    for _, out in results:
        assert f"LANE {_lane_expected(data_path)}" in out, out
    assert time.monotonic() - started < op_timeout + 45
