"""torch's process group on netdist inside a Ray Train worker: made before the train
function runs, destroyed after it, and the netdist ``Job`` under it for netdist's own API.

``init_torch_group`` and ``destroy_torch_group`` run on the workers (the controller's
``NetdistTorchBackend`` calls them through the worker group); ``get_job`` is for the train
function.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from netdist.errors import ConfigError
from netdist.progress.job import Job
from netdist.torch import default_netdist_group

__all__ = ["init_torch_group", "destroy_torch_group", "get_job"]


def init_torch_group(backend: str, timeout_s: float) -> None:
    """``init_process_group(backend)`` from the variables ``take_place`` set (``env://``:
    ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); ``timeout_s`` bounds every
    collective, as ``TorchConfig.timeout_s`` does. The netdist backend meets through
    torch's store and takes the token from ``NETDIST_TOKEN``, so it never enters the
    store."""
    dist.init_process_group(backend=backend, init_method="env://",
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timedelta(seconds=timeout_s))


def destroy_torch_group() -> None:
    """Destroy this worker's default process group, if it has one (closing netdist's job:
    BYE to every peer still connected)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def get_job() -> Job:
    """The netdist ``Job`` under torch's default process group, in a train function run
    with ``netdist.ray.NetdistConfig``: its ``group`` is netdist's world ``Group`` (every
    collective, blocking), on the same connections and progress thread as DDP's
    all-reduces, so netdist's own API needs no second job.

    Raises ``ConfigError`` when this process has no default group on netdist (no group
    yet, or one on another backend), naming what it found.
    """
    ops = default_netdist_group()
    if ops is not None:
        return ops.job
    found = (f"its default process group runs on {dist.get_backend()!r}"
             if dist.is_initialized() else "it has no torch process group")
    raise ConfigError(
        f"netdist.ray.get_job(): this process (pid {os.getpid()}) has no netdist process "
        f"group: {found}. Train with TorchTrainer(..., torch_config=netdist.ray."
        "NetdistConfig()), or with NetdistJobConfig call netdist.connect() in the train "
        "function")
