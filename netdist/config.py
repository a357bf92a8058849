"""Frozen configuration: wire limits and the per-process distributed configuration.

``DistributedConfig.from_env()`` reads netdist's own variables first and falls back to the
ones existing launchers already set, so a job started by torchrun, srun, mpirun, a
Kubernetes indexed Job or Docker Compose needs no extra wiring.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from netdist.errors import ConfigError

__all__ = ["WireLimits", "DistributedConfig", "parse_host_port", "DEFAULT_PORT"]

DEFAULT_PORT = 29400
"""Coordinator port used when only a host is given (torchrun's MASTER_PORT default is 29500)."""


@dataclass(frozen=True, slots=True)
class WireLimits:
    """Bounds checked on every incoming frame before any allocation.

    Defaults are generous for training traffic yet stop a hostile or broken peer from
    making a rank allocate unbounded memory.
    """

    max_header_bytes: int = 64 * 1024
    max_payload_bytes: int = 8 * 1024**3
    max_ndim: int = 32
    allowed_dtypes: frozenset[str] | None = None
    """Wire dtype names accepted; ``None`` means every dtype in ``netdist.types.WIRE_DTYPES``."""

    def __post_init__(self) -> None:
        if self.max_header_bytes < 64:
            raise ConfigError(f"max_header_bytes must be >= 64, got {self.max_header_bytes}")
        if self.max_payload_bytes < 0:
            raise ConfigError(f"max_payload_bytes must be >= 0, got {self.max_payload_bytes}")
        if not 0 <= self.max_ndim <= 64:
            raise ConfigError(f"max_ndim must be in 0..64, got {self.max_ndim}")


def parse_host_port(text: str, *, what: str = "address") -> tuple[str, int]:
    """Parse ``host:port`` (or ``[v6]:port``, or a bare host with the default port)."""
    text = text.strip()
    if not text:
        raise ConfigError(f"{what} is empty")
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket:
            raise ConfigError(f"{what} {text!r}: missing ']' after the IPv6 address")
        if rest and not rest.startswith(":"):
            raise ConfigError(f"{what} {text!r}: expected ':port' after ']', got {rest!r}")
        port_text = rest[1:]
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:
        host, port_text = text, ""
    if not host:
        raise ConfigError(f"{what} {text!r}: host is empty")
    if not port_text:
        return host, DEFAULT_PORT
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"{what} {text!r}: port {port_text!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{what} {text!r}: port {port} is out of range 0..65535")
    return host, port


def _first(env: Mapping[str, str], *names: str) -> str | None:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            return value
    return None


def _int_from(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value in (None, ""):
            continue
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None
    return None


@dataclass(frozen=True, slots=True)
class DistributedConfig:
    """Everything one rank needs to join a job.

    ``timeout`` is the default bound, in seconds, for every network wait (send, recv,
    barrier, collectives); each call may override it.
    """

    rank: int
    world_size: int
    coordinator: tuple[str, int] = ("127.0.0.1", DEFAULT_PORT)
    job_id: str = "netdist"
    token: str | None = None
    timeout: float = 60.0
    connect_timeout: float = 60.0
    heartbeat_interval: float = 2.0
    heartbeat_misses: int = 5
    listen_host: str | None = None
    """Interface this rank's peer listener binds; defaults to the advertise address."""
    advertise_addr: str | None = None
    """Address other ranks use to reach this one; defaults to the coordinator-facing address."""
    insecure: bool = False
    """Allow listening on a non-loopback address without a token."""
    spin_us: float | None = None
    """Microseconds a small receive keeps the event loop polling before it sleeps (saves
    the process wake-up on the latency path); ``None``: 100 unless this host runs more
    ranks than it has CPUs, then 0 (see ``netdist.transport.spin``)."""
    limits: WireLimits = field(default_factory=WireLimits)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside 0..{self.world_size - 1}")
        for name in ("timeout", "connect_timeout", "heartbeat_interval"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {value}")
        if self.heartbeat_misses < 1:
            raise ConfigError(f"heartbeat_misses must be >= 1, got {self.heartbeat_misses}")
        if self.spin_us is not None and not 0 <= self.spin_us <= 1e6:
            raise ConfigError(f"spin_us must be in 0..1000000 microseconds, got {self.spin_us}")
        if not self.job_id:
            raise ConfigError("job_id must not be empty")

    def replace(self, **changes: Any) -> DistributedConfig:
        """Return a copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> DistributedConfig:
        """Build a config from the environment; keyword ``overrides`` win over everything.

        Precedence: overrides, then ``NETDIST_*``, then torchrun / PyTorchJob
        (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), Slurm
        (``SLURM_PROCID``, ``SLURM_NTASKS``), Open MPI (``OMPI_COMM_WORLD_RANK``,
        ``OMPI_COMM_WORLD_SIZE``) and Kubernetes indexed Jobs (``JOB_COMPLETION_INDEX``).
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}

        rank = _int_from(env, "NETDIST_RANK", "RANK", "SLURM_PROCID",
                         "OMPI_COMM_WORLD_RANK", "JOB_COMPLETION_INDEX")
        world = _int_from(env, "NETDIST_WORLD_SIZE", "WORLD_SIZE", "SLURM_NTASKS",
                          "OMPI_COMM_WORLD_SIZE")
        if rank is not None:
            values["rank"] = rank
        if world is not None:
            values["world_size"] = world

        coordinator = _first(env, "NETDIST_COORDINATOR")
        if coordinator is not None:
            values["coordinator"] = parse_host_port(coordinator, what="NETDIST_COORDINATOR")
        elif _first(env, "MASTER_ADDR") is not None:
            port = _int_from(env, "MASTER_PORT")
            if port is not None and not 0 <= port <= 65535:
                raise ConfigError(f"MASTER_PORT={port} is out of range 0..65535")
            values["coordinator"] = (env["MASTER_ADDR"], DEFAULT_PORT if port is None else port)

        for key, var in (("job_id", "NETDIST_JOB_ID"), ("token", "NETDIST_TOKEN"),
                         ("advertise_addr", "NETDIST_ADVERTISE_ADDR"),
                         ("listen_host", "NETDIST_LISTEN_HOST")):
            value = _first(env, var)
            if value is not None:
                values[key] = value
        for key, var, unit in (("timeout", "NETDIST_TIMEOUT", "seconds"),
                               ("spin_us", "NETDIST_SPIN_US", "microseconds")):
            number = _first(env, var)
            if number is not None:
                try:
                    values[key] = float(number)
                except ValueError:
                    raise ConfigError(f"{var}={number!r} is not a number of {unit}") from None
        if (_first(env, "NETDIST_INSECURE") or "").strip().lower() in ("1", "true", "yes"):
            values["insecure"] = True

        values.update(overrides)
        missing = [name for name in ("rank", "world_size") if name not in values]
        if missing:
            raise ConfigError(
                f"cannot determine {' and '.join(missing)}: pass them explicitly or set "
                "NETDIST_RANK/NETDIST_WORLD_SIZE (or RANK/WORLD_SIZE, SLURM_PROCID/"
                "SLURM_NTASKS, OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE)"
            )
        return cls(**values)
