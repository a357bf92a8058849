"""Settings are checked once, strictly, with one rule each (issue 26, defects 4 and 5).

- Every timeout, interval and count must be a finite number: ``inf``, ``nan`` or
  ``1e999`` in a ``NETDIST_*`` variable, or as a Python argument, is a ``ConfigError``
  (an infinite timeout would leave a wait unbounded), reported like ``abc``.
- On/off variables accept a fixed set of words (``netdist.config.parse_switch``); a typo
  such as ``NETDIST_SHM=of`` is an error naming the variable, not silently "on".
- ``validate_environment`` / ``netdist.launcher.check_environment`` check every
  ``NETDIST_*`` variable with the code that reads it, so the launcher can refuse a bad
  value before any rank starts (``tests/cli/test_user_errors.py`` runs the CLI).
"""

from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path

import pytest

from netdist.config import (
    CONFIG_VARIABLES,
    NUMBER_SETTINGS,
    SWITCH_OFF,
    SWITCH_ON,
    SWITCH_VARIABLES,
    AdmissionLimits,
    DistributedConfig,
    parse_switch,
    validate_environment,
)
from netdist.errors import ConfigError
from netdist.launcher import check_environment, launch

NON_FINITE = ["inf", "-inf", "+inf", "Infinity", "nan", "NaN", "1e999", "-1e999"]
"""Spellings Python's ``float()`` turns into an infinity or NaN."""

ENV_NUMBERS = [s.variable for s in NUMBER_SETTINGS if s.variable]
"""Every numeric ``NETDIST_*`` variable ``DistributedConfig.from_env`` reads."""

RANK0 = {"NETDIST_RANK": "0", "NETDIST_WORLD_SIZE": "1"}


def test_every_timeout_variable_is_covered() -> None:
    # a new numeric setting must join NUMBER_SETTINGS, or these tests would miss it
    assert set(ENV_NUMBERS) == {"NETDIST_TIMEOUT", "NETDIST_CONNECT_TIMEOUT",
                                "NETDIST_HEARTBEAT_INTERVAL", "NETDIST_HEARTBEAT_MISSES",
                                "NETDIST_SPIN_US"}


# --------------------------------------------------------------------------- defect 4


@pytest.mark.parametrize("variable", ENV_NUMBERS)
@pytest.mark.parametrize("value", NON_FINITE)
def test_non_finite_environment_values_are_refused(variable: str, value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        DistributedConfig.from_env({**RANK0, variable: value})
    message = str(caught.value)
    assert message.startswith(f"{variable}={value!r} is not "), message
    assert "\n" not in message
    with pytest.raises(ConfigError, match=f"^{variable}="):
        validate_environment({variable: value})


@pytest.mark.parametrize("variable", ENV_NUMBERS)
def test_non_finite_reads_like_a_word(variable: str) -> None:
    """``inf`` gets the very message ``abc`` gets, with the value swapped."""
    messages = {}
    for value in ("abc", "inf"):
        with pytest.raises(ConfigError) as caught:
            DistributedConfig.from_env({**RANK0, variable: value})
        messages[value] = str(caught.value)
    assert messages["inf"] == messages["abc"].replace("'abc'", "'inf'")


@pytest.mark.parametrize(("variable", "message"), [
    ("NETDIST_TIMEOUT",
     "NETDIST_TIMEOUT='inf' is not a number of seconds (expected a finite number > 0)"),
    ("NETDIST_CONNECT_TIMEOUT",
     "NETDIST_CONNECT_TIMEOUT='inf' is not a number of seconds (expected a finite number > 0)"),
    ("NETDIST_HEARTBEAT_INTERVAL",
     "NETDIST_HEARTBEAT_INTERVAL='inf' is not a number of seconds (expected a finite number "
     "> 0)"),
    ("NETDIST_SPIN_US",
     "NETDIST_SPIN_US='inf' is not a number of microseconds (expected a finite number in "
     "0..1000000)"),
    ("NETDIST_HEARTBEAT_MISSES", "NETDIST_HEARTBEAT_MISSES='inf' is not an integer >= 1"),
])
def test_the_message_names_variable_value_and_rule(variable: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        validate_environment({variable: "inf"})
    assert str(caught.value) == message


@pytest.mark.parametrize(("variable", "value"), [
    ("NETDIST_TIMEOUT", "0"), ("NETDIST_TIMEOUT", "-5"), ("NETDIST_CONNECT_TIMEOUT", "0"),
    ("NETDIST_HEARTBEAT_INTERVAL", "-0.5"), ("NETDIST_SPIN_US", "-1"),
    ("NETDIST_SPIN_US", "1000001"), ("NETDIST_HEARTBEAT_MISSES", "0"),
    ("NETDIST_HEARTBEAT_MISSES", "2.5"),
])
def test_out_of_range_environment_values_name_the_variable(variable: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"^{variable}={value!r} is not "):
        DistributedConfig.from_env({**RANK0, variable: value})


@pytest.mark.parametrize(("variable", "value", "field", "expected"), [
    ("NETDIST_TIMEOUT", " 2.5 ", "timeout", 2.5),
    ("NETDIST_CONNECT_TIMEOUT", "1e3", "connect_timeout", 1000.0),
    ("NETDIST_HEARTBEAT_INTERVAL", "0.25", "heartbeat_interval", 0.25),
    ("NETDIST_SPIN_US", "0", "spin_us", 0.0),
    ("NETDIST_SPIN_US", "1000000", "spin_us", 1e6),
    ("NETDIST_HEARTBEAT_MISSES", "3", "heartbeat_misses", 3),
])
def test_finite_values_in_range_are_read(variable: str, value: str, field: str,
                                         expected: float) -> None:
    config = DistributedConfig.from_env({**RANK0, variable: value})
    assert getattr(config, field) == expected
    validate_environment({variable: value})


@pytest.mark.parametrize("field", [s.field for s in NUMBER_SETTINGS])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_arguments_are_refused(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"^{field} must be "):
        DistributedConfig(rank=0, world_size=1, **{field: value})
    with pytest.raises(ConfigError, match=f"^{field} must be "):
        DistributedConfig(rank=0, world_size=1).replace(**{field: value})
    with pytest.raises(ConfigError, match=f"^{field} must be "):
        DistributedConfig.from_env(RANK0, **{field: value})


def test_argument_messages() -> None:
    with pytest.raises(ConfigError) as caught:
        DistributedConfig(rank=0, world_size=1, timeout=math.inf)
    assert str(caught.value) == "timeout must be a finite number of seconds, got inf"
    with pytest.raises(ConfigError) as caught:
        DistributedConfig(rank=0, world_size=1, heartbeat_misses=math.inf)  # type: ignore[arg-type]
    assert str(caught.value) == "heartbeat_misses must be an integer, got inf"
    with pytest.raises(ConfigError) as caught:
        DistributedConfig(rank=0, world_size=1, timeout="5")  # type: ignore[arg-type]
    assert str(caught.value) == "timeout must be a finite number of seconds, got '5'"


@pytest.mark.parametrize("field", ["handshake_timeout", "refusal_log_interval"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_admission_durations_are_refused(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"^{field} must be a finite number of seconds"):
        AdmissionLimits(**{field: value})


# --------------------------------------------------------------------------- defect 5a


@pytest.mark.parametrize("word", [*SWITCH_ON, "TRUE", " On ", "Yes"])
def test_switch_on_words(word: str) -> None:
    assert parse_switch({"NETDIST_X": word}, "NETDIST_X", False) is True


@pytest.mark.parametrize("word", [*SWITCH_OFF, "FALSE", " Off ", "No"])
def test_switch_off_words(word: str) -> None:
    assert parse_switch({"NETDIST_X": word}, "NETDIST_X", True) is False


@pytest.mark.parametrize("default", [True, False])
def test_switch_unset_or_empty_is_the_default(default: bool) -> None:
    assert parse_switch({}, "NETDIST_X", default) is default
    assert parse_switch({"NETDIST_X": "  "}, "NETDIST_X", default) is default


@pytest.mark.parametrize("variable", SWITCH_VARIABLES)
@pytest.mark.parametrize("value", ["of", "2", "enable", "disabled", "y"])
def test_a_word_that_is_no_switch_is_refused(variable: str, value: str) -> None:
    expected = (f"{variable}={value!r} is neither on (1, true, yes, on) nor off "
                "(0, false, no, off)")
    with pytest.raises(ConfigError) as caught:
        parse_switch({variable: value}, variable, True)
    assert str(caught.value) == expected
    with pytest.raises(ConfigError) as caught:
        validate_environment({variable: value})
    assert str(caught.value) == expected


def test_netdist_shm_typo_is_not_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from netdist.collectives.host.settings import shared_memory_enabled

    monkeypatch.setenv("NETDIST_SHM", "of")
    with pytest.raises(ConfigError, match=r"^NETDIST_SHM='of' is neither on"):
        shared_memory_enabled(None)
    assert shared_memory_enabled(False) is False  # an explicit argument wins
    monkeypatch.setenv("NETDIST_SHM", "off")
    assert shared_memory_enabled(None) is False
    monkeypatch.setenv("NETDIST_SHM", "on")
    assert shared_memory_enabled(None) is True


@pytest.mark.parametrize(("value", "expected"), [("on", True), ("TRUE", True), ("1", True),
                                                 ("off", False), ("", False)])
def test_netdist_insecure_is_a_switch(value: str, expected: bool) -> None:
    assert DistributedConfig.from_env({**RANK0, "NETDIST_INSECURE": value}).insecure is expected


def test_netdist_insecure_typo_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^NETDIST_INSECURE='ture' is neither on"):
        DistributedConfig.from_env({**RANK0, "NETDIST_INSECURE": "ture"})


# --------------------------------------------------------------------------- defect 5b

BAD_VALUES = {
    "NETDIST_TIMEOUT": "inf",
    "NETDIST_CONNECT_TIMEOUT": "soon",
    "NETDIST_HEARTBEAT_INTERVAL": "nan",
    "NETDIST_HEARTBEAT_MISSES": "many",
    "NETDIST_SPIN_US": "1e999",
    "NETDIST_INSECURE": "maybe",
    "NETDIST_SHM": "of",
    "NETDIST_DEBUG": "verbose",
    "NETDIST_CONNECT": "later",
    "NETDIST_EVENT_LOOP": "trio",
    "NETDIST_SHM_COPY": "twice",
    "NETDIST_PS_SERVERS": "0",
    "NETDIST_PS_MAX_STALENESS": "-1",
}
"""One bad value for every ``NETDIST_*`` variable netdist reads that has a rule."""


@pytest.mark.parametrize("variable", sorted(BAD_VALUES))
def test_check_environment_refuses_every_bad_setting(variable: str) -> None:
    with pytest.raises(ConfigError, match=variable):
        check_environment({variable: BAD_VALUES[variable]})


def test_validate_environment_covers_the_config_variables() -> None:
    with_rules = CONFIG_VARIABLES - {"NETDIST_JOB_ID", "NETDIST_TOKEN", "NETDIST_HOST_ID",
                                     "NETDIST_ADVERTISE_ADDR", "NETDIST_LISTEN_HOST"}
    assert with_rules <= set(BAD_VALUES)
    for variable in with_rules:
        with pytest.raises(ConfigError, match=variable):
            validate_environment({variable: BAD_VALUES[variable]})


def test_good_values_and_launcher_variables_pass() -> None:
    check_environment({})
    check_environment({
        "NETDIST_TIMEOUT": "30", "NETDIST_SHM": "0", "NETDIST_SHM_COPY": "staged",
        "NETDIST_EVENT_LOOP": "asyncio", "NETDIST_CONNECT": "eager", "NETDIST_DEBUG": "1",
        "NETDIST_PS_SERVERS": "2", "NETDIST_PS_MAX_STALENESS": "none",
        "NETDIST_TOKEN": "", "NETDIST_HOST_ID": "anything at all",
        # set by the launcher for each rank: not the user's to get right
        "NETDIST_RANK": "x", "NETDIST_WORLD_SIZE": "", "NETDIST_COORDINATOR": "::",
        "NETDIST_RESTART_COUNT": "?",
        "PATH": "/bin", "TIMEOUT": "inf",  # not netdist's
    })


def test_unknown_netdist_variables_are_logged_not_refused(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="netdist.launcher"):
        check_environment({"NETDIST_WORKERS": "4", "NETDIST_TIMEOUT": "5"})
    assert [r.getMessage() for r in caplog.records] == [
        "environment variables netdist does not read: NETDIST_WORKERS"]


def test_launch_refuses_a_bad_value_before_starting_a_rank(tmp_path: Path) -> None:
    marker = tmp_path / "started"
    cmd = [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"]
    with pytest.raises(ConfigError, match=r"^NETDIST_TIMEOUT='inf' is not a number"):
        launch(cmd, 2, env={"NETDIST_TIMEOUT": "inf"})
    assert not marker.exists()
    assert os.environ.get("NETDIST_TIMEOUT") != "inf"  # nothing leaked into this process
