"""PURE: where a Ray Train worker sits in a netdist job, and the variables that say so.

Ray Train decides each worker's rank, local rank and node; netdist reads its
configuration from the environment (``DistributedConfig.from_env``). This module is the
one translation between the two: ``worker_environment`` turns a worker's ``WorkerPlace``
and the group's ``JobTicket`` into the variables ``netdist launch`` would have set for
that rank, so ``netdist.connect()``, ``netdist.init()`` and
``init_process_group("netdist")`` work on a Ray worker as they do under the launcher.

It imports neither Ray nor asyncio, so the translation is tested without a cluster.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from netdist.config import redacted_repr
from netdist.errors import ConfigError

__all__ = ["JobTicket", "WorkerPlace", "worker_environment", "check_places"]

USER_KEPT = ("NETDIST_ADVERTISE_ADDR", "NETDIST_HOST_ID")
"""Variables set from Ray's view of the node only where the worker does not already have
them (a ``runtime_env`` or the node's own environment wins)."""


@dataclass(frozen=True, slots=True)
class JobTicket:
    """What every worker of one worker-group start needs to join the same netdist job.

    The controller issues a new ticket each time Ray Train starts a worker group (the
    first start and every restart after a failure), so a restarted group never meets the
    previous one: new ports, a new job id and a new token.
    """

    coordinator: tuple[str, int]
    """netdist's coordinator, ``NETDIST_COORDINATOR``: worker 0's node address and a port
    that was free there."""
    store: tuple[str, int]
    """torch's ``TCPStore``, ``MASTER_ADDR`` / ``MASTER_PORT``: the same address, another
    free port (under torch the netdist backend meets through this store)."""
    job_id: str
    """``NETDIST_JOB_ID``: ranks of different jobs refuse each other."""
    token: str
    """``NETDIST_TOKEN``: the shared secret of the handshake, drawn per start; shown as
    ``'***'`` by ``repr``."""

    def __post_init__(self) -> None:
        if self.coordinator == self.store:
            raise ConfigError(f"the netdist coordinator and torch's store were given the "
                              f"same address {self.coordinator[0]}:{self.coordinator[1]}")
        if not self.token:
            raise ConfigError("a Ray Train netdist job needs a token; got an empty one")

    def __repr__(self) -> str:
        return redacted_repr(self)


@dataclass(frozen=True, slots=True)
class WorkerPlace:
    """One worker's place as Ray Train assigned it (``ray.train.get_context()``) and the
    address of its node."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    node_ip: str

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"Ray Train gave rank {self.rank} in a world of "
                              f"{self.world_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ConfigError(f"Ray Train gave rank {self.rank} local rank "
                              f"{self.local_rank} of {self.local_world_size}")


def worker_environment(place: WorkerPlace, ticket: JobTicket,
                       current: Mapping[str, str]) -> dict[str, str]:
    """The variables to set in a worker's environment so it joins ``ticket``'s job as
    ``place`` says: netdist's own (rank, world size, coordinator, token, job id) and the
    torch-style ones ``netdist launch`` also sets (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).

    The node's Ray address becomes ``NETDIST_ADVERTISE_ADDR`` (the address the other ranks
    dial, which Ray already reaches this node by) and ``NETDIST_HOST_ID`` (so the workers
    Ray counts on one node, its local ranks, are one host to netdist, and workers of
    different Ray nodes never share memory segments), unless ``current`` (the worker's
    environment) sets them already.
    """
    coordinator_host, coordinator_port = ticket.coordinator
    store_host, store_port = ticket.store
    env = {
        "NETDIST_RANK": str(place.rank),
        "NETDIST_WORLD_SIZE": str(place.world_size),
        "NETDIST_COORDINATOR": _host_port(coordinator_host, coordinator_port),
        "NETDIST_TOKEN": ticket.token,
        "NETDIST_JOB_ID": ticket.job_id,
        "RANK": str(place.rank),
        "WORLD_SIZE": str(place.world_size),
        "LOCAL_RANK": str(place.local_rank),
        "LOCAL_WORLD_SIZE": str(place.local_world_size),
        "NODE_RANK": str(place.node_rank),
        "MASTER_ADDR": store_host,
        "MASTER_PORT": str(store_port),
    }
    for name in USER_KEPT:
        if not current.get(name):
            env[name] = place.node_ip
    return env


def check_places(places: list[WorkerPlace]) -> None:
    """Check that Ray Train numbered the workers of one group as the backend assumes:
    worker ``i`` of the group has rank ``i``, and every worker counts the same world size
    (``len(places)``); raise ``ConfigError`` naming the first worker that does not."""
    for index, place in enumerate(places):
        if place.rank != index or place.world_size != len(places):
            raise ConfigError(
                f"Ray Train worker {index} of {len(places)} reports rank {place.rank} of "
                f"{place.world_size} (node {place.node_ip}); netdist expects rank {index} "
                f"of {len(places)}")


def _host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets (``parse_host_port``'s form)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
