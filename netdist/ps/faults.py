"""PURE fault-tolerance settings of the dedicated parameter servers.

Two independent choices, both off by default (the job then ends on any loss, as every
netdist job with a fixed membership does):

- ``ReplicaLayout``: with ``replicas=1`` every server shard has a *backup* server rank
  (the next server, round the ring), which applies every update before the primary
  acknowledges it, and takes the shard over when the primary is lost
  (``netdist.ps.replication``). Read from ``NETDIST_PS_REPLICAS`` by ``netdist ps-server``
  and ``replicas_from_env``.
- ``WorkerLoss``: what the servers do when a worker is lost (killed, or silent past the
  transport's liveness window, as a SIGSTOPped process is): fail the job, or drop the
  worker and go on with the others. Chosen by the workers at ``PSClient.init``.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass

from netdist.errors import ConfigError

__all__ = [
    "PS_REPLICAS_ENV",
    "MAX_REPLICAS",
    "WorkerLoss",
    "ReplicaLayout",
    "replicas_from_env",
]

PS_REPLICAS_ENV = "NETDIST_PS_REPLICAS"
"""Environment variable: backups per server shard (0 or 1; unset: 0)."""

MAX_REPLICAS = 1
"""Backups per shard supported: one (primary-backup)."""

MAX_REPLICATED_SERVERS = 32
"""A replicated job's shards each talk on their own tag span; a range holds 32."""


class WorkerLoss(enum.Enum):
    """What the servers do when a worker is lost mid-training."""

    FAIL = "fail"
    """Tell every other worker and stop the job (the default: a fixed membership)."""
    CONTINUE = "continue"
    """Drop the worker and go on with the others. Asynchronous and bounded-staleness
    training no longer wait for it; synchronous training averages each later update
    over the workers that contributed to it."""


@dataclass(frozen=True, slots=True)
class ReplicaLayout:
    """Which server rank backs up which shard: shard ``s``'s backup is ``(s + 1) % S``.

    Shard ``s`` starts on server rank ``s`` (its primary). With ``replicas=0`` there are
    no backups. Every server is primary of one shard and backup of the previous one, so
    the replicas cost every server one more shard's memory and an extra hop per update,
    and the job survives the loss of any one server (more, if no two lost servers are
    neighbours on the ring).
    """

    num_servers: int
    replicas: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.replicas <= MAX_REPLICAS:
            raise ConfigError(f"replicas must be 0..{MAX_REPLICAS}, got {self.replicas}")
        if self.replicas and not 2 <= self.num_servers <= MAX_REPLICATED_SERVERS:
            raise ConfigError(
                f"replicas={self.replicas} needs 2..{MAX_REPLICATED_SERVERS} servers (a "
                f"backup lives on another server rank), got {self.num_servers}")

    @property
    def replicated(self) -> bool:
        return self.replicas > 0

    def backup(self, shard: int) -> int | None:
        """The server rank holding shard ``shard``'s backup, or None."""
        self._check(shard)
        return (shard + 1) % self.num_servers if self.replicas else None

    def backed_up(self, server: int) -> int | None:
        """The shard server rank ``server`` is the backup of, or None."""
        self._check(server)
        return (server - 1) % self.num_servers if self.replicas else None

    def _check(self, index: int) -> None:
        if not 0 <= index < self.num_servers:
            raise ValueError(f"shard/server {index} is outside 0..{self.num_servers - 1}")


def replicas_from_env(environ: Mapping[str, str] | None = None, *, default: int = 0) -> int:
    """Read ``NETDIST_PS_REPLICAS`` (0 or 1); unset or empty: ``default``."""
    env = os.environ if environ is None else environ
    text = env.get(PS_REPLICAS_ENV, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{PS_REPLICAS_ENV}={text!r} is not an integer") from None
    if not 0 <= value <= MAX_REPLICAS:
        raise ConfigError(f"{PS_REPLICAS_ENV} must be 0..{MAX_REPLICAS}, got {value}")
    return value
