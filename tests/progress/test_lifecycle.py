"""Progress thread lifecycle, handles and errors: nothing leaks, every error is netdist's."""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest

from netdist.config import DistributedConfig
from netdist.errors import (BlockingCallError, CollectiveMismatchError, ConnectError,
                            NetdistTimeoutError, RendezvousTimeoutError, TransportClosedError)
from netdist.progress import Job, ProgressThread

from tests.progress.jobs import JOIN_SECONDS, jobs_of, progress_threads
from tests.ranks import on_every_rank


def test_a_thread_starts_runs_work_and_is_joined_on_close() -> None:
    progress = ProgressThread(name="netdist-progress-test").start()
    assert progress.running and len(progress_threads()) == 1

    async def loop_running() -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    # run() and call() execute where the loop's objects live: on the progress thread, or
    # on this thread while it drives the loop itself (the loop is free between calls)
    assert progress.run(loop_running()) is progress.loop
    assert progress.call(asyncio.get_running_loop) is progress.loop
    progress.close()
    progress.close()  # idempotent
    assert not progress.running and progress_threads() == []
    with pytest.raises(TransportClosedError):
        progress.submit(loop_running())


def test_a_hand_over_that_finished_first_still_leaves_the_loop_to_the_caller() -> None:
    """``run()`` hands its operation to the progress thread and attaches a callback that
    makes the thread let go of the loop; when the operation finished before the callback
    was attached, the callback runs on the caller's thread. It must still make the
    progress thread let go (it used to be a no-op there, so the thread kept the loop and
    the caller could never drive it: seen in CI under load)."""
    caller = threading.current_thread()
    with ProgressThread(name="netdist-progress-test", linger=JOIN_SECONDS).start() as progress:
        on_thread = threading.Event()
        progress.loop.call_soon_threadsafe(on_thread.set)
        assert on_thread.wait(JOIN_SECONDS)  # the progress thread is running the loop
        assert progress.try_call(threading.current_thread) == (False, None)
        progress._leave_loop_to_caller(None)  # as add_done_callback on a done future does
        deadline = time.monotonic() + JOIN_SECONDS
        held, ran_on = progress.try_call(threading.current_thread)
        while not held and time.monotonic() < deadline:  # until it has let go of it
            time.sleep(0.001)
            held, ran_on = progress.try_call(threading.current_thread)
        assert (held, ran_on) == (True, caller)


def test_try_call_runs_on_the_caller_only_while_it_can_hold_the_loop() -> None:
    caller = threading.current_thread()

    async def noop() -> None:
        pass

    # a long linger: once a caller has used the loop, the progress thread leaves it alone
    with ProgressThread(name="netdist-progress-test", linger=JOIN_SECONDS).start() as progress:
        progress.run(noop())  # the thread ran it and now leaves the loop to callers
        deadline = time.monotonic() + JOIN_SECONDS
        held, ran_on = progress.try_call(threading.current_thread)
        while not held and time.monotonic() < deadline:  # until it has let go of it
            time.sleep(0)
            held, ran_on = progress.try_call(threading.current_thread)
        assert (held, ran_on) == (True, caller)  # the loop is free: it runs here

        async def from_the_loop() -> tuple[bool, Any]:
            return progress.try_call(lambda: "never")

        assert progress.run(from_the_loop()) == (False, None)

    # the progress thread runs the loop (a submitted operation waits on it): declined
    with ProgressThread(name="netdist-progress-test").start() as progress:
        on_progress_thread = threading.Event()
        release: asyncio.Event | None = None

        async def hold() -> str:
            nonlocal release
            release = asyncio.Event()
            if threading.current_thread() is not caller:
                on_progress_thread.set()
            await release.wait()
            return "held"

        future = progress.submit(hold())
        assert on_progress_thread.wait(JOIN_SECONDS)
        assert progress.try_call(lambda: "never") == (False, None)
        assert release is not None
        progress.loop.call_soon_threadsafe(release.set)
        assert future.result(JOIN_SECONDS) == "held"


@pytest.mark.parametrize(("choice", "expected"), [(None, "asyncio"), ("auto", "asyncio"),
                                                  ("asyncio", "asyncio"), ("uvloop", "uvloop")])
def test_the_progress_thread_runs_the_standard_loop_unless_told(
        monkeypatch: pytest.MonkeyPatch, choice: str | None, expected: str) -> None:
    """Callers drive the progress loop from the main thread, where uvloop sets up its
    signal wake-up on every run (netdist.progress.loops): the standard loop by default."""
    if choice is None:
        monkeypatch.delenv("NETDIST_EVENT_LOOP", raising=False)
    else:
        monkeypatch.setenv("NETDIST_EVENT_LOOP", choice)
    with ProgressThread() as progress:
        module = type(progress.loop).__module__
    assert module.startswith("uvloop") == (expected == "uvloop"), module


def test_close_cancels_work_still_running() -> None:
    progress = ProgressThread().start()
    started = threading.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    future = progress.submit(forever())
    assert started.wait(JOIN_SECONDS)
    progress.close()
    assert future.cancelled() and progress_threads() == []


def test_run_with_a_timeout_cancels_and_raises_netdist_timeout() -> None:
    with ProgressThread() as progress:
        with pytest.raises(NetdistTimeoutError, match="timed out after 0.05s"):
            progress.run(asyncio.Event().wait(), timeout=0.05)
    assert progress_threads() == []


def test_blocking_calls_from_the_loop_itself_are_refused_not_deadlocked() -> None:
    with ProgressThread() as progress:
        async def nested_run() -> None:
            inner = asyncio.sleep(0)
            progress.run(inner)

        async def close_from_loop() -> None:
            progress.close()

        with pytest.raises(BlockingCallError, match=r"run\(\) would block the loop"):
            progress.run(nested_run())
        with pytest.raises(BlockingCallError, match=r"close\(\) called from the loop's own"):
            progress.run(close_from_loop())
        assert progress.running
    assert progress_threads() == []


@pytest.mark.parametrize("budget", [None, 30.0])
def test_wait_raises_the_works_own_timeout_error_unchanged(budget: float | None) -> None:
    """The work's NetdistTimeoutError is a TimeoutError, like concurrent.futures' own
    since Python 3.11: wait() must pass it on, not mistake it for its own expiry."""
    async def collective_times_out() -> None:
        raise NetdistTimeoutError("all_reduce on group 0x1 timed out after 3.00s")

    with ProgressThread() as progress:
        future = progress.submit(collective_times_out())
        with pytest.raises(NetdistTimeoutError, match=r"^all_reduce on group 0x1 timed out"):
            progress.wait(future, budget, "all_reduce")


def test_joining_without_a_coordinator_fails_within_the_timeout_and_leaves_no_thread() -> None:
    with socket.socket() as unused:  # a port nobody listens on: bind, never listen
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
        config = DistributedConfig(rank=1, world_size=2, coordinator=("127.0.0.1", port),
                                   token="a-token-long-enough-to-be-fine", timeout=1.0)
        with pytest.raises((ConnectError, RendezvousTimeoutError)) as caught:
            Job.connect(config)
    assert f"127.0.0.1:{port}" in str(caught.value)
    assert "coordinator" in str(caught.value)
    assert progress_threads() == []


def test_handles_wait_time_out_without_cancelling_and_are_awaitable_anywhere() -> None:
    with jobs_of(2) as jobs:
        first, second = jobs
        data = np.arange(6, dtype=np.float64)
        pending = first.group.all_reduce(data, async_op=True)  # rank 1 has not joined in yet
        assert not pending.done()
        with pytest.raises(NetdistTimeoutError, match="still running"):
            pending.wait(timeout=0.05)
        other = second.group.all_reduce(np.arange(6, dtype=np.float64), async_op=True)

        async def await_both() -> list[np.ndarray]:
            return [await pending, await other]

        results = asyncio.run(await_both())  # a loop of the caller's own
        assert all((r == 2 * np.arange(6)).all() for r in results)
        assert pending.done() and pending.result() is data
        assert pending.exception() is None
    assert progress_threads() == []


def test_a_failing_collective_raises_the_same_netdist_error_and_close_still_cleans_up() -> None:
    with jobs_of(2, timeout=10.0) as jobs:
        def mismatched(job: Job) -> str:
            with pytest.raises(CollectiveMismatchError) as caught:
                job.group.all_reduce(np.zeros(3 + job.rank, np.float32))
            return str(caught.value)

        messages = on_every_rank(jobs, mismatched)
        assert all("all_reduce" in m for m in messages)
    assert progress_threads() == []


def test_point_to_point_and_subgroups_through_the_blocking_api() -> None:
    with jobs_of(3) as jobs:
        def body(job: Job) -> tuple[float, list[float] | None]:
            right, left = (job.rank + 1) % 3, (job.rank - 1) % 3
            job.group.send(np.full(4, float(job.rank)), right, tag=7)
            got = job.group.recv(left, tag=7)
            sub = job.group.new_group([0, 2])
            summed = None
            if job.rank in (0, 2):
                summed = sub.all_reduce(np.ones(2) * job.rank).tolist()
            return float(got[0]), summed

        results = on_every_rank(jobs, body)
    assert results == [(2.0, [2.0, 2.0]), (0.0, None), (1.0, [2.0, 2.0])]
    assert progress_threads() == []


def test_awaiting_proxy_runs_collectives_on_the_progress_thread_from_asyncio() -> None:
    with jobs_of(2) as jobs:
        async def both() -> list[np.ndarray]:
            groups = [job.awaiting(job.group.target) for job in jobs]
            return list(await asyncio.gather(
                *(g.all_reduce(np.full(3, float(i + 1))) for i, g in enumerate(groups))))

        results = asyncio.run(both())
    assert [r.tolist() for r in results] == [[3.0] * 3, [3.0] * 3]
    assert progress_threads() == []


@pytest.mark.parametrize("connect", ["eager", "lazy"])
def test_a_job_left_on_an_exception_tells_its_peers_whom_to_blame(connect: str) -> None:
    """A connected peer hears the reason; one that has not connected yet (lazy: rank 1 may
    still be dialling rank 0 when it leaves) finds rank 0 gone and blames it all the same."""
    from netdist.errors import PeerLostError

    with jobs_of(2, connect=connect) as jobs:
        waiting = jobs[1].group.all_reduce(np.ones(2), async_op=True)
        jobs[0].close(RuntimeError("boom in step 3"))
        with pytest.raises(PeerLostError) as caught:
            waiting.wait(JOIN_SECONDS)
    assert caught.value.origin_rank == 0 and caught.value.rank == 0
    if connect == "eager":
        assert "boom in step 3" in str(caught.value)
    assert progress_threads() == []


def test_two_caller_threads_share_one_job() -> None:
    # e.g. a training loop and a hook thread: one drives the loop, the other's operations
    # are handed over or run by whichever thread drives; each subgroup keeps its order
    def rank_body(job: Job) -> tuple[list[float], list[float]]:
        first, second = job.group.new_group([0, 1]), job.group.new_group([0, 1])

        def use(group: Any, base: float) -> list[float]:
            return [float(group.all_reduce(np.full(3, base + i))[0]) for i in range(40)]

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            a = pool.submit(use, first, 1.0)
            b = pool.submit(use, second, 100.0)
            return a.result(JOIN_SECONDS), b.result(JOIN_SECONDS)

    with jobs_of(2) as jobs:
        results = on_every_rank(jobs, rank_body)
    expected = ([2 * (1.0 + i) for i in range(40)], [2 * (100.0 + i) for i in range(40)])
    assert results == [expected, expected]
    assert progress_threads() == []
