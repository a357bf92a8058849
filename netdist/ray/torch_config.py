"""Ray Train's ``TorchTrainer`` with torch's process group on netdist:
``TorchTrainer(train_fn, torch_config=NetdistConfig(), ...)``.

``NetdistConfig`` is a ``TorchConfig`` (what ``TorchTrainer`` takes) whose backend is
``NetdistTorchBackend``: at each start of the worker group it gives every worker its place
in a new netdist job exactly as ``NetdistJobConfig`` does (worker 0's node address, free
ports, a token drawn for this start, rank, local rank and host id in the environment),
then calls ``init_process_group("netdist")`` on every worker. The train function then
runs DDP, FSDP2 or any ``torch.distributed`` code on netdist, and
``netdist.ray.get_job()`` gives netdist's own API on the same connections.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError
from ray.train.torch.config import TorchConfig

from netdist.errors import ConfigError
from netdist.ray.job_config import NetdistJobBackend, start_job
from netdist.ray.process_group import destroy_torch_group, init_torch_group
from netdist.torch.backend import BACKEND_NAME

__all__ = ["NetdistConfig", "NetdistTorchBackend", "SHUTDOWN_TIMEOUT_S"]

logger = logging.getLogger("netdist.ray")

SHUTDOWN_TIMEOUT_S = 30.0
"""Seconds ``on_shutdown`` waits for the workers to destroy their process groups (a
worker that died cannot answer; Ray Train then ends the actors itself)."""


def _cpu_backend(backend: str) -> str | None:
    """The backend CPU tensors get under the backend string ``backend``, read as torch
    reads it: the string itself when it names one backend (``"netdist"``), else the
    backend paired with ``cpu`` (``"cpu:netdist,cuda:nccl"``), ``None`` without one."""
    text = backend.strip().lower()
    if ":" not in text:
        return text
    for item in text.split(","):
        device, _, name = item.partition(":")
        if device.strip() == "cpu":
            return name.strip()
    return None


class NetdistTorchBackend(NetdistJobBackend):
    """Ray Train's ``Backend`` for ``NetdistConfig``: a new netdist job at each start of
    the worker group (``NetdistJobBackend``), then torch's process group on it; destroyed
    when Ray Train shuts the group down (after training, or before a restart)."""

    share_cuda_visible_devices: bool = True  # as TorchConfig: NCCL beside netdist needs it

    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        start_job(worker_group)
        ray.get(worker_group.execute_async(init_torch_group, backend_config.backend,
                                           float(backend_config.timeout_s)))

    def on_shutdown(self, worker_group: Any, backend_config: Any) -> None:
        futures = worker_group.execute_async(destroy_torch_group)
        try:
            ray.get(futures, timeout=SHUTDOWN_TIMEOUT_S)
        except GetTimeoutError:
            logger.warning("netdist: the Ray Train workers did not destroy their process "
                           "groups within %.0fs", SHUTDOWN_TIMEOUT_S)


@dataclass
class NetdistConfig(TorchConfig):
    """``TorchConfig`` for netdist: ``TorchTrainer(..., torch_config=NetdistConfig())``.

    ``backend`` is the backend string of torch's process group and must give the CPU to
    netdist: ``"netdist"`` (the default), or ``"cpu:netdist,cuda:nccl"`` for GPU workers.
    ``timeout_s`` bounds every collective, as ``TorchConfig``'s does (a dead or
    unreachable worker is found within netdist's liveness window, 10 s by default,
    whatever this is). Only ``init_method="env"`` exists here: the ranks meet through
    torch's store on worker 0, and netdist authenticates them with the token of this
    start of the group.
    """

    backend: str | None = BACKEND_NAME
    init_method: str = "env"
    timeout_s: int = 1800

    def __post_init__(self) -> None:
        if self.init_method != "env":
            raise ConfigError(f"NetdistConfig(init_method={self.init_method!r}): only "
                              "'env' is supported (the ranks meet through torch's store)")
        if not self.backend or _cpu_backend(self.backend) != BACKEND_NAME:
            raise ConfigError(f"NetdistConfig(backend={self.backend!r}) does not give the "
                              "CPU to netdist: use 'netdist' or 'cpu:netdist,cuda:nccl' "
                              "(or Ray's own TorchConfig for other backends)")

    @property
    def backend_cls(self) -> type[NetdistTorchBackend]:
        return NetdistTorchBackend
