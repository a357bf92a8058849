"""Joining a netdist job from the store ``torch.distributed`` already set up.

``init_process_group`` gives every backend a key-value store that all ranks of the group
share (torchrun's, ``env://``'s or ``tcp://``'s TCPStore, a FileStore...). netdist uses it
only to meet: rank 0 binds netdist's coordinator on a free port of the store's host and
publishes ``host:port``; the others read it and join as usual, through netdist's own
authenticated handshake. The job token is ``NETDIST_TOKEN`` when set (it never enters the
store); otherwise rank 0 draws a random 128-bit token and shares it through the store, so
connections are as private as torch's own rendezvous. Set ``NETDIST_TOKEN`` when the store
is reachable by people who must not join the job.
"""

from __future__ import annotations

import os
import secrets
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from netdist.config import DistributedConfig, parse_host_port
from netdist.progress.job import Job

__all__ = ["join_from_store", "store_host"]

_COORDINATOR_KEY = "netdist/coordinator"
_TOKEN_KEY = "netdist/token"


def store_host(store: Any) -> str:
    """The host of the TCPStore under ``store`` (through PrefixStores), else loopback."""
    seen = 0
    while isinstance(store, dist.PrefixStore) and seen < 64:
        store = store.underlying_store
        seen += 1
    if isinstance(store, dist.TCPStore):
        return str(store.host)
    return os.environ.get("MASTER_ADDR", "127.0.0.1")


def join_from_store(store: Any, rank: int, world_size: int, timeout: timedelta,
                    job_id: str) -> Job:
    """Connect this rank's netdist ``Job``, meeting the others through ``store``.

    Other settings (heartbeats, limits, ``NETDIST_ADVERTISE_ADDR``...) come from the
    ``NETDIST_*`` environment as for ``netdist.connect()``.
    """
    seconds = max(timeout.total_seconds(), 1.0)
    token = os.environ.get("NETDIST_TOKEN") or None
    overrides: dict[str, Any] = {"rank": rank, "world_size": world_size, "timeout": seconds,
                                 "job_id": f"torch:{job_id}"}
    if not os.environ.get("NETDIST_CONNECT"):
        # as Gloo does, connect every pair at init: a receive from any source and a
        # monitored barrier then never wait on a first connection (NETDIST_CONNECT=lazy
        # opts in to connections on first use)
        overrides["connect"] = "eager"
    if rank == 0:
        if token is None:
            token = secrets.token_hex(16)
            store.set(_TOKEN_KEY, token)
        config = DistributedConfig.from_env(None, **overrides, token=token,
                                            coordinator=(store_host(store), 0))

        def publish(address: tuple[str, int]) -> None:
            store.set(_COORDINATOR_KEY, f"{address[0]}:{address[1]}")

        return Job.connect(config, on_coordinator_ready=publish)
    address = store.get(_COORDINATOR_KEY).decode()
    if token is None:
        token = store.get(_TOKEN_KEY).decode()
    config = DistributedConfig.from_env(
        None, **overrides, token=token,
        coordinator=parse_host_port(address, what="the netdist coordinator in the store"))
    return Job.connect(config)
