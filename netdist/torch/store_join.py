"""Joining a netdist job from the store ``torch.distributed`` already set up.

``init_process_group`` gives every backend a key-value store that all ranks of the group
share (torchrun's, ``env://``'s or ``tcp://``'s TCPStore, a FileStore...). netdist uses it
only to meet: rank 0 binds netdist's coordinator on a free port of the store's host and
publishes a ``CoordinatorRecord`` (its ``host:port``, the attempt, a nonce); the others
read it and join as usual, through netdist's own authenticated handshake. The keys are
unique per torchrun attempt, group and generation, and a reader uses a record only if it
names its own attempt (``netdist.torch.store_keys``): torchrun keeps its store across
restarts, and a restarted rank must never reach for the previous attempt's coordinator.

The job token is ``NETDIST_TOKEN`` when set (it never enters the store); otherwise rank 0
draws a random 128-bit token and shares it in the record, so connections are as private
as torch's own rendezvous. Set ``NETDIST_TOKEN`` when the store is reachable by people
who must not join the job.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from netdist.config import DistributedConfig
from netdist.errors import ConfigError, RendezvousTimeoutError
from netdist.progress.job import Job
from netdist.torch.store_keys import Attempt, CoordinatorRecord

__all__ = ["join_from_store", "store_host", "read_record"]

logger = logging.getLogger("netdist.torch")

_STALE_PAUSE = (0.01, 0.25)
"""First and longest pause between reads of a key that holds another attempt's record."""


def store_host(store: Any) -> str:
    """The host of the TCPStore under ``store`` (through PrefixStores), else loopback."""
    seen = 0
    while isinstance(store, dist.PrefixStore) and seen < 64:
        store = store.underlying_store
        seen += 1
    if isinstance(store, dist.TCPStore):
        return str(store.host)
    return os.environ.get("MASTER_ADDR", "127.0.0.1")


def read_record(store: Any, attempt: Attempt, generation: int, rank: int,
                seconds: float) -> CoordinatorRecord:
    """Wait up to ``seconds`` for rank 0's record of ``attempt``'s ``generation``.

    A record of another attempt under the key (only possible if two attempts shared a key
    namespace) is never used: the key is read again until rank 0 overwrites it.
    ``RendezvousTimeoutError`` names the key and what it held when time runs out.
    """
    key = attempt.coordinator_key(generation)
    deadline = time.monotonic() + seconds
    try:
        store.wait([key], timedelta(seconds=seconds))
    except dist.DistStoreError as exc:
        raise RendezvousTimeoutError(
            f"rank {rank}: rank 0 did not publish netdist's coordinator under the store "
            f"key {key!r} within {seconds:.1f}s ({attempt.describe()}); check that rank 0 "
            "is running and reached init_process_group", missing=(0,)) from exc
    pause, warned = _STALE_PAUSE[0], False
    while True:
        record = CoordinatorRecord.decode(store.get(key), key)
        stale = record.stale_for(attempt, generation)
        if stale is None:
            return record
        if not warned:
            logger.warning("netdist: rank %d found a stale coordinator record under %r "
                           "(%s, at %s); waiting for rank 0 to publish this attempt's",
                           rank, key, stale, record.as_dict()["address"])
            warned = True
        if time.monotonic() + pause > deadline:
            raise RendezvousTimeoutError(
                f"rank {rank}: the store key {key!r} still holds a stale netdist "
                f"coordinator record after {seconds:.1f}s: {stale}; its address "
                f"{record.as_dict()['address']} was not used", missing=(0,))
        time.sleep(pause)  # polling the store for rank 0's write: there is no notify
        pause = min(pause * 2, _STALE_PAUSE[1])


def join_from_store(store: Any, rank: int, world_size: int, timeout: timedelta,
                    group_name: str) -> tuple[Job, CoordinatorRecord]:
    """Connect this rank's netdist ``Job``, meeting the others through ``store``; the job
    and the coordinator record the ranks met by.

    ``group_name`` is torch's name of the group. Other settings (heartbeats, limits,
    ``NETDIST_ADVERTISE_ADDR``...) come from the ``NETDIST_*`` environment as for
    ``netdist.connect()``.
    """
    seconds = max(timeout.total_seconds(), 1.0)
    attempt = Attempt.from_env(group_name, world_size)
    generation = attempt.generation(int(store.add(attempt.arrivals_key, 1)))
    key = attempt.coordinator_key(generation)
    env_token = os.environ.get("NETDIST_TOKEN") or None
    overrides: dict[str, Any] = {"rank": rank, "world_size": world_size, "timeout": seconds}
    if not os.environ.get("NETDIST_CONNECT"):
        # as Gloo does, connect every pair at init: a receive from any source and a
        # monitored barrier then never wait on a first connection (NETDIST_CONNECT=lazy
        # opts in to connections on first use)
        overrides["connect"] = "eager"
    if rank == 0:
        drawn = None if env_token is not None else secrets.token_hex(16)
        nonce = secrets.token_hex(8)
        # the address is known once the coordinator is bound; the job id before that
        job_id = CoordinatorRecord(("", 0), attempt, generation, nonce).job_id
        config = DistributedConfig.from_env(None, **overrides, job_id=job_id,
                                            token=env_token or drawn,
                                            coordinator=(store_host(store), 0))
        published: list[CoordinatorRecord] = []

        def publish(address: tuple[str, int]) -> None:
            record = CoordinatorRecord((str(address[0]), int(address[1])), attempt,
                                       generation, nonce, drawn)
            store.set(key, record.encode())
            published.append(record)

        job = Job.connect(config, on_coordinator_ready=publish)
        if not published:  # a world of one rank binds no coordinator: nobody to tell
            return job, CoordinatorRecord(config.coordinator, attempt, generation, nonce,
                                          drawn)
        return job, published[0]
    record = read_record(store, attempt, generation, rank, seconds)
    token = env_token or record.token
    if token is None:
        raise ConfigError(f"rank {rank}: rank 0 joined with NETDIST_TOKEN set, so its "
                          "token is not in the store, and this rank has no NETDIST_TOKEN: "
                          "set the same NETDIST_TOKEN on every rank")
    config = DistributedConfig.from_env(None, **overrides, job_id=record.job_id, token=token,
                                        coordinator=record.address)
    return Job.connect(config), record
