"""PURE roles of a parameter-server job and the settings read from its environment.

``ps_roles`` says which ranks of a job serve (the first ``num_servers``) and which work,
dedicated or co-located; ``num_servers_from_env`` reads ``NETDIST_PS_SERVERS`` and
``max_staleness_from_env`` reads ``NETDIST_PS_MAX_STALENESS``, the two knobs launchers
set for the parameter-server modes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from netdist.errors import ConfigError

__all__ = [
    "PS_SERVERS_ENV",
    "DEFAULT_PS_SERVERS",
    "PS_MAX_STALENESS_ENV",
    "PSRoles",
    "ps_roles",
    "default_num_servers",
    "num_servers_from_env",
    "max_staleness_from_env",
]

PS_SERVERS_ENV = "NETDIST_PS_SERVERS"
"""Environment variable naming how many of a job's ranks (the first ones) are servers."""

DEFAULT_PS_SERVERS = 2
"""Server ranks when ``NETDIST_PS_SERVERS`` is unset, for every mode (``netdist ps-server``,
``--aggregator ps-sharded`` / ``ps-async``); fewer only in a job too small to keep a worker
(``default_num_servers``)."""

PS_MAX_STALENESS_ENV = "NETDIST_PS_MAX_STALENESS"
"""Environment variable bounding the staleness of ``ps-async`` (an int >= 0, or ``none``)."""


@dataclass(frozen=True, slots=True)
class PSRoles:
    """Ranks ``0 .. num_servers-1`` serve; the others are workers.

    With ``colocated`` every rank is a worker and the first ``num_servers`` ranks also
    host a server (as BytePS and MXNet deployments often do): no rank sits idle.
    """

    world_size: int
    num_servers: int
    colocated: bool = False

    def __post_init__(self) -> None:
        if self.colocated:
            if not 1 <= self.num_servers <= self.world_size:
                raise ConfigError(
                    f"a job of {self.world_size} ranks can host 1..{self.world_size} "
                    f"co-located parameter servers, got {self.num_servers}")
        elif not 1 <= self.num_servers < self.world_size:
            raise ConfigError(
                f"a job of {self.world_size} ranks can have 1..{self.world_size - 1} "
                f"dedicated parameter servers (at least one worker), got {self.num_servers}")

    @property
    def server_ranks(self) -> range:
        return range(self.num_servers)

    @property
    def worker_ranks(self) -> range:
        return range(0 if self.colocated else self.num_servers, self.world_size)

    @property
    def num_workers(self) -> int:
        return len(self.worker_ranks)

    def is_server(self, rank: int) -> bool:
        return 0 <= rank < self.num_servers

    def is_worker(self, rank: int) -> bool:
        return rank in self.worker_ranks

    def worker_index(self, rank: int) -> int:
        """0-based index of worker ``rank`` (its position among the workers)."""
        if rank not in self.worker_ranks:
            raise ValueError(f"rank {rank} is not a worker rank "
                             f"({self.worker_ranks.start}..{self.world_size - 1})")
        return rank - self.worker_ranks.start


def ps_roles(world_size: int, num_servers: int, *, colocated: bool = False) -> PSRoles:
    """Roles of a job with ``num_servers`` servers on ranks ``0..num_servers-1``."""
    return PSRoles(world_size, num_servers, colocated)


def default_num_servers(world_size: int, *, colocated: bool = False) -> int:
    """``DEFAULT_PS_SERVERS``, or fewer when the job is too small to keep a worker rank.

    Dedicated servers (``colocated=False``) leave at least one rank to work:
    ``min(2, world_size - 1)``; co-located servers also train: ``min(2, world_size)``.
    Never below 1 (a 1-rank dedicated job is then refused by ``ps_roles``).
    """
    limit = world_size if colocated else world_size - 1
    return max(1, min(DEFAULT_PS_SERVERS, limit))


def num_servers_from_env(environ: Mapping[str, str] | None = None, *,
                         default: int | None = None, world_size: int | None = None,
                         colocated: bool = False) -> int:
    """Read ``NETDIST_PS_SERVERS`` (the number of leading server ranks).

    Unset or empty: ``default`` if given, else ``default_num_servers(world_size,
    colocated=colocated)`` when the world size is known, else ``DEFAULT_PS_SERVERS``.
    """
    env = os.environ if environ is None else environ
    text = env.get(PS_SERVERS_ENV, "").strip()
    if not text:
        if default is not None:
            return default
        if world_size is not None:
            return default_num_servers(world_size, colocated=colocated)
        return DEFAULT_PS_SERVERS
    return _int_at_least(PS_SERVERS_ENV, text, 1, "an integer")


def max_staleness_from_env(environ: Mapping[str, str] | None = None, *,
                           default: int | None = 2) -> int | None:
    """Read ``NETDIST_PS_MAX_STALENESS`` (an int >= 0, or ``none``)."""
    env = os.environ if environ is None else environ
    text = env.get(PS_MAX_STALENESS_ENV, "").strip().lower()
    if not text:
        return default
    if text in ("none", "inf", "async"):
        return None
    return _int_at_least(PS_MAX_STALENESS_ENV, text, 0, "an integer or 'none'")


def _int_at_least(name: str, text: str, minimum: int, expected: str) -> int:
    """``text`` (the value of environment variable ``name``) as an int >= ``minimum``;
    ``ConfigError`` saying it is not ``expected`` or is too small."""
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not {expected}") from None
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return value
