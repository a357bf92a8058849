"""What runs on a Ray Train worker before the train function: its node's address and free
ports (on worker 0), and its place in the job written into its environment (on every
worker).

The controller (``netdist.ray.job_config``) calls these through Ray Train's worker group
(``execute``), so they run in the worker processes that will train: the environment they
set is the one the train function, ``netdist.connect()`` and ``init_process_group`` read.
"""

from __future__ import annotations

import os
import socket

import ray
import ray.train

from netdist.ray.places import JobTicket, WorkerPlace, worker_environment

__all__ = ["reserve_addresses", "take_place"]


def reserve_addresses() -> tuple[str, int, int]:
    """This node's address as Ray knows it and two ports free on it at once (so they
    differ): netdist's coordinator port and torch's store port.

    The ports are released before returning, as Ray Train does for torch's own
    ``MASTER_PORT``; the worker that binds them later is this one, moments later.
    """
    address = ray.util.get_node_ip_address()
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family) as first, socket.socket(family) as second:
        first.bind(("", 0))
        second.bind(("", 0))
        return address, int(first.getsockname()[1]), int(second.getsockname()[1])


def take_place(ticket: JobTicket) -> WorkerPlace:
    """Read this worker's place from Ray Train's context, set the variables that make it
    that rank of ``ticket``'s job (``worker_environment``) and return the place."""
    context = ray.train.get_context()
    place = WorkerPlace(
        rank=context.get_world_rank(), world_size=context.get_world_size(),
        local_rank=context.get_local_rank(), local_world_size=context.get_local_world_size(),
        node_rank=context.get_node_rank(), node_ip=ray.util.get_node_ip_address())
    os.environ.update(worker_environment(place, ticket, os.environ))
    return place
