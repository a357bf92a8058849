"""The asyncio API: three ``ElasticJob`` members in one event loop over real TCP on
127.0.0.1, an ``async`` step function, and a member that leaves mid-job: the other two
carry on in a new epoch and agree bitwise; bad configurations are named."""

from __future__ import annotations

import asyncio
import secrets

import numpy as np
import pytest

from netdist.config import DistributedConfig
from netdist.elastic import ElasticConfig, ElasticJob, ElasticSampler, ElasticState, StepContext
from netdist.errors import ConfigError
from tests.elastic.cluster import free_ports

SAMPLES = 60


def configs(n: int) -> list[ElasticConfig]:
    ports = free_ports(n)
    seeds = tuple(f"127.0.0.1:{p}" for p in ports)
    token = secrets.token_hex(16)
    return [ElasticConfig(base=DistributedConfig(rank=slot, world_size=n, token=token,
                                                 job_id=f"async-{token[:6]}", timeout=30.0),
                          slot=slot, seeds=seeds, host="127.0.0.1", port=ports[slot],
                          initial_size=n, min_members=1, failure_timeout=2.0)
            for slot in range(n)]


class Member:
    """A linear model trained on ids: the gradient is a one-hot count of the ids used."""

    def __init__(self) -> None:
        self.w = np.zeros(SAMPLES)
        self.state = ElasticState({"w": self.w})
        self.sampler = ElasticSampler(SAMPLES, 6, seed=1)

    async def step(self, ctx: StepContext) -> None:
        assert ctx.batch is not None
        grad = np.zeros(SAMPLES)
        np.add.at(grad, ctx.batch, 1.0)
        await asyncio.sleep(0)  # an await inside the step, as real async code has
        total = await ctx.all_reduce(grad)
        ctx.on_commit(lambda: self.w.__iadd__(total))


async def test_async_members_train_in_step_and_survive_a_member_leaving() -> None:
    members = [Member() for _ in range(3)]
    jobs = await asyncio.wait_for(asyncio.gather(*(
        ElasticJob.start(cfg, m.state, sampler=m.sampler)
        for cfg, m in zip(configs(3), members))), 60)
    try:
        async def train(job: ElasticJob, member: Member, steps: int) -> None:
            while job.step < steps:
                await job.run_step(member.step)

        await asyncio.wait_for(asyncio.gather(*(
            train(j, m, 5) for j, m in zip(jobs, members))), 60)
        assert all(j.epoch == 1 and j.world_size == 3 for j in jobs)
        await jobs[2].aclose()  # leaves the job: the other two carry on
        await asyncio.wait_for(asyncio.gather(*(
            train(j, m, 20) for j, m in zip(jobs[:2], members[:2]))), 60)
        assert jobs[0].world_size == 2 and jobs[0].epoch == 2
        assert np.array_equal(members[0].w, members[1].w)
        # every id once per data epoch: the finished epochs, plus the ids of the current
        # one already used (a step finished without the leaver's share handed its ids
        # back: they come later in the same epoch)
        sampler = members[0].sampler
        expected = np.full(SAMPLES, float(sampler.data_epoch))
        used_now = np.setdiff1d(sampler.permutation()[:sampler.cursor], sampler.deferred)
        expected[used_now] += 1
        assert members[0].w.tolist() == expected.tolist()
        assert jobs[0].resumed + jobs[0].discarded >= 1
    finally:
        for job in jobs:
            await job.aclose()


def test_config_errors_name_the_variable() -> None:
    with pytest.raises(ConfigError, match="NETDIST_ELASTIC_SEEDS"):
        ElasticConfig.from_env({"NETDIST_RANK": "0", "NETDIST_WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="NETDIST_ELASTIC_TIMEOUT"):
        ElasticConfig.from_env({"NETDIST_RANK": "0", "NETDIST_WORLD_SIZE": "1",
                                "NETDIST_ELASTIC_SEEDS": "127.0.0.1:5000",
                                "NETDIST_ELASTIC_TIMEOUT": "soon"})
    with pytest.raises(ConfigError, match="HOST:PORT"):
        ElasticConfig.from_env({"NETDIST_RANK": "0", "NETDIST_WORLD_SIZE": "1",
                                "NETDIST_ELASTIC_SEEDS": "nohost"})
    with pytest.raises(ConfigError, match="seed"):
        ElasticConfig.from_env({"NETDIST_RANK": "0", "NETDIST_WORLD_SIZE": "3",
                                "NETDIST_ELASTIC_SEEDS": "127.0.0.1:5000"})
