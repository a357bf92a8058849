"""Bounded busy-polling of small receives (``netdist.transport.spin``)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from netdist.config import DistributedConfig
from netdist.errors import ConfigError
from netdist.transport.local_tcp import create_local_tcp_group
from netdist.transport.spin import (
    DEFAULT_SPIN_US,
    SPIN_MAX_BYTES,
    SpinPolicy,
    available_cpus,
    default_spin_seconds,
    ranks_sharing_host,
)


def test_spin_applies_only_to_small_receives() -> None:
    policy = SpinPolicy(1e-4)
    assert policy.applies_to(None)
    assert policy.applies_to(np.empty(SPIN_MAX_BYTES, np.uint8))
    assert not policy.applies_to(np.empty(SPIN_MAX_BYTES + 1, np.uint8))
    assert not SpinPolicy(0.0).applies_to(None)


def test_negative_budget_refused() -> None:
    with pytest.raises(ValueError, match="spin budget must be >= 0"):
        SpinPolicy(-1.0)


async def test_spin_stops_when_the_message_lands() -> None:
    loop = asyncio.get_running_loop()
    policy = SpinPolicy(30.0)  # far longer than the test: only completion can stop it
    future: asyncio.Future[None] = loop.create_future()
    policy.watch(loop, future)
    for _ in range(5):
        await asyncio.sleep(0)
    assert policy.polls >= 3
    future.set_result(None)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    settled = policy.polls
    for _ in range(20):
        await asyncio.sleep(0)
    assert policy.polls == settled


async def test_spin_is_bounded_by_its_budget() -> None:
    loop = asyncio.get_running_loop()
    policy = SpinPolicy(0.005)
    never: asyncio.Future[None] = loop.create_future()
    started = time.perf_counter()
    policy.watch(loop, never)
    while time.perf_counter() < started + 0.006:  # run the loop past the budget
        await asyncio.sleep(0)
    await asyncio.sleep(0)  # the tick already queued sees the budget spent
    settled = policy.polls
    assert settled > 0
    for _ in range(20):
        await asyncio.sleep(0)
    assert policy.polls == settled
    never.cancel()


def test_ranks_sharing_host_counts_loopback_as_one_host() -> None:
    hosts = ["127.0.0.1", "127.0.0.2", "::1", "10.0.0.5", "10.0.0.5", "node-b"]
    assert ranks_sharing_host(hosts, "127.0.0.1") == 3
    assert ranks_sharing_host(hosts, "10.0.0.5") == 2
    assert ranks_sharing_host(hosts, "NODE-B") == 1
    assert ranks_sharing_host(hosts, "10.0.0.6") == 0


def test_default_spin_only_when_ranks_fit_the_cpus() -> None:
    assert default_spin_seconds(2, cpus=2) == DEFAULT_SPIN_US * 1e-6
    assert default_spin_seconds(1, cpus=8) == DEFAULT_SPIN_US * 1e-6
    assert default_spin_seconds(3, cpus=2) == 0.0
    assert available_cpus() >= 1


def test_spin_us_from_env_and_validation() -> None:
    base = {"NETDIST_RANK": "0", "NETDIST_WORLD_SIZE": "2"}
    assert DistributedConfig.from_env(base).spin_us is None
    assert DistributedConfig.from_env({**base, "NETDIST_SPIN_US": "250"}).spin_us == 250.0
    with pytest.raises(ConfigError, match="NETDIST_SPIN_US='fast' is not a number"):
        DistributedConfig.from_env({**base, "NETDIST_SPIN_US": "fast"})
    with pytest.raises(ConfigError, match="spin_us must be in 0..1000000"):
        DistributedConfig(rank=0, world_size=1, spin_us=-1)


@pytest.mark.parametrize(("spin_us", "expected"), [(None, "auto"), (0.0, 0.0), (250.0, 250e-6)])
async def test_tcp_transport_sets_its_spin_budget(spin_us: float | None,
                                                  expected: float | str) -> None:
    group = await create_local_tcp_group(2, spin_us=spin_us, timeout=10.0)
    try:
        want = default_spin_seconds(2) if expected == "auto" else expected
        assert [t.spin.seconds for t in group] == [want, want]
        # small messages still arrive intact, in order, while receives spin
        for i in range(20):
            sent = np.arange(i, i + 5, dtype=np.int64)
            recv = asyncio.ensure_future(group[1].recv(0, tag=3, timeout=10.0))
            await group[0].send(1, sent, tag=3, timeout=10.0)
            np.testing.assert_array_equal(await recv, sent)
    finally:
        await asyncio.gather(*(t.aclose() for t in group))
