"""Frozen configuration: wire limits and the per-process distributed configuration.

``DistributedConfig.from_env()`` reads netdist's own variables first and falls back to the
ones existing launchers already set, so a job started by torchrun, srun, mpirun, a
Kubernetes indexed Job or Docker Compose needs no extra wiring.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from netdist.errors import ConfigError

__all__ = ["WireLimits", "AdmissionLimits", "DistributedConfig", "parse_host_port", "DEFAULT_PORT",
           "MIN_TOKEN_LENGTH", "WeakTokenWarning", "check_token_strength", "redacted_repr",
           "ConnectMode", "NumberSetting", "NUMBER_SETTINGS", "SWITCH_ON", "SWITCH_OFF",
           "SWITCH_VARIABLES", "EVENT_LOOP_CHOICES", "CONFIG_VARIABLES", "SET_BY_LAUNCHERS",
           "parse_switch", "parse_choice", "validate_environment"]

DEFAULT_PORT = 29400
"""Coordinator port used when only a host is given (torchrun's MASTER_PORT default is 29500)."""

MIN_TOKEN_LENGTH = 16
"""Tokens shorter than this many characters draw a ``WeakTokenWarning``."""

REDACTED = "***"
"""What ``repr()`` shows in place of a set token."""


class WeakTokenWarning(UserWarning):
    """The job token is short enough to be guessed offline.

    Anyone who records one handshake (or makes a rank connect to it) holds an HMAC of
    the token over known bytes and can test guesses at millions per second; only a long
    random token (``secrets.token_hex(16)`` or more, 128 bits) makes that hopeless.
    """


def check_token_strength(token: str | None, *, stacklevel: int = 2) -> None:
    """Warn with ``WeakTokenWarning`` if ``token`` is set but shorter than
    ``MIN_TOKEN_LENGTH`` characters. No token (``None`` or ``""``) is not warned about:
    that is the explicit unauthenticated mode, which only loopback allows. The warning
    states the length, never the token; ``stacklevel`` counts from our caller (1 = the
    function that called this one), as in ``warnings.warn``."""
    if token and len(token) < MIN_TOKEN_LENGTH:
        warnings.warn(
            f"the job token is only {len(token)} characters long (fewer than "
            f"{MIN_TOKEN_LENGTH}): anyone who records a handshake can guess it offline; use "
            "a random token of at least 128 bits, e.g. "
            "python3 -c 'import secrets; print(secrets.token_hex(16))'",
            WeakTokenWarning, stacklevel=stacklevel + 1)


def redacted_repr(obj: Any, secret_fields: tuple[str, ...] = ("token",)) -> str:
    """``repr()`` of a dataclass with each set field of ``secret_fields`` shown as
    ``'***'`` (an unset one as its value, so ``None`` still reads ``None``): configs end
    up in logs, tracebacks and bug reports, tokens must not."""
    parts = []
    for item in dataclasses.fields(obj):
        if not item.repr:
            continue
        value = getattr(obj, item.name)
        shown = REDACTED if item.name in secret_fields and value else value
        parts.append(f"{item.name}={shown!r}")
    return f"{type(obj).__name__}({', '.join(parts)})"


def _plain(number: float) -> str:
    """``number`` as written in a message: ``1000000``, not ``1e+06``."""
    return str(int(number)) if float(number).is_integer() else repr(number)


@dataclass(frozen=True, slots=True)
class NumberSetting:
    """The rule for one numeric setting: its field, its environment variable, its unit and
    its range.

    One rule serves both ways a value arrives, so the two cannot drift apart: ``parse``
    reads the environment variable's text (the error names the variable and the text, as
    the user typed them), ``check`` validates a Python argument (the error names the
    field). Every value must be finite: an infinite timeout or heartbeat interval would
    leave a wait unbounded, which netdist promises never to do, and NaN compares false
    with everything, so it would pass any range check written the other way round.
    """

    field: str
    """Attribute name on the dataclass that holds the value."""
    variable: str | None
    """``NETDIST_*`` variable it is read from; ``None``: an argument only."""
    unit: str
    """``"seconds"``, ``"microseconds"``, or ``""`` for a plain count."""
    low: float
    """Lower bound of the range."""
    low_inclusive: bool = False
    """Whether ``low`` itself is allowed (``>=``) or not (``>``)."""
    high: float | None = None
    """Inclusive upper bound, if any."""
    integer: bool = False
    """Whether the value must be an integer."""
    optional: bool = False
    """Whether ``None`` (meaning "the default rule") is allowed."""

    @property
    def bounds(self) -> str:
        """The range as written in messages: ``> 0``, ``>= 1`` or ``in 0..1000000``."""
        if self.high is not None:
            return f"in {_plain(self.low)}..{_plain(self.high)}"
        return f"{'>=' if self.low_inclusive else '>'} {_plain(self.low)}"

    def in_range(self, value: float) -> bool:
        """Whether the finite ``value`` lies within the range."""
        above = value >= self.low if self.low_inclusive else value > self.low
        return above and (self.high is None or value <= self.high)

    def check(self, value: object) -> None:
        """Raise ``ConfigError`` unless ``value`` (a Python argument) is acceptable."""
        if value is None and self.optional:
            return
        unit = f" {self.unit}" if self.unit else ""
        if self.integer:
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ConfigError(f"{self.field} must be an integer, got {value!r}")
        elif (isinstance(value, bool) or not isinstance(value, numbers.Real)
              or not math.isfinite(value)):
            raise ConfigError(f"{self.field} must be a finite number of {self.unit}, "
                              f"got {value!r}")
        if not self.in_range(float(value)):
            raise ConfigError(f"{self.field} must be {self.bounds}{unit}, got {value!r}")

    def parse(self, text: str) -> float | int:
        """The value of the environment variable holding ``text``; ``ConfigError`` naming
        the variable, the text and what is accepted, whatever is wrong with it (not a
        number, not finite, out of range)."""
        name = self.variable or self.field
        if self.integer:
            try:
                whole = int(text)
            except ValueError:
                whole = None
            if whole is None or not self.in_range(whole):
                raise ConfigError(f"{name}={text!r} is not an integer {self.bounds}")
            return whole
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        if not (math.isfinite(number) and self.in_range(number)):
            raise ConfigError(f"{name}={text!r} is not a number of {self.unit} (expected a "
                              f"finite number {self.bounds})")
        return number


NUMBER_SETTINGS: tuple[NumberSetting, ...] = (
    NumberSetting("timeout", "NETDIST_TIMEOUT", "seconds", 0),
    NumberSetting("connect_timeout", "NETDIST_CONNECT_TIMEOUT", "seconds", 0, optional=True),
    NumberSetting("heartbeat_interval", "NETDIST_HEARTBEAT_INTERVAL", "seconds", 0),
    NumberSetting("heartbeat_misses", "NETDIST_HEARTBEAT_MISSES", "", 1, low_inclusive=True,
                  integer=True),
    NumberSetting("spin_us", "NETDIST_SPIN_US", "microseconds", 0, low_inclusive=True,
                  high=1e6, optional=True),
)
"""``DistributedConfig``'s numeric fields, each with its ``NETDIST_*`` variable and range."""

_HANDSHAKE_TIMEOUT = NumberSetting("handshake_timeout", None, "seconds", 0)
_REFUSAL_LOG_INTERVAL = NumberSetting("refusal_log_interval", None, "seconds", 0,
                                      low_inclusive=True)

SWITCH_ON: tuple[str, ...] = ("1", "true", "yes", "on")
"""The words that turn a ``NETDIST_*`` switch on (any case, surrounding spaces ignored)."""
SWITCH_OFF: tuple[str, ...] = ("0", "false", "no", "off")
"""The words that turn a ``NETDIST_*`` switch off."""

SWITCH_VARIABLES: tuple[str, ...] = ("NETDIST_INSECURE", "NETDIST_SHM", "NETDIST_DEBUG")
"""Every on/off ``NETDIST_*`` variable netdist reads (each through ``parse_switch``)."""

EVENT_LOOP_CHOICES: tuple[str, ...] = ("auto", "uvloop", "asyncio")
"""Values of ``NETDIST_EVENT_LOOP`` (see ``netdist.progress.loops``)."""


def parse_switch(env: Mapping[str, str], name: str, default: bool) -> bool:
    """The on/off switch ``name`` in ``env``: ``default`` when unset or empty, ``True`` for
    a word of ``SWITCH_ON``, ``False`` for one of ``SWITCH_OFF``.

    Anything else is a ``ConfigError`` naming the variable, the value and the accepted
    words: a typo (``NETDIST_SHM=of``) must not silently mean the opposite of what was
    meant."""
    raw = env.get(name)
    word = (raw or "").strip().lower()
    if not word:
        return default
    if word in SWITCH_ON:
        return True
    if word in SWITCH_OFF:
        return False
    raise ConfigError(f"{name}={raw!r} is neither on ({', '.join(SWITCH_ON)}) nor off "
                      f"({', '.join(SWITCH_OFF)})")


def parse_choice(env: Mapping[str, str], name: str, choices: tuple[str, ...],
                 default: str) -> str:
    """The value of ``name`` in ``env``, lower-cased: ``default`` when unset or empty, else
    one of ``choices``; anything else is a ``ConfigError`` naming the accepted values."""
    raw = env.get(name)
    word = (raw or "").strip().lower()
    if not word:
        return default
    if word not in choices:
        raise ConfigError(f"{name}={raw!r} is not one of {', '.join(choices)}")
    return word


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
    """Wire dtype names accepted; ``None`` means every dtype netdist carries
    (``netdist.types.CARRIED_DTYPES``: ``WIRE_DTYPES`` and always bfloat16)."""

    def __post_init__(self) -> None:
        if self.max_header_bytes < 64:
            raise ConfigError(f"max_header_bytes must be >= 64, got {self.max_header_bytes}")
        if self.max_payload_bytes < 0:
            raise ConfigError(f"max_payload_bytes must be >= 0, got {self.max_payload_bytes}")
        if not 0 <= self.max_ndim <= 64:
            raise ConfigError(f"max_ndim must be in 0..64, got {self.max_ndim}")


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """Bounds on inbound connections that have not authenticated yet (strangers).

    Anyone who can reach a rank's port, or the coordinator's, can open connections; until
    the handshake proves the job token each one costs a descriptor and some memory. These
    bound that cost per process, so no stranger can exhaust a rank: at most
    ``max_unauthenticated`` at once (beyond it new ones are closed at once, established
    peers are never touched), each with a small buffer and a short deadline, and none at
    all while the process is within ``fd_reserve`` descriptors of its ``RLIMIT_NOFILE``.
    """

    max_unauthenticated: int = 64
    """Connections that may be mid-handshake at once (listener and coordinator together);
    a job larger than this admits its world size, so its own ranks, all registering or
    dialling at start-up, are never turned away."""
    handshake_timeout: float = 10.0
    """Seconds a connection gets to authenticate (never more than the join timeout)."""
    handshake_header_bytes: int = 4096
    """Largest frame header read before authentication (handshake frames are far smaller);
    the read buffer starts at 1 KiB and grows to the job's limits only after it."""
    fd_reserve: int = 256
    """Descriptors kept free for the job's own files and peers: strangers are refused
    while fewer than this many remain below the soft ``RLIMIT_NOFILE``."""
    raise_fd_limit: bool = True
    """At transport start, raise the soft ``RLIMIT_NOFILE`` towards the hard limit (at most
    65536), as Go's runtime does; the hard limit is never changed."""
    refusal_log_interval: float = 30.0
    """Refused and failed strangers are logged at most once per this many seconds (the
    first in full, the rest counted), so a flood cannot flood the log."""

    def __post_init__(self) -> None:
        if self.max_unauthenticated < 1:
            raise ConfigError(
                f"max_unauthenticated must be >= 1, got {self.max_unauthenticated}")
        _HANDSHAKE_TIMEOUT.check(self.handshake_timeout)
        if self.handshake_header_bytes < 64:
            raise ConfigError(
                f"handshake_header_bytes must be >= 64, got {self.handshake_header_bytes}")
        if self.fd_reserve < 0:
            raise ConfigError(f"fd_reserve must be >= 0, got {self.fd_reserve}")
        _REFUSAL_LOG_INTERVAL.check(self.refusal_log_interval)


class ConnectMode(enum.Enum):
    """When a rank opens its connections to the other ranks (``DistributedConfig.connect``)."""

    LAZY = "lazy"
    """On first use: the first send to a peer, or the first receive posted from it, connects
    (either side may; one connection per pair survives). A rank holds only the connections
    its algorithms use. The default."""
    EAGER = "eager"
    """At start-up, to every other rank: n(n-1)/2 connections in the job before ``connect``
    returns (each rank connects to every lower rank and waits for every higher one)."""


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


def _connect_mode(value: object) -> ConnectMode:
    """``value`` (``"lazy"`` / ``"eager"``, any case) as a ``ConnectMode``."""
    mode = value.strip().lower() if isinstance(value, str) else None
    if mode not in ("lazy", "eager"):
        raise ConfigError(f"connect (NETDIST_CONNECT) must be 'lazy' or 'eager', got {value!r}")
    return ConnectMode(mode)


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
    connect_timeout: float | None = None
    """Bound, in seconds, on each phase of joining (reaching the coordinator, waiting for
    every rank, connecting to the peers); ``None``: the same as ``timeout``."""
    heartbeat_interval: float = 2.0
    """Seconds between HEARTBEAT frames on an idle connection."""
    heartbeat_misses: int = 5
    """A peer silent for ``heartbeat_interval * heartbeat_misses`` seconds (the liveness
    window) is declared lost. On a progress thread heartbeats flow while the caller
    computes, so the window bounds how fast a dead or stopped rank is detected without
    limiting how long a healthy rank may compute between two collectives."""
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
    admission: AdmissionLimits = field(default_factory=AdmissionLimits)
    """Bounds on connections that have not authenticated yet (see ``AdmissionLimits``)."""
    connect: ConnectMode = ConnectMode.LAZY
    """When to connect to the peers: ``"lazy"`` (on first use, the default) or ``"eager"``
    (all of them at start-up); a ``ConnectMode`` or its value."""
    host_id: str | None = None
    """Stands in for ``NETDIST_HOST_ID`` in this rank's host key
    (``netdist.transport.host_identity``): ranks of one machine with different values act
    as different hosts. ``None`` (the default): the variable, if set. For several ranks
    in one process (``local_tcp_group(n, host_ids=...)``), where one variable cannot
    differ per rank."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside 0..{self.world_size - 1}")
        for setting in NUMBER_SETTINGS:
            setting.check(getattr(self, setting.field))
        if not self.job_id:
            raise ConfigError("job_id must not be empty")
        if self.token is not None and type(self.token) is not str:
            raise ConfigError(f"token must be a str or None, got {type(self.token).__name__}")
        if not isinstance(self.connect, ConnectMode):
            object.__setattr__(self, "connect", _connect_mode(self.connect))
        check_token_strength(self.token, stacklevel=3)  # -> whoever built the config

    def __repr__(self) -> str:
        """The fields, with the token shown as ``'***'`` (tokens are never printed)."""
        return redacted_repr(self)

    @property
    def join_timeout(self) -> float:
        """The bound on each phase of joining: ``connect_timeout``, else ``timeout``."""
        return self.timeout if self.connect_timeout is None else self.connect_timeout

    @property
    def liveness_window(self) -> float:
        """Seconds of silence after which a peer is declared lost."""
        return self.heartbeat_interval * self.heartbeat_misses

    def replace(self, **changes: Any) -> DistributedConfig:
        """Return a copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> DistributedConfig:
        """Build a config from the environment; keyword ``overrides`` win over everything.

        Precedence: overrides, then ``NETDIST_*``, then torchrun / PyTorchJob
        (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; under torchrun,
        recognised by ``TORCHELASTIC_RUN_ID``, the coordinator takes ``MASTER_PORT + 1``
        because torchrun's store listens on ``MASTER_PORT``), Slurm
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
            port = DEFAULT_PORT if port is None else port
            if _first(env, "TORCHELASTIC_RUN_ID") is not None:
                # torchrun's own store already listens on MASTER_PORT: take the next one
                if port >= 65535:
                    raise ConfigError(f"under torchrun netdist's coordinator takes MASTER_PORT"
                                      f" + 1, and MASTER_PORT={port} has none; set "
                                      "NETDIST_COORDINATOR")
                port += 1
            values["coordinator"] = (env["MASTER_ADDR"], port)

        values.update(_settings_from_env(env))
        values.update(overrides)
        missing = [name for name in ("rank", "world_size") if name not in values]
        if missing:
            raise ConfigError(
                f"cannot determine {' and '.join(missing)}: pass them explicitly or set "
                "NETDIST_RANK/NETDIST_WORLD_SIZE (or RANK/WORLD_SIZE, SLURM_PROCID/"
                "SLURM_NTASKS, OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE)"
            )
        return cls(**values)


_STRING_SETTINGS: tuple[tuple[str, str], ...] = (
    ("job_id", "NETDIST_JOB_ID"), ("token", "NETDIST_TOKEN"),
    ("advertise_addr", "NETDIST_ADVERTISE_ADDR"), ("listen_host", "NETDIST_LISTEN_HOST"),
    ("connect", "NETDIST_CONNECT"),
)
"""``DistributedConfig`` fields taken as text from their ``NETDIST_*`` variable."""


def _settings_from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """The ``DistributedConfig`` fields set by ``NETDIST_*`` variables other than rank,
    world size and coordinator, each parsed and range-checked (``NUMBER_SETTINGS``,
    ``parse_switch``): the one reading of them, shared by ``from_env`` and
    ``validate_environment``."""
    values: dict[str, Any] = {}
    for key, var in _STRING_SETTINGS:
        value = _first(env, var)
        if value is not None:
            values[key] = value
    for setting in NUMBER_SETTINGS:
        text = _first(env, setting.variable) if setting.variable else None
        if text is not None:
            values[setting.field] = setting.parse(text)
    if parse_switch(env, "NETDIST_INSECURE", False):
        values["insecure"] = True
    return values


SET_BY_LAUNCHERS: frozenset[str] = frozenset({
    "NETDIST_RANK", "NETDIST_WORLD_SIZE", "NETDIST_COORDINATOR", "NETDIST_RESTART_COUNT",
})
"""``NETDIST_*`` variables a launcher sets for each rank (``netdist launch`` overwrites
them), so they are not the user's to validate up front."""

CONFIG_VARIABLES: frozenset[str] = frozenset({
    *(var for _, var in _STRING_SETTINGS),
    *(setting.variable for setting in NUMBER_SETTINGS if setting.variable),
    *SWITCH_VARIABLES, "NETDIST_EVENT_LOOP", "NETDIST_HOST_ID",
})
"""The ``NETDIST_*`` variables whose rules live in this module (``validate_environment``
checks them); ``NETDIST_HOST_ID`` and the names, addresses and token may be any text."""


def validate_environment(env: Mapping[str, str] | None = None) -> None:
    """Check every variable of ``CONFIG_VARIABLES`` in ``env`` (default ``os.environ``)
    with the code that reads it; raise the first ``ConfigError``, which names the variable
    and its value.

    ``netdist launch`` calls this before it starts any rank, so a bad value (a timeout of
    ``inf``, ``NETDIST_SHM=of``) is one line from the launcher instead of the same error
    from every rank. The variables a launcher sets per rank (``SET_BY_LAUNCHERS``) are left
    out. Settings whose rules live in higher layers (the parameter-server knobs in
    ``netdist.ps.roles``, ``NETDIST_SHM_COPY`` in ``netdist.collectives.host.settings``) are
    checked by the launcher with those readers, since imports point down only.
    """
    env = os.environ if env is None else env
    config_settings = _settings_from_env(env)
    if "connect" in config_settings:
        _connect_mode(config_settings["connect"])
    for name in SWITCH_VARIABLES:
        parse_switch(env, name, False)
    parse_choice(env, "NETDIST_EVENT_LOOP", EVENT_LOOP_CHOICES, "auto")
