"""netdist on Ray Train (optional: ``pip install 'netdist[ray]'``).

::

    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer
    from netdist.ray import NetdistConfig

    TorchTrainer(train_fn, torch_config=NetdistConfig(),          # torch on netdist
                 scaling_config=ScalingConfig(num_workers=4)).fit()

- ``NetdistConfig``: a ``TorchConfig`` for ``TorchTrainer``; each worker's default
  process group is on netdist, and ``get_job()`` in the train function gives the netdist
  ``Job`` under it (netdist's own API on the same connections);
- ``NetdistJobConfig``: a ``BackendConfig`` for Ray Train's data-parallel trainer without
  torch; ``netdist.connect()`` or ``netdist.init()`` in the train function joins the job;
- ``WorkerPlace``, ``JobTicket``, ``worker_environment``: how a worker's rank, local rank,
  node and the job's addresses and token become its environment (PURE).

Ray (and torch, for ``NetdistConfig`` and ``get_job``) is imported only when a name is
first used; nothing in netdist's core imports this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

_EXPORTS: dict[str, str] = {
    "NetdistConfig": "netdist.ray.torch_config",
    "NetdistTorchBackend": "netdist.ray.torch_config",
    "NetdistJobConfig": "netdist.ray.job_config",
    "NetdistJobBackend": "netdist.ray.job_config",
    "get_job": "netdist.ray.process_group",
    "JobTicket": "netdist.ray.places",
    "WorkerPlace": "netdist.ray.places",
    "worker_environment": "netdist.ray.places",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from netdist.ray.job_config import NetdistJobBackend, NetdistJobConfig
    from netdist.ray.places import JobTicket, WorkerPlace, worker_environment
    from netdist.ray.process_group import get_job
    from netdist.ray.torch_config import NetdistConfig, NetdistTorchBackend
else:
    from netdist._lazy import attach as _attach

    __getattr__, __dir__ = _attach(__name__, _EXPORTS)
