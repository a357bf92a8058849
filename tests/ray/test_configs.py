"""``NetdistConfig`` and ``NetdistJobConfig`` as Ray Train takes them, without a cluster:
what they accept and refuse, the backends they name, and ``get_job()`` outside a netdist
process group."""

from __future__ import annotations

import pytest

from netdist.errors import ConfigError
from tests.ray import require_ray

pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _ray() -> None:
    require_ray()


def test_netdist_config_is_a_torch_config_on_netdist() -> None:
    from ray.train.torch import TorchConfig

    from netdist.ray import NetdistConfig, NetdistTorchBackend

    config = NetdistConfig()
    assert isinstance(config, TorchConfig)  # what TorchTrainer(torch_config=...) takes
    assert (config.backend, config.init_method, config.timeout_s) == ("netdist", "env", 1800)
    assert config.backend_cls is NetdistTorchBackend
    assert NetdistTorchBackend.share_cuda_visible_devices  # NCCL beside netdist, as Ray's
    assert NetdistConfig(backend="cpu:netdist,cuda:nccl").backend == "cpu:netdist,cuda:nccl"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"backend": "gloo"}, "backend='gloo'. does not give the CPU to netdist"),
    ({"backend": "cpu:gloo,cuda:netdist"}, "does not give the CPU to netdist"),
    ({"backend": None}, "backend=None"),
    ({"backend": "nope"}, "backend=.nope.. does not give the CPU to netdist"),
    ({"backend": "cuda:nccl"}, "does not give the CPU to netdist"),
    ({"init_method": "tcp"}, "only 'env' is supported"),
])
def test_netdist_config_refuses_what_is_not_netdist(kwargs: dict[str, object],
                                                    message: str) -> None:
    from netdist.ray import NetdistConfig

    with pytest.raises(ConfigError, match=message):
        NetdistConfig(**kwargs)  # type: ignore[arg-type]


def test_netdist_job_config_needs_no_torch_process_group() -> None:
    from ray.train.backend import BackendConfig
    from ray.train.torch import TorchConfig

    from netdist.ray import NetdistJobBackend, NetdistJobConfig

    config = NetdistJobConfig()
    assert isinstance(config, BackendConfig) and not isinstance(config, TorchConfig)
    assert config.backend_cls is NetdistJobBackend


def test_get_job_without_a_netdist_process_group_says_what_it_found() -> None:
    import torch.distributed as dist

    from netdist.ray import get_job

    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match="has no torch process group.*netdist.connect"):
        get_job()


def test_get_job_is_the_job_under_the_default_group() -> None:
    """One rank, no cluster: on a netdist default group ``get_job()`` is that group's job;
    on Gloo it names the backend it found."""
    import torch.distributed as dist

    from netdist.progress.job import Job
    from netdist.ray import get_job

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match="runs on 'gloo'"):
            get_job()
    finally:
        dist.destroy_process_group()
    dist.init_process_group("netdist", store=dist.HashStore(), rank=0, world_size=1)
    try:
        job = get_job()
        assert isinstance(job, Job) and (job.rank, job.world_size) == (0, 1)
        assert list(job.group.all_gather_object("only")) == ["only"]
    finally:
        dist.destroy_process_group()
    assert job.closed  # the process group owned it
