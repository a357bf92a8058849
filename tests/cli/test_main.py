"""The ``netdist`` entry point: subcommand registry, error reporting and exit codes."""

from __future__ import annotations

import argparse
import subprocess
import sys
import types
from pathlib import Path

import pytest

import netdist
from netdist.cli import main as cli_main
from netdist.errors import (
    CheckpointNotFoundError,
    ConfigError,
    PeerLostError,
    TransportClosedError,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_command(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """Register ``netdist.cli._fake`` as subcommand ``fake`` whose run() does ``behaviour``."""
    state = types.SimpleNamespace(behaviour=lambda args: 0, seen=None)
    module = types.ModuleType("netdist.cli._fake")

    def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
        parser = subparsers.add_parser("fake-cmd", help="a test command")
        parser.add_argument("--value", type=int, default=1)

    def run(args: argparse.Namespace) -> int:
        state.seen = args
        return state.behaviour(args)

    module.add_parser = add_parser  # type: ignore[attr-defined]
    module.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "netdist.cli._fake", module)
    monkeypatch.setattr(cli_main, "COMMANDS", cli_main.COMMANDS + ("_fake",))
    monkeypatch.delenv("NETDIST_DEBUG", raising=False)
    return state


def test_commands_registry_starts_with_launch() -> None:
    assert cli_main.COMMANDS[0] == "launch"
    parser = cli_main.build_parser()
    text = parser.format_help()
    assert "launch" in text


def test_dispatch_to_module_with_its_own_subcommand_name(fake_command: types.SimpleNamespace) -> None:
    fake_command.behaviour = lambda args: args.value + 3
    assert cli_main.main(["fake-cmd", "--value", "4"]) == 7
    assert fake_command.seen.value == 4


def test_run_returning_none_means_success(fake_command: types.SimpleNamespace) -> None:
    fake_command.behaviour = lambda args: None
    assert cli_main.main(["fake-cmd"]) == 0


def _raiser(exc: BaseException):
    def behaviour(args: argparse.Namespace) -> int:
        raise exc
    return behaviour


def test_config_error_exits_2_with_message_and_no_traceback(
        fake_command: types.SimpleNamespace, capsys: pytest.CaptureFixture[str]) -> None:
    fake_command.behaviour = _raiser(ConfigError("NETDIST_RANK='x' is not an integer"))
    assert cli_main.main(["fake-cmd"]) == 2
    err = capsys.readouterr().err
    assert err == "netdist fake-cmd: error: NETDIST_RANK='x' is not an integer\n"


def test_runtime_error_exits_1(fake_command: types.SimpleNamespace,
                               capsys: pytest.CaptureFixture[str]) -> None:
    fake_command.behaviour = _raiser(CheckpointNotFoundError("no checkpoint in ckpt"))
    assert cli_main.main(["fake-cmd"]) == 1
    assert capsys.readouterr().err == "netdist fake-cmd: error: no checkpoint in ckpt\n"


@pytest.mark.parametrize("exc", [PeerLostError(3), TransportClosedError("lost connection to rank 3")])
def test_lost_peer_is_one_line_named_by_type(exc: Exception, fake_command: types.SimpleNamespace,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    # A consequence of another rank's failure: one line (no chained traceback) whose type
    # lets `netdist launch`'s summary mark it as a consequence.
    fake_command.behaviour = _raiser(exc)
    assert cli_main.main(["fake-cmd"]) == 1
    assert capsys.readouterr().err == (
        f"netdist fake-cmd: error: {type(exc).__name__}: lost connection to rank 3\n")


def test_netdist_debug_adds_the_traceback(fake_command: types.SimpleNamespace,
                                          capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NETDIST_DEBUG", "1")
    fake_command.behaviour = _raiser(PeerLostError(3))
    assert cli_main.main(["fake-cmd"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert "netdist.errors.PeerLostError: lost connection to rank 3" in err
    assert err.endswith("netdist fake-cmd: error: PeerLostError: lost connection to rank 3\n")


def test_keyboard_interrupt_exits_130(fake_command: types.SimpleNamespace) -> None:
    fake_command.behaviour = _raiser(KeyboardInterrupt())
    assert cli_main.main(["fake-cmd"]) == 130


def test_unexpected_exceptions_propagate(fake_command: types.SimpleNamespace) -> None:
    fake_command.behaviour = _raiser(RuntimeError("a bug"))
    with pytest.raises(RuntimeError, match="a bug"):
        cli_main.main(["fake-cmd"])


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main.main(["--version"]) == 0
    assert capsys.readouterr().out == f"netdist {netdist.__version__}\n"


@pytest.mark.parametrize("argv", [[], ["no-such-command"], ["launch", "--bogus"]])
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main.main(argv) == 2
    assert capsys.readouterr().err.startswith("usage: netdist")


def test_module_entry_point_version() -> None:
    result = subprocess.run([sys.executable, "-m", "netdist.cli.main", "--version"],
                            capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert result.returncode == 0
    assert result.stdout == f"netdist {netdist.__version__}\n"
