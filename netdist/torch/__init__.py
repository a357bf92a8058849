"""netdist as a ``torch.distributed`` backend, and torch helpers (optional: needs torch).

::

    import torch.distributed as dist
    import netdist.torch                      # registers the backend "netdist"
    dist.init_process_group("netdist")        # env:// (torchrun, netdist launch, Slurm...)

``"cpu:netdist,cuda:nccl"`` (either order) instead gives CPU tensors to netdist and CUDA
tensors to NCCL: netdist is then torch's per-device ``Backend`` for the CPU
(``NetdistBackend``) in a ``ProcessGroup`` torch builds; alone, netdist is the whole
group (``ProcessGroupNetdist``).

With netdist installed, ``init_process_group("netdist")`` also works without the import:
torch finds the backend through the ``torch.distributed.backends`` entry point. Nothing
in netdist's core imports this package, so netdist stays NumPy-only without torch.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from netdist.progress.proxy import unwrap
from netdist.torch.backend import BACKEND_NAME, NetdistOps, ProcessGroupNetdist
from netdist.torch.backend_string import devices_of_group_being_built
from netdist.torch.device_backend import NetdistBackend
from netdist.torch.error_types import NetdistDistError, NetdistNetworkError, NetdistTimeout
from netdist.torch.gradient_sync import GradientSync
from netdist.torch.store_join import join_from_store
from netdist.torch.work_handle import NetdistWork

__all__ = [
    "register",
    "GradientSync",
    "ProcessGroupNetdist",
    "NetdistBackend",
    "NetdistWork",
    "NetdistDistError",
    "NetdistNetworkError",
    "NetdistTimeout",
    "BACKEND_NAME",
    "default_netdist_group",
]


def default_netdist_group() -> NetdistOps | None:
    """The netdist group or backend serving the CPU of the default group, if any (the
    default group was made with ``"netdist"`` or ``"cpu:netdist,..."``): its
    ``netdist_group`` is the netdist ``Group`` behind torch's, and its ``job`` the
    progress thread that runs it (for ``netdist.checkpoint`` or netdist's own API in a
    torch program)."""
    if not dist.is_initialized():
        return None
    default = dist.distributed_c10d._get_default_group()
    if isinstance(default, ProcessGroupNetdist):
        return default
    if torch.device("cpu") not in default._device_types:
        return None
    backend = default._get_backend(torch.device("cpu"))
    return backend if isinstance(backend, NetdistBackend) else None


def create_process_group(options: Any, backend_options: Any = None,
                         ) -> ProcessGroupNetdist | NetdistBackend:
    """torch's backend factory (``register_backend(..., extended_api=True)``).

    When netdist is the group's only backend it returns the whole group, a
    ``ProcessGroupNetdist``; beside another device's backend (``"cpu:netdist,cuda:nccl"``)
    it returns the CPU ``NetdistBackend`` and torch builds the ``ProcessGroup`` around
    both (``netdist.torch.backend_string`` says which case this is).

    The default group joins a netdist job through torch's store. A subgroup of a default
    group whose CPU runs on netdist shares that job's connections and progress thread (a
    netdist subgroup named by torch's group name, so only its members take part); a
    netdist subgroup of a default group that runs the CPU on another backend (Gloo)
    joins a job of its own.
    """
    devices = devices_of_group_being_built()
    whole = devices is not None and set(devices.values()) == {BACKEND_NAME}
    kind: type[ProcessGroupNetdist] | type[NetdistBackend] = (
        ProcessGroupNetdist if whole else NetdistBackend)
    timeout: timedelta = options.timeout
    ranks = list(options.global_ranks_in_group)
    world = default_netdist_group()
    if ranks and world is not None:
        parent = world.netdist_group
        group = world.job.progress.call(
            lambda: parent.new_group(ranks, name=str(options.group_id)))
        return kind(world.job, group, timeout=timeout, owns_job=False,
                    store_record=world.store_record)
    job, record = join_from_store(options.store, options.group_rank, options.group_size,
                                  timeout, str(options.group_id))
    return kind(job, unwrap(job.group), timeout=timeout, owns_job=True, store_record=record)


def register() -> None:
    """Register the ``netdist`` backend with ``torch.distributed`` (idempotent)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    # the CPU only: "netdist" alone makes a CPU group, and "cpu:netdist,cuda:nccl" gives
    # the CPU to netdist and CUDA to NCCL (create_process_group returns the whole group
    # or the CPU backend accordingly)
    dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True,
                                  devices=["cpu"])
    # torch's generic flight recorder hook needs a C++ backend behind the group, which a
    # netdist-only group (a Python ProcessGroup) does not have; torch skips such groups by
    # their empty device list, but ours names the CPU (monitored_barrier and the object
    # collectives ask for it), so netdist is listed with the backends the recorder leaves
    # alone, which also keeps the hook off netdist's calls in a mixed group
    skipped = getattr(dist.distributed_c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    if isinstance(skipped, set):
        skipped.add(BACKEND_NAME)


register()
