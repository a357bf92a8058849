"""Dedicated parameter servers (PSServer / PSClient): sharding, server-side optimizers,
initialisation, shutdown and failures, all ranks in one event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import pytest

from netdist.errors import NetdistTimeoutError, ParameterServerError
from netdist.optim import ShardOptimizer
from netdist.ps import (
    AdamConfig,
    PSClient,
    PSServer,
    ServerReport,
    SGDConfig,
)
from netdist.transport import InProcessTransport
from tests.ps._model import init_mlp, mse_grads, regression_data
from tests.ps.conftest import raise_any, run_ranks

STEPS = 20
BATCH = 8
SIZES = (6, 40, 30, 3)  # W1 is 40x6=240 elements, W2 30x40=1200: sliced with bound 200


async def run_job(num_servers: int, num_workers: int,
                  worker: Callable[[PSClient, int], Awaitable[Any]], *,
                  timeout: float = 10.0,
                  on_servers: Callable[[list[PSServer]], None] | None = None) -> list[Any]:
    """Servers and workers in one loop; results (or exceptions) in rank order."""
    transports = InProcessTransport.create_group(num_servers + num_workers, timeout=timeout)
    servers = [PSServer(t, num_servers=num_servers) for t in transports[:num_servers]]
    if on_servers is not None:
        on_servers(servers)

    async def work(t: Any, index: int) -> Any:
        async with PSClient(t, num_servers=num_servers) as client:
            return await worker(client, index)

    fns: list[Callable[[], Awaitable[Any]]] = [s.run for s in servers]
    fns += [lambda t=t, i=i: work(t, i) for i, t in enumerate(transports[num_servers:])]
    return await run_ranks(fns)


def make_trainer(optimizer: Any, num_workers: int, bound: int = 200):
    async def train(client: PSClient, index: int) -> list[np.ndarray]:
        if index == 0:
            initial = init_mlp(np.random.default_rng(7), SIZES)
        else:  # only worker 0's values count
            initial = [np.zeros_like(p) for p in init_mlp(np.random.default_rng(7), SIZES)]
        params = await client.init(initial, optimizer=optimizer, bigarray_bound=bound)
        x, y = regression_data(np.random.default_rng(11), STEPS * num_workers * BATCH,
                               d_in=SIZES[0], d_out=SIZES[-1])
        for step in range(STEPS):
            lo = (step * num_workers + index) * BATCH
            _, grads = mse_grads(params, x[lo:lo + BATCH], y[lo:lo + BATCH])
            params = await client.step(grads)
        return params
    return train


def local_reference(optimizer: Any, num_workers: int, steps: int = STEPS, *,
                    live: Callable[[int], Sequence[int]] | None = None) -> list[np.ndarray]:
    """Same averaging order (worker 0 first, then /W) and optimizer, one process.

    ``live(step)``: the workers whose gradients make up that step's update (all, by
    default), as synchronous servers that dropped a lost worker average them."""
    params = init_mlp(np.random.default_rng(7), SIZES)
    flat = np.concatenate([p.ravel() for p in params])
    opt = ShardOptimizer(optimizer, flat.size, np.float64)
    x, y = regression_data(np.random.default_rng(11), steps * num_workers * BATCH,
                           d_in=SIZES[0], d_out=SIZES[-1])
    for step in range(steps):
        acc = None
        contributors = list(range(num_workers) if live is None else live(step))
        for w in contributors:
            lo = (step * num_workers + w) * BATCH
            _, grads = mse_grads(params, x[lo:lo + BATCH], y[lo:lo + BATCH])
            g = np.concatenate([g.ravel() for g in grads])
            acc = g.copy() if acc is None else np.add(acc, g, out=acc)
        np.divide(acc, len(contributors), out=acc)
        opt.step(flat, acc)
        offset = 0
        for p in params:
            p[...] = flat[offset:offset + p.size].reshape(p.shape)
            offset += p.size
    return params


def big_batch_reference(lr: float, num_workers: int) -> list[np.ndarray]:
    params = init_mlp(np.random.default_rng(7), SIZES)
    x, y = regression_data(np.random.default_rng(11), STEPS * num_workers * BATCH,
                           d_in=SIZES[0], d_out=SIZES[-1])
    for step in range(STEPS):
        lo, hi = step * num_workers * BATCH, (step + 1) * num_workers * BATCH
        _, grads = mse_grads(params, x[lo:hi], y[lo:hi])
        for p, g in zip(params, grads):
            p -= lr * g
    return params


@pytest.mark.parametrize("optimizer", [SGDConfig(lr=0.1), SGDConfig(lr=0.05, momentum=0.9),
                                       AdamConfig(lr=1e-2)], ids=["sgd", "momentum", "adam"])
async def test_sharded_servers_equal_one_server_and_local_training(optimizer: Any) -> None:
    workers = 3
    reports: dict[int, list[Any]] = {}
    for servers in (1, 2):
        reports[servers] = await run_job(servers, workers, make_trainer(optimizer, workers))
        raise_any(reports[servers])
    one, two = reports[1], reports[2]
    for report in one[:1] + two[:2]:
        assert isinstance(report, ServerReport) and report.version == STEPS + 0
        assert report.max_staleness_observed == 0 and len(report.log) == STEPS * workers
    reference = local_reference(optimizer, workers)
    for got in one[1:] + two[2:]:  # every worker, both layouts: bitwise equal
        for a, b in zip(got, reference):
            assert a.tobytes() == b.tobytes()
    if isinstance(optimizer, SGDConfig) and optimizer.momentum == 0:
        for a, b in zip(one[1], big_batch_reference(optimizer.lr, workers)):
            assert np.max(np.abs(a - b)) <= 1e-12


async def test_two_servers_split_the_parameters() -> None:
    seen: list[PSServer] = []

    async def worker(client: PSClient, index: int) -> list[np.ndarray]:
        params = await client.init(init_mlp(np.random.default_rng(7), SIZES),
                                   optimizer=SGDConfig(lr=0.1), bigarray_bound=200)
        return params

    results = await run_job(2, 2, worker, on_servers=seen.extend)
    raise_any(results)
    plan = seen[0].plan
    assert plan is not None and plan.server_sizes == (seen[0].params.size, seen[1].params.size)
    assert [plan.is_sliced(k) for k in range(6)] == [True, False, True, False, False, False]
    assert abs(plan.server_sizes[0] - plan.server_sizes[1]) <= 60
    expected = init_mlp(np.random.default_rng(7), SIZES)
    for got in results[2:]:
        for a, b in zip(got, expected):
            assert a.tobytes() == b.tobytes()


async def test_push_pull_separately_with_names_and_out() -> None:
    async def worker(client: PSClient, index: int) -> dict[str, Any]:
        init = {"w": np.full((3, 4), 1.0), "b": np.zeros(4)}
        params = await client.init(init, optimizer=SGDConfig(lr=1.0), bigarray_bound=5)
        assert client.names == ["w", "b"] and client.versions == (0, 0)
        await client.push({"b": np.full(4, float(index + 1)), "w": np.ones((3, 4))})
        with pytest.raises(ParameterServerError, match="push after push"):
            await client.push([np.ones((3, 4)), np.ones(4)])
        out = [np.empty((3, 4)), np.empty(4)]
        got = await client.pull(out=out)
        assert got is not None and got[0] is out[0]
        return {"params": got, "versions": client.versions, "initial": params}

    results = await run_job(2, 2, worker)
    raise_any(results)
    for r in results[2:]:
        np.testing.assert_array_equal(r["initial"][0], np.full((3, 4), 1.0))
        np.testing.assert_array_equal(r["params"][0], np.zeros((3, 4)))
        np.testing.assert_array_equal(r["params"][1], np.full(4, -1.5))  # -(1+2)/2
        assert r["versions"] == (1, 1)


async def test_spec_mismatch_fails_every_rank() -> None:
    async def worker(client: PSClient, index: int) -> None:
        shape = (3, 4) if index == 0 else (4, 3)
        await client.init([np.zeros(shape)], optimizer=SGDConfig(lr=0.1))

    results = await run_job(2, 2, worker)
    for r in results:
        assert isinstance(r, ParameterServerError), r
        assert "worker rank 3 passed specs" in str(r)


async def test_lost_worker_fails_servers_and_other_workers() -> None:
    transports = InProcessTransport.create_group(5, timeout=10.0)
    servers = [PSServer(t, num_servers=2) for t in transports[:2]]
    killed = asyncio.Event()

    async def worker(index: int) -> None:
        async with PSClient(transports[2 + index], num_servers=2) as client:
            params = await client.init([np.zeros(10), np.zeros(3)],
                                       optimizer=SGDConfig(lr=0.1), bigarray_bound=4)
            for step in range(100):
                if index == 1 and step == 3:
                    await transports[3].aclose()  # this worker's process dies mid-training
                    killed.set()
                    return
                params = await client.step([np.ones(10), np.ones(3)])

    loop = asyncio.get_running_loop()
    started = loop.time()
    results = await run_ranks([servers[0].run, servers[1].run] +
                              [lambda i=i: worker(i) for i in range(3)])
    assert killed.is_set() and loop.time() - started < 5.0
    for r in (0, 1, 2, 4):
        assert isinstance(results[r], ParameterServerError), (r, results[r])
        assert "worker rank 3" in str(results[r])


async def test_lost_server_fails_workers() -> None:
    transports = InProcessTransport.create_group(4, timeout=10.0)
    servers = [PSServer(t, num_servers=2) for t in transports[:2]]

    async def dying_server() -> None:
        task = asyncio.ensure_future(servers[1].run())
        await servers[1].wait_until(lambda s: s.version >= 2)
        task.cancel()
        await transports[1].aclose()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def worker(index: int) -> None:
        client = PSClient(transports[2 + index], num_servers=2)
        await client.init([np.zeros(10)], optimizer=SGDConfig(lr=0.1), bigarray_bound=4)
        for _ in range(100):
            await client.step([np.ones(10)])

    results = await run_ranks([servers[0].run, dying_server,
                               lambda: worker(0), lambda: worker(1)])
    for r in (2, 3):
        assert isinstance(results[r], ParameterServerError), results[r]
        assert "parameter server rank 1" in str(results[r])
    assert isinstance(results[0], ParameterServerError)  # the other server is told too


async def test_worker_exception_aborts_the_job() -> None:
    async def worker(client: PSClient, index: int) -> None:
        await client.init([np.zeros(4)], optimizer=SGDConfig(lr=0.1))
        for step in range(10):
            if index == 0 and step == 2:
                raise RuntimeError("boom")
            await client.step([np.ones(4)])

    results = await run_job(1, 2, worker)
    assert isinstance(results[1], RuntimeError)
    for r in (0, 2):
        assert isinstance(results[r], ParameterServerError), results[r]
        assert "worker rank 1" in str(results[r]) and "RuntimeError: boom" in str(results[r])


async def test_workers_finishing_at_different_times_shut_down_cleanly() -> None:
    async def worker(client: PSClient, index: int) -> int:
        await client.init([np.zeros(4)], optimizer=SGDConfig(lr=1.0))
        for _ in range(3 + 2 * index):
            await client.step([np.ones(4)])
        return index

    results = await run_job(2, 3, worker)
    raise_any(results)
    assert results[2:] == [0, 1, 2]
    assert results[0].version == results[1].version == 7  # sync rounds until the last left


def test_roles_are_checked() -> None:
    transports = InProcessTransport.create_group(3)
    with pytest.raises(ParameterServerError, match="worker rank"):
        PSServer(transports[2], num_servers=2)
    with pytest.raises(ParameterServerError, match="server rank"):
        PSClient(transports[0], num_servers=1)


class GatedTransport(InProcessTransport):
    """Holds back sends on one tag until ``gate`` is set (a slow link, without sleeping)."""

    gate: asyncio.Event
    gated_tag: int

    async def send(self, dst: int, data: Any, *, tag: int = 0,
                   timeout: float | None = None) -> None:
        if tag == self.gated_tag:
            await self.gate.wait()
        await super().send(dst, data, tag=tag, timeout=timeout)


async def test_a_push_counts_only_once_its_gradient_has_landed() -> None:
    from netdist.ps.protocol import ShardedStream, stream_tag

    transports = InProcessTransport.create_group(3, timeout=10.0)
    slow = transports[1]
    slow.__class__ = GatedTransport
    assert isinstance(slow, GatedTransport)
    slow.gate = asyncio.Event()
    slow.gated_tag = -1
    server = PSServer(transports[0], num_servers=1)
    armed = asyncio.Event()

    async def worker(index: int) -> list[np.ndarray]:
        async with PSClient(transports[1 + index], num_servers=1) as client:
            await client.init([np.zeros(4)], optimizer=SGDConfig(lr=1.0))
            if index == 0:  # its header goes out at once, the gradient only later
                slow.gated_tag = stream_tag(client.tags, ShardedStream.DATA)
                step = asyncio.ensure_future(client.step([np.full(4, 2.0)]))
                armed.set()
                await server.wait_until(lambda s: s.clock.state(1).value == "pending")
                slow.gate.set()
                return await step
            await asyncio.wait_for(armed.wait(), 5.0)
            return await client.step([np.full(4, 4.0)])

    results = await run_ranks([server.run, lambda: worker(0), lambda: worker(1)])
    raise_any(results)
    for params in results[1:]:
        np.testing.assert_array_equal(params[0], np.full(4, -3.0))  # -(2 + 4) / 2


async def test_push_then_close_still_counts() -> None:
    async def worker(client: PSClient, index: int) -> None:
        await client.init([np.zeros(3)], optimizer=SGDConfig(lr=1.0))
        await client.push([np.full(3, float(index + 1))])  # no pull: just leave

    results = await run_job(1, 2, worker)
    raise_any(results)
    report = results[0]
    assert report.version == 1 and [e.worker for e in report.log] == [0, 1]


async def test_a_laggard_past_the_timeout_is_named() -> None:
    transports = InProcessTransport.create_group(3, timeout=10.0)
    server = PSServer(transports[0], num_servers=1, timeout=0.3)
    stop = asyncio.Event()

    async def worker(index: int) -> None:
        try:
            async with PSClient(transports[1 + index], num_servers=1, timeout=5.0) as client:
                await client.init([np.zeros(2)], optimizer=SGDConfig(lr=0.1))
                if index == 1:  # computes "forever": until the others have given up
                    await asyncio.wait_for(stop.wait(), 5.0)
                await client.step([np.ones(2)])
        finally:
            stop.set()

    results = await run_ranks([server.run, lambda: worker(0), lambda: worker(1)])
    assert isinstance(results[0], NetdistTimeoutError), results[0]
    for r in results:
        assert "worker rank 2" in str(r), r
    assert isinstance(results[1], ParameterServerError)


@pytest.mark.parametrize("num_servers", [1, 2])
async def test_big_tensors_travel_directly_and_match_packed_results(num_servers: int) -> None:
    big = 80_000  # 640 KB of float64: sliced, and sent as direct segments

    async def worker(client: PSClient, index: int) -> list[np.ndarray]:
        init = [np.linspace(0.0, 1.0, big).reshape(400, 200), np.zeros(3), np.ones(big // 2)]
        await client.init(init, optimizer=SGDConfig(lr=0.5, momentum=0.5),
                          bigarray_bound=1000)
        assert any(seg.direct for seg in client._segments[0])
        params = None
        for step in range(3):
            g0 = np.full((200, 400), float(index + step)).T  # not C-contiguous: packed
            g2 = np.full(big // 2, index + 1.0, dtype=np.float32)  # other dtype: cast
            out = [np.empty((400, 200)), np.empty(3), np.empty(big // 2)]
            params = await client.step([g0, np.full(3, 2.0), g2], out=out)
            assert params[0] is out[0]
        return params

    results = await run_job(num_servers, 2, worker)
    raise_any(results)
    expected0 = np.linspace(0.0, 1.0, big).reshape(400, 200)
    buf = None
    for step in range(3):
        g = np.full((400, 200), (0 + step + 1 + step) / 2)
        buf = g.copy() if buf is None else buf * 0.5 + g
        expected0 = expected0 - 0.5 * buf
    for params in results[num_servers:]:
        np.testing.assert_allclose(params[0], expected0, rtol=0, atol=1e-12)
        np.testing.assert_array_equal(params[2], params[2][0])


async def test_wrong_output_dtype_is_rejected() -> None:
    async def worker(client: PSClient, index: int) -> None:
        await client.init([np.zeros(4)], optimizer=SGDConfig(lr=0.1))
        with pytest.raises(TypeError, match="float32"):
            await client.pull(out=[np.zeros(4, np.float32)])

    raise_any(await run_job(1, 1, worker))
