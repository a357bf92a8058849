"""``ElasticConfig``: where this process's endpoint is, who to ask, and the one timeout knob.

Read from the environment that ``netdist launch --elastic`` sets (and that a Slurm script
or a compose file sets the same way)::

    NETDIST_ELASTIC_SLOT      this process's slot (0..n-1 for the first members)
    NETDIST_ELASTIC_SEEDS     every slot's endpoint, host:port,host:port,... (slot order)
    NETDIST_ELASTIC_PORT      the port this slot's endpoint binds (default: its seed's)
    NETDIST_ELASTIC_HOST      the host it binds and advertises (default: its seed's host)
    NETDIST_ELASTIC_MIN       members below which the job stops (default 1; a side must
                              also hold a strict majority of the last membership)
    NETDIST_ELASTIC_TIMEOUT   the one knob, seconds (default 5): see ``failure_timeout``
    NETDIST_WORLD_SIZE        how many members form the first epoch
    NETDIST_RESTART_COUNT     > 0 makes a process join a running job instead of forming it

plus the usual ``NETDIST_TOKEN`` / ``NETDIST_JOB_ID`` (``DistributedConfig.from_env``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from netdist.config import DistributedConfig
from netdist.errors import ConfigError

from netdist.elastic.membership import format_endpoint, parse_endpoint

__all__ = ["ElasticConfig", "DEFAULT_FAILURE_TIMEOUT"]

DEFAULT_FAILURE_TIMEOUT = 5.0


@dataclass(frozen=True)
class ElasticConfig:
    """One process of an elastic job (see the module docstring).

    ``failure_timeout`` (T, seconds) is the one knob. Everything else follows from it and
    from what the job measures: a silent member is declared lost after T (heartbeats
    every T/5); a member that does not answer its endpoint's handshake within T/2 is
    skipped; the leader of an agreement waits at most 1.5 T for survivors that have not
    arrived (one T more while it has no majority yet); an epoch's rendezvous is bounded
    by 2 T; a collective inside a step may wait 2 T plus three times the slowest recent
    whole step (so a slow but live member is never mistaken for a lost one). A SIGKILLed
    member is noticed at once (its connections reset) whatever the knob.
    """

    base: DistributedConfig
    slot: int
    seeds: tuple[str, ...]
    host: str
    port: int
    initial_size: int
    min_members: int
    failure_timeout: float = DEFAULT_FAILURE_TIMEOUT
    restart_count: int = 0

    def __post_init__(self) -> None:
        if self.slot < 0 or self.slot >= len(self.seeds):
            raise ConfigError(f"elastic slot {self.slot} has no seed endpoint (NETDIST_ELASTIC_"
                              f"SEEDS lists {len(self.seeds)})")
        if not 1 <= self.initial_size <= len(self.seeds):
            raise ConfigError(f"the first membership of {self.initial_size} needs as many "
                              f"seed endpoints, NETDIST_ELASTIC_SEEDS lists {len(self.seeds)}")
        if not 1 <= self.min_members:
            raise ConfigError(f"NETDIST_ELASTIC_MIN must be >= 1, got {self.min_members}")
        if not self.failure_timeout > 0:
            raise ConfigError(f"NETDIST_ELASTIC_TIMEOUT must be > 0, got {self.failure_timeout}")

    @property
    def joining(self) -> bool:
        """Whether this process joins a running job (a restart or a spare slot)."""
        return self.restart_count > 0 or self.slot >= self.initial_size

    @property
    def endpoint(self) -> str:
        """This slot's endpoint as advertised."""
        return format_endpoint(self.host, self.port)

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between heartbeats on an epoch's connections."""
        return self.failure_timeout / 5

    @property
    def handshake_timeout(self) -> float:
        """How long a member's endpoint may take to answer a handshake."""
        return max(0.5, self.failure_timeout / 2)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 **overrides: object) -> ElasticConfig:
        """Read the variables above (``ConfigError`` naming a bad or missing one)."""
        env = os.environ if environ is None else environ
        base = DistributedConfig.from_env(env)
        seeds_text = env.get("NETDIST_ELASTIC_SEEDS", "")
        if not seeds_text.strip():
            raise ConfigError("NETDIST_ELASTIC_SEEDS is not set: list every slot's endpoint as "
                              "host:port,host:port,... (netdist launch --elastic sets it)")
        try:
            seeds = tuple(format_endpoint(*parse_endpoint(s)) for s in seeds_text.split(",")
                          if s.strip())
        except ValueError as exc:
            raise ConfigError(f"NETDIST_ELASTIC_SEEDS: {exc}") from None
        slot = _int(env, "NETDIST_ELASTIC_SLOT", base.rank)
        own_host, own_port = parse_endpoint(seeds[slot]) if 0 <= slot < len(seeds) else ("", 0)
        initial = base.world_size
        values: dict[str, object] = {
            "base": base, "slot": slot, "seeds": seeds,
            "host": env.get("NETDIST_ELASTIC_HOST", own_host) or own_host,
            "port": _int(env, "NETDIST_ELASTIC_PORT", own_port),
            "initial_size": initial,
            "min_members": _int(env, "NETDIST_ELASTIC_MIN", 1),
            "failure_timeout": _float(env, "NETDIST_ELASTIC_TIMEOUT", DEFAULT_FAILURE_TIMEOUT),
            "restart_count": _int(env, "NETDIST_RESTART_COUNT", 0),
        }
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name)
    if text is None or not text.strip():
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {text!r}") from None


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    text = env.get(name)
    if text is None or not text.strip():
        return default
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds, got {text!r}") from None
