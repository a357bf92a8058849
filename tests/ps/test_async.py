"""Asynchronous and bounded-staleness training against dedicated servers."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from netdist.ps import AdamConfig, PSClient, PSServer, SGDConfig, WorkerLoss
from netdist.ps.staleness import WorkerState
from netdist.transport import InProcessTransport
from tests.ps._model import (
    dyadic_grads,
    dyadic_params,
    dyadic_result,
    init_mlp,
    mse_grads,
    regression_data,
    softmax_ce_grads,
)
from tests.ps.conftest import raise_any, run_ranks
from tests.ps.test_sharded import run_job

SIZES = (6, 12, 3)


def fast_finished(server: PSServer, fast: list[int]) -> bool:
    clock = server.clock
    return clock is not None and all(clock.state(w) is WorkerState.DONE for w in fast)


@pytest.mark.parametrize("num_servers", [1, 2])
async def test_slowed_worker_never_exceeds_max_staleness(num_servers: int) -> None:
    bound, workers, slow = 2, 3, 2
    servers: list[PSServer] = []
    x, y = regression_data(np.random.default_rng(0), 64, d_in=6, d_out=3)

    async def worker(client: PSClient, index: int) -> int:
        params = await client.init(init_mlp(np.random.default_rng(1), SIZES),
                                   optimizer=SGDConfig(lr=0.05), max_staleness=bound,
                                   bigarray_bound=30)
        steps = 4 if index == slow else 12
        for step in range(steps):
            if index == slow:  # wait until the fast workers are held back by us
                await servers[0].wait_until(
                    lambda s: s.clock.blocked or fast_finished(s, [0, 1]), timeout=5.0)
            lo = (step * 8) % 56
            _, grads = mse_grads(params, x[lo:lo + 8], y[lo:lo + 8])
            params = await client.step(grads)
        return steps

    results = await run_job(num_servers, workers, worker, on_servers=servers.extend)
    raise_any(results)
    for report in results[:num_servers]:
        assert len(report.log) == 12 + 12 + 4
        assert all(0 <= e.staleness <= bound for e in report.log)
    slow_entries = [e for e in results[0].log if e.worker == slow]
    assert [e.staleness for e in slow_entries] == [bound] * 4  # it really lagged that far
    assert results[0].max_staleness_observed == bound


async def test_fully_async_lets_a_slow_worker_fall_far_behind() -> None:
    servers: list[PSServer] = []

    async def worker(client: PSClient, index: int) -> None:
        params = await client.init([np.zeros(5)], optimizer=SGDConfig(lr=0.1),
                                   max_staleness=None)
        if index == 1:  # waits for the other worker to apply 6 updates each time
            for _ in range(3):
                target = servers[0].version + 6
                await servers[0].wait_until(
                    lambda s: s.version >= target or fast_finished(s, [0]), timeout=5.0)
                params = await client.step([np.ones(5)])
        else:
            for _ in range(30):
                await client.push([np.ones(5)])  # fully async: pushes need no pull
            params = await client.pull()
        assert params[0].shape == (5,)

    results = await run_job(1, 2, worker, on_servers=servers.extend)
    raise_any(results)
    report = results[0]
    assert len(report.log) == 33 and report.version == 33  # every push applied alone
    slow = [e.staleness for e in report.log if e.worker == 1]
    assert slow and max(slow) >= 6


async def init_dyadic(client: PSClient, lr: float) -> None:
    """Asynchronous training of the order-free model that goes on without a lost worker."""
    await client.init(dyadic_params(), optimizer=SGDConfig(lr=lr), max_staleness=None,
                      bigarray_bound=200, worker_loss=WorkerLoss.CONTINUE)


async def test_lost_workers_pushes_after_the_others_finished_apply_once() -> None:
    """A lost worker's acknowledged pushes apply exactly once even when they come after
    every other worker's last pull: asynchronous pushes wait for no one, so nothing
    orders them before it, and the others' final parameters hold only what had applied
    when their last pull was answered.

    ``test_failover``'s lost-worker test meets this order on a loaded machine (the
    worker it kills slowed down until the others had finished); here it is forced: the
    lost worker pushes only once the server has seen the others finish, then goes away
    without a word, as a killed process does.
    """
    steps, lost_at, lr = 6, 2, 0.5
    transports = InProcessTransport.create_group(4, timeout=10.0)
    server = PSServer(transports[0], num_servers=1)

    async def survivor(index: int) -> tuple[tuple[int, ...], list[np.ndarray]]:
        async with PSClient(transports[1 + index], num_servers=1) as client:
            await init_dyadic(client, lr)
            for step in range(steps):
                params = await client.step(dyadic_grads(index, step))
        return client.versions, params

    async def lost() -> None:
        client = PSClient(transports[1], num_servers=1)
        await init_dyadic(client, lr)
        await server.wait_until(lambda s: fast_finished(s, [1, 2]), timeout=5.0)
        for step in range(lost_at):
            await client.step(dyadic_grads(0, step))
        await transports[1].aclose()  # no DONE: the server sees the peer lost

    results = await run_ranks([server.run, lost, lambda: survivor(1), lambda: survivor(2)])
    raise_any(results)
    report = results[0]
    survivors = [(w, t) for w in (1, 2) for t in range(steps)]
    assert report.dropped == (1,)
    assert report.version == len(survivors) + lost_at  # every push applied, once
    assert [e.worker for e in report.log[-lost_at:]] == [0] * lost_at
    # the last survivor to finish saw every survivor's push and none of the lost worker's
    versions, params = max(results[2:], key=lambda r: r[0])
    assert versions == (len(survivors),)
    for got, want in zip(params, dyadic_result(survivors, 3, lr)):
        np.testing.assert_array_equal(got, want)
    # the server's own parameters hold the lost worker's late pushes too
    plan = server.plan
    assert plan is not None and server.params is not None
    full = dyadic_result(survivors + [(0, t) for t in range(lost_at)], 3, lr)
    np.testing.assert_array_equal(server.params, plan.pack(0, full))


def load_digits_split() -> tuple[np.ndarray, ...]:
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    x = digits.data / 16.0
    y = digits.target
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order], y[order]
    return x[:1500], y[:1500], x[1500:], y[1500:]


@pytest.mark.parametrize("max_staleness", [None, 2])
async def test_async_training_converges_on_digits(max_staleness: Any) -> None:
    x_train, y_train, x_test, y_test = load_digits_split()
    workers, batch, epochs = 3, 32, 6

    async def worker(client: PSClient, index: int) -> float:
        params = await client.init(init_mlp(np.random.default_rng(3), (64, 32, 10)),
                                   optimizer=AdamConfig(lr=1e-2),
                                   max_staleness=max_staleness, bigarray_bound=1000)
        rng = np.random.default_rng(100 + index)
        shard = np.arange(index, len(y_train), workers)
        for _ in range(epochs):
            order = rng.permutation(shard)
            for lo in range(0, len(order) - batch + 1, batch):
                idx = order[lo:lo + batch]
                _, grads = softmax_ce_grads(params, x_train[idx], y_train[idx])
                params = await client.step(grads)
        h = np.tanh(x_test @ params[0].T + params[1]) @ params[2].T + params[3]
        return float(np.mean(np.argmax(h, axis=1) == y_test))

    results = await run_job(2, workers, worker, timeout=30.0)
    raise_any(results)
    for accuracy in results[2:]:
        assert accuracy >= 0.93, accuracy
    if max_staleness is not None:
        for report in results[:2]:
            assert report.max_staleness_observed <= max_staleness
