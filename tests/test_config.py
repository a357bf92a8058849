"""``netdist.config``: environment precedence, address parsing and every validation error."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from netdist.config import (
    DEFAULT_PORT,
    MIN_TOKEN_LENGTH,
    DistributedConfig,
    WeakTokenWarning,
    WireLimits,
    parse_host_port,
)
from netdist.errors import ConfigError

TOKEN = "secret-token-0123456789"

# --------------------------------------------------------------------------- parse_host_port


@pytest.mark.parametrize(("text", "expected"), [
    ("127.0.0.1:29500", ("127.0.0.1", 29500)),
    ("node-1.cluster.local:80", ("node-1.cluster.local", 80)),
    ("  10.0.0.2:1234 \n", ("10.0.0.2", 1234)),
    ("coordinator", ("coordinator", DEFAULT_PORT)),
    ("coordinator:", ("coordinator", DEFAULT_PORT)),
    ("[::1]:80", ("::1", 80)),
    ("[::1]", ("::1", DEFAULT_PORT)),
    ("[fe80::1%eth0]:65535", ("fe80::1%eth0", 65535)),
    ("::1", ("::1", DEFAULT_PORT)),  # bare IPv6: no port can be told apart
    ("host:0", ("host", 0)),
])
def test_parse_host_port(text: str, expected: tuple[str, int]) -> None:
    assert parse_host_port(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("", "coordinator is empty"),
    ("   ", "coordinator is empty"),
    ("host:http", "port 'http' is not a number"),
    ("host:-1", "port -1 is out of range 0..65535"),
    ("host:65536", "port 65536 is out of range 0..65535"),
    ("[::1]:99999", "port 99999 is out of range"),
    ("[::1", "missing ']'"),
    ("[::1]80", "expected ':port' after ']'"),
    (":80", "host is empty"),
    ("[]:80", "host is empty"),
])
def test_parse_host_port_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        parse_host_port(text, what="coordinator")
    assert isinstance(info.value, ValueError)


# --------------------------------------------------------------------------- from_env


def test_from_env_netdist_variables() -> None:
    env = {
        "NETDIST_RANK": "2", "NETDIST_WORLD_SIZE": "4",
        "NETDIST_COORDINATOR": "10.1.2.3:4000", "NETDIST_JOB_ID": "exp7",
        "NETDIST_TOKEN": TOKEN, "NETDIST_TIMEOUT": "12.5",
        "NETDIST_ADVERTISE_ADDR": "10.1.2.9", "NETDIST_LISTEN_HOST": "0.0.0.0",
        "NETDIST_INSECURE": "1",
    }
    assert DistributedConfig.from_env(env) == DistributedConfig(
        rank=2, world_size=4, coordinator=("10.1.2.3", 4000), job_id="exp7", token=TOKEN,
        timeout=12.5, advertise_addr="10.1.2.9", listen_host="0.0.0.0", insecure=True)


def test_from_env_defaults() -> None:
    config = DistributedConfig.from_env({"NETDIST_RANK": "0", "NETDIST_WORLD_SIZE": "1"})
    assert config == DistributedConfig(rank=0, world_size=1)
    assert config.coordinator == ("127.0.0.1", DEFAULT_PORT)
    assert config.token is None and config.insecure is False
    assert config.job_id == "netdist" and config.timeout == 60.0


TORCHRUN = {"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "master", "MASTER_PORT": "29500"}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8"}
OMPI = {"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "9"}


def test_netdist_variables_win_over_torchrun_slurm_and_mpi() -> None:
    env = {**TORCHRUN, **SLURM, **OMPI, "JOB_COMPLETION_INDEX": "4",
           "NETDIST_RANK": "0", "NETDIST_WORLD_SIZE": "2", "NETDIST_COORDINATOR": "c:1"}
    config = DistributedConfig.from_env(env)
    assert (config.rank, config.world_size, config.coordinator) == (0, 2, ("c", 1))


def test_torchrun_variables_win_over_slurm_and_mpi() -> None:
    config = DistributedConfig.from_env({**TORCHRUN, **SLURM, **OMPI,
                                         "JOB_COMPLETION_INDEX": "4"})
    assert (config.rank, config.world_size, config.coordinator) == (1, 3, ("master", 29500))


def test_master_addr_without_port_uses_the_default_port() -> None:
    config = DistributedConfig.from_env({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "m"})
    assert config.coordinator == ("m", DEFAULT_PORT)


def test_slurm_wins_over_mpi_and_indexed_jobs() -> None:
    config = DistributedConfig.from_env({**SLURM, **OMPI, "JOB_COMPLETION_INDEX": "4"})
    assert (config.rank, config.world_size) == (5, 8)


def test_open_mpi_variables() -> None:
    config = DistributedConfig.from_env({**OMPI, "JOB_COMPLETION_INDEX": "4"})
    assert (config.rank, config.world_size) == (6, 9)


def test_kubernetes_indexed_job_takes_rank_from_completion_index() -> None:
    config = DistributedConfig.from_env({"JOB_COMPLETION_INDEX": "3", "WORLD_SIZE": "4"})
    assert (config.rank, config.world_size) == (3, 4)


def test_rank_and_world_size_are_resolved_independently() -> None:
    # A Slurm job that sets NETDIST_WORLD_SIZE only still takes the rank from Slurm.
    config = DistributedConfig.from_env({**SLURM, "NETDIST_WORLD_SIZE": "6"})
    assert (config.rank, config.world_size) == (5, 6)


def test_empty_variables_are_ignored() -> None:
    env = {"NETDIST_RANK": "", "RANK": "1", "NETDIST_WORLD_SIZE": "", "WORLD_SIZE": "2",
           "NETDIST_COORDINATOR": "", "MASTER_ADDR": "m", "MASTER_PORT": "",
           "NETDIST_TOKEN": "", "NETDIST_TIMEOUT": ""}
    config = DistributedConfig.from_env(env)
    assert (config.rank, config.world_size, config.coordinator) == (1, 2, ("m", DEFAULT_PORT))
    assert config.token is None and config.timeout == 60.0


def test_netdist_coordinator_wins_over_master_addr() -> None:
    config = DistributedConfig.from_env({**TORCHRUN, "NETDIST_COORDINATOR": "[::1]:7000"})
    assert config.coordinator == ("::1", 7000)


def test_overrides_win_over_everything() -> None:
    env = {"NETDIST_RANK": "1", "NETDIST_WORLD_SIZE": "2", "NETDIST_TOKEN": "env-" + TOKEN}
    config = DistributedConfig.from_env(env, rank=0, token="arg-" + TOKEN, timeout=3.0)
    assert ((config.rank, config.world_size, config.token, config.timeout)
            == (0, 2, "arg-" + TOKEN, 3.0))


def test_overrides_alone_need_no_environment() -> None:
    assert DistributedConfig.from_env({}, rank=0, world_size=1) == DistributedConfig(0, 1)


@pytest.mark.parametrize("value", ["0", "false", "no", ""])
def test_insecure_only_when_asked(value: str) -> None:
    env = {"NETDIST_RANK": "0", "NETDIST_WORLD_SIZE": "1", "NETDIST_INSECURE": value}
    assert DistributedConfig.from_env(env).insecure is False


@pytest.mark.parametrize(("env", "message"), [
    ({}, "cannot determine rank and world_size"),
    ({"RANK": "0"}, "cannot determine world_size"),
    ({"WORLD_SIZE": "2"}, "cannot determine rank"),
    ({"NETDIST_RANK": "one", "NETDIST_WORLD_SIZE": "2"}, "NETDIST_RANK='one' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2.0"}, "WORLD_SIZE='2.0' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "m", "MASTER_PORT": "x"},
     "MASTER_PORT='x' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "m", "MASTER_PORT": "70000"},
     "MASTER_PORT=70000 is out of range"),
    ({"RANK": "0", "WORLD_SIZE": "2", "NETDIST_COORDINATOR": "h:p"},
     "NETDIST_COORDINATOR 'h:p': port 'p' is not a number"),
    ({"RANK": "0", "WORLD_SIZE": "2", "NETDIST_TIMEOUT": "soon"},
     "NETDIST_TIMEOUT='soon' is not a number of seconds"),
    ({"RANK": "0", "WORLD_SIZE": "2", "NETDIST_TIMEOUT": "0"},
     r"NETDIST_TIMEOUT='0' is not a number of seconds \(expected a finite number > 0\)"),
    ({"RANK": "0", "WORLD_SIZE": "2", "NETDIST_TIMEOUT": "nan"},
     r"NETDIST_TIMEOUT='nan' is not a number of seconds \(expected a finite number > 0\)"),
    ({"RANK": "0", "WORLD_SIZE": "2", "NETDIST_TIMEOUT": "inf"},
     r"NETDIST_TIMEOUT='inf' is not a number of seconds \(expected a finite number > 0\)"),
    ({"RANK": "0", "WORLD_SIZE": "2", "NETDIST_HEARTBEAT_MISSES": "x"},
     "NETDIST_HEARTBEAT_MISSES='x' is not an integer >= 1"),
    ({"RANK": "0", "WORLD_SIZE": "2", "NETDIST_INSECURE": "yse"},
     "NETDIST_INSECURE='yse' is neither on"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "rank 2 is outside 0..1"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "rank -1 is outside 0..1"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "world_size must be >= 1, got 0"),
])
def test_from_env_errors(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DistributedConfig.from_env(env)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(("changes", "message"), [
    ({"world_size": 0}, "world_size must be >= 1, got 0"),
    ({"rank": 4}, "rank 4 is outside 0..3"),
    ({"rank": -1}, "rank -1 is outside 0..3"),
    ({"timeout": 0.0}, "timeout must be > 0 seconds, got 0.0"),
    ({"timeout": -1.0}, "timeout must be > 0 seconds"),
    ({"connect_timeout": 0}, "connect_timeout must be > 0 seconds"),
    ({"heartbeat_interval": 0}, "heartbeat_interval must be > 0 seconds"),
    ({"heartbeat_interval": float("nan")},
     "heartbeat_interval must be a finite number of seconds, got nan"),
    ({"timeout": float("inf")}, "timeout must be a finite number of seconds, got inf"),
    ({"connect_timeout": float("-inf")},
     "connect_timeout must be a finite number of seconds, got -inf"),
    ({"spin_us": float("inf")}, "spin_us must be a finite number of microseconds, got inf"),
    ({"heartbeat_misses": 2.0}, "heartbeat_misses must be an integer, got 2.0"),
    ({"heartbeat_misses": 0}, "heartbeat_misses must be >= 1, got 0"),
    ({"job_id": ""}, "job_id must not be empty"),
    ({"token": b"0123456789abcdef"}, "token must be a str or None, got bytes"),
])
def test_distributed_config_validation(changes: dict[str, object], message: str) -> None:
    base = DistributedConfig(rank=1, world_size=4)
    with pytest.raises(ConfigError, match=message):
        base.replace(**changes)
    with pytest.raises(ConfigError, match=message):
        DistributedConfig(**{"rank": 1, "world_size": 4, **changes})  # type: ignore[arg-type]


def test_distributed_config_is_frozen_and_slotted() -> None:
    config = DistributedConfig(rank=0, world_size=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.rank = 1  # type: ignore[misc]
    assert not hasattr(config, "__dict__")
    assert config.replace(rank=1) == DistributedConfig(rank=1, world_size=2)
    assert config.rank == 0


def test_wire_limits_defaults() -> None:
    limits = WireLimits()
    assert limits.max_header_bytes == 64 * 1024
    assert limits.max_payload_bytes == 8 * 1024**3
    assert limits.max_ndim == 32
    assert limits.allowed_dtypes is None
    assert DistributedConfig(rank=0, world_size=1).limits == limits


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_header_bytes": 63}, "max_header_bytes must be >= 64, got 63"),
    ({"max_payload_bytes": -1}, "max_payload_bytes must be >= 0, got -1"),
    ({"max_ndim": -1}, "max_ndim must be in 0..64, got -1"),
    ({"max_ndim": 65}, "max_ndim must be in 0..64, got 65"),
])
def test_wire_limits_validation(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        WireLimits(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {"max_header_bytes": 64}, {"max_payload_bytes": 0}, {"max_ndim": 0}, {"max_ndim": 64},
    {"allowed_dtypes": frozenset({"float32"})},
])
def test_wire_limits_edges_are_accepted(kwargs: dict[str, object]) -> None:
    limits = WireLimits(**kwargs)  # type: ignore[arg-type]
    for key, value in kwargs.items():
        assert getattr(limits, key) == value
    with pytest.raises(dataclasses.FrozenInstanceError):
        limits.max_ndim = 3  # type: ignore[misc]


# --------------------------------------------------------------------------- the token


def test_repr_and_str_mask_the_token() -> None:
    """Configs end up in logs and tracebacks: the token never does, every other field does."""
    env = {"NETDIST_RANK": "0", "NETDIST_WORLD_SIZE": "2", "NETDIST_TOKEN": TOKEN}
    for config in (DistributedConfig(rank=0, world_size=2, token=TOKEN),
                   DistributedConfig.from_env(env),
                   DistributedConfig(rank=0, world_size=2).replace(token=TOKEN)):
        for text in (repr(config), str(config), f"{config}", repr([config])):
            assert TOKEN not in text and "0123456789" not in text
            assert "token='***'" in text
        assert repr(config).startswith("DistributedConfig(rank=0, world_size=2, ")
        for item in dataclasses.fields(config):
            if item.name != "token":
                assert f"{item.name}={getattr(config, item.name)!r}" in repr(config)
        assert config.token == TOKEN  # masked in repr only


@pytest.mark.parametrize("token", [None, ""])
def test_repr_without_a_token_says_so(token: str | None) -> None:
    assert f"token={token!r}" in repr(DistributedConfig(rank=0, world_size=1, token=token))


@pytest.mark.parametrize("token", ["Q", "zq!short", "w" * (MIN_TOKEN_LENGTH - 1)])
def test_a_short_token_warns_without_printing_it(token: str) -> None:
    with pytest.warns(WeakTokenWarning) as record:
        DistributedConfig(rank=0, world_size=2, token=token)
    assert len(record) == 1
    message = str(record[0].message)
    assert message.startswith(f"the job token is only {len(token)} characters long "
                              f"(fewer than {MIN_TOKEN_LENGTH})")
    assert "secrets.token_hex(16)" in message and token not in message
    assert record[0].filename == __file__  # points at the caller, not at netdist
    with pytest.warns(WeakTokenWarning, match=f"only {len(token)} characters"):
        DistributedConfig.from_env({"NETDIST_RANK": "0", "NETDIST_WORLD_SIZE": "1",
                                    "NETDIST_TOKEN": token})


@pytest.mark.parametrize("token", [None, "", "s" * MIN_TOKEN_LENGTH, TOKEN])
def test_no_warning_for_a_long_token_or_none(token: str | None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = DistributedConfig(rank=0, world_size=2, token=token)
        config.replace(rank=1)


def test_under_torchrun_the_coordinator_takes_the_port_after_the_store() -> None:
    base = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    assert DistributedConfig.from_env(base).coordinator == ("node0", 29500)
    torchrun = dict(base, TORCHELASTIC_RUN_ID="abc")
    assert DistributedConfig.from_env(torchrun).coordinator == ("node0", 29501)
    mine = dict(torchrun, NETDIST_COORDINATOR="node0:7000")
    assert DistributedConfig.from_env(mine).coordinator == ("node0", 7000)
    with pytest.raises(ConfigError, match="MASTER_PORT=65535 has none"):
        DistributedConfig.from_env(dict(torchrun, MASTER_PORT="65535"))
