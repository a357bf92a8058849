"""netdist as a ``torch.distributed`` backend, and torch helpers (optional: needs torch).

::

    import torch.distributed as dist
    import netdist.torch                      # registers the backend "netdist"
    dist.init_process_group("netdist")        # env:// (torchrun, netdist launch, Slurm...)

With netdist installed, ``init_process_group("netdist")`` also works without the import:
torch finds the backend through the ``torch.distributed.backends`` entry point. Nothing
in netdist's core imports this package, so netdist stays NumPy-only without torch.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from netdist.progress.proxy import unwrap
from netdist.torch.backend import BACKEND_NAME, ProcessGroupNetdist
from netdist.torch.error_types import NetdistDistError, NetdistNetworkError, NetdistTimeout
from netdist.torch.gradient_sync import GradientSync
from netdist.torch.store_join import join_from_store
from netdist.torch.work_handle import NetdistWork

__all__ = [
    "register",
    "GradientSync",
    "ProcessGroupNetdist",
    "NetdistWork",
    "NetdistDistError",
    "NetdistNetworkError",
    "NetdistTimeout",
    "BACKEND_NAME",
]


def _default_netdist_group() -> ProcessGroupNetdist | None:
    if not dist.is_initialized():
        return None
    default = dist.distributed_c10d._get_default_group()
    return default if isinstance(default, ProcessGroupNetdist) else None


def create_process_group(options: Any, backend_options: Any = None) -> ProcessGroupNetdist:
    """torch's backend factory (``register_backend(..., extended_api=True)``).

    The default group joins a netdist job through torch's store. A subgroup of a netdist
    default group shares that job's connections and progress thread (a netdist subgroup
    named by torch's group name, so only its members take part); a netdist subgroup of a
    default group on another backend joins a job of its own.
    """
    timeout: timedelta = options.timeout
    ranks = list(options.global_ranks_in_group)
    world = _default_netdist_group()
    if ranks and world is not None:
        parent = world.netdist_group
        group = world.job.progress.call(
            lambda: parent.new_group(ranks, name=str(options.group_id)))
        return ProcessGroupNetdist(world.job, group, timeout=timeout, owns_job=False,
                                   store_record=world.store_record)
    job, record = join_from_store(options.store, options.group_rank, options.group_size,
                                  timeout, str(options.group_id))
    return ProcessGroupNetdist(job, unwrap(job.group), timeout=timeout, owns_job=True,
                               store_record=record)


def register() -> None:
    """Register the ``netdist`` backend with ``torch.distributed`` (idempotent)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True,
                                  devices=["cpu"])
    # torch's generic flight recorder needs a C++ backend behind the group, which a
    # Python process group does not have; torch skips such groups by their empty device
    # list, but ours names the CPU (monitored_barrier and the object collectives ask for
    # it), so it is listed with the backends the generic recorder leaves alone.
    skipped = getattr(dist.distributed_c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    if isinstance(skipped, set):
        skipped.add(BACKEND_NAME)


register()
