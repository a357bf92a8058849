"""User mistakes end in one line and exit code 2, not a traceback; help texts agree.

Every command runs as a real ``netdist`` process (``python -m netdist.cli.main``), bounded
by a subprocess timeout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from netdist.ps.roles import DEFAULT_PS_SERVERS, default_num_servers, num_servers_from_env

REPO_ROOT = Path(__file__).resolve().parents[2]
BOUND = 120.0


def netdist(*args: str, env: dict[str, str] | None = None,
            timeout: float = BOUND) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ)
    for key in ("NETDIST_TOKEN", "NETDIST_JOB_ID", "NETDIST_PS_SERVERS", "NETDIST_RANK",
                "NETDIST_WORLD_SIZE", "NETDIST_COORDINATOR"):
        full_env.pop(key, None)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "netdist.cli.main", *args],
                          capture_output=True, text=True, timeout=timeout, env=full_env,
                          cwd=REPO_ROOT)


def one_line_usage_error(result: subprocess.CompletedProcess[str], line: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr == line + "\n"


# --------------------------------------------------------------------------- item 6


@pytest.mark.parametrize(("target", "reason"), [
    ("/proc/nope", "cannot create /proc/nope: No such file or directory"),
    ("/proc", "cannot write to /proc: No such file or directory"),
    ("{file}", "{file} exists and is not a directory"),
    ("{file}/sub", "cannot create {file}/sub: Not a directory"),
])
def test_demo_checks_the_checkpoint_dir_before_starting_any_rank(
        tmp_path: Path, target: str, reason: str) -> None:
    file = tmp_path / "a-file"
    file.write_text("not a directory")
    target, reason = target.format(file=file), reason.format(file=file)
    result = netdist("demo", "-n", "2", "--epochs", "1", "--checkpoint-dir", target)
    one_line_usage_error(result, f"netdist demo: error: --checkpoint-dir: {reason}")
    assert result.stdout == ""  # no rank was started


def test_demo_creates_a_missing_checkpoint_dir_and_leaves_no_probe(tmp_path: Path) -> None:
    from netdist.train.digits_job import checkpoint_dir_problem

    target = tmp_path / "new" / "ckpt"
    assert checkpoint_dir_problem(target, tag="-x") is None
    assert target.is_dir() and list(target.iterdir()) == []


def test_worker_checks_the_checkpoint_dir_before_the_first_step() -> None:
    env = {"NETDIST_RANK": "0", "NETDIST_WORLD_SIZE": "1",
           "NETDIST_COORDINATOR": "127.0.0.1:0"}
    result = netdist("worker", "--epochs", "1", "--checkpoint-dir", "/proc/nope", env=env)
    one_line_usage_error(result, "netdist worker: error: checkpoint directory unusable on "
                                 "rank 0: cannot create /proc/nope: No such file or directory")
    assert "epoch" not in result.stdout


# --------------------------------------------------------------------------- item 15


@pytest.mark.slow
def test_resume_with_another_hidden_names_parameters_and_shapes(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    first = netdist("demo", "-n", "1", "--epochs", "1", "--batch-size", "256",
                    "--checkpoint-dir", str(ckpt), "--job-timeout", "100")
    assert first.returncode == 0, first.stderr
    result = netdist("demo", "-n", "2", "--epochs", "2", "--batch-size", "256",
                     "--checkpoint-dir", str(ckpt), "--resume", "--hidden", "128,32",
                     "--job-timeout", "100")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    expected = (
        f"netdist worker: error: cannot resume from {ckpt} (step 6): the checkpoint holds "
        "another model: 2.weight is (64, 128) in the checkpoint but (32, 128) in this model; "
        "2.bias is (64,) in the checkpoint but (32,) in this model; 4.weight is (10, 64) in "
        "the checkpoint but (10, 32) in this model (written with --hidden 128,64, this run "
        "has --hidden 128,32; resume with the same --hidden or use another --checkpoint-dir)")
    rank_lines = [line for line in result.stderr.splitlines()
                  if re.match(r"^\[rank \d\] netdist worker: ", line)]
    assert rank_lines, result.stderr
    assert {re.sub(r"^\[rank \d\] ", "", line) for line in rank_lines} == {expected}
    assert "state dict mismatch" not in result.stderr


def test_bench_help_says_bfloat16_needs_no_extra() -> None:
    result = netdist("bench", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "bfloat16 works without ml_dtypes" in text


# --------------------------------------------------------------------------- item 19

DEFAULT_TEXT = "default 2, or fewer in a job too small to keep a worker"


def test_ps_servers_default_is_one_rule() -> None:
    assert DEFAULT_PS_SERVERS == 2
    # dedicated servers keep one rank to work; co-located ones train themselves
    assert [default_num_servers(n) for n in (1, 2, 3, 8)] == [1, 1, 2, 2]
    assert [default_num_servers(n, colocated=True) for n in (1, 2, 3, 8)] == [1, 2, 2, 2]
    assert num_servers_from_env({}) == 2
    assert num_servers_from_env({}, world_size=2) == 1
    assert num_servers_from_env({}, world_size=1, colocated=True) == 1
    assert num_servers_from_env({"NETDIST_PS_SERVERS": "3"}, world_size=2) == 3


def test_help_texts_and_readme_state_the_same_default() -> None:
    # the docs pages that took over the README's text: netdist ps-server's default
    # (aggregation.md) and the demo's ps-sharded / ps-async flags (getting-started.md)
    texts = {
        "worker --help": netdist("worker", "--help").stdout,
        "ps-server --help": netdist("ps-server", "--help").stdout,
        "docs/aggregation.md": (REPO_ROOT / "docs" / "aggregation.md").read_text(),
        "docs/getting-started.md": (REPO_ROOT / "docs" / "getting-started.md").read_text(),
    }
    for where, text in texts.items():
        assert DEFAULT_TEXT in " ".join(text.split()), where
        assert "min(2, N)" not in text, where
    for page in (REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))):
        assert "min(2, N)" not in page.read_text(), page.name


def test_ps_server_help_is_plain_text() -> None:
    result = netdist("ps-server", "--help")
    assert result.returncode == 0
    assert "``" not in result.stdout
    assert not [line for line in result.stdout.splitlines() if line.rstrip().endswith("::")]
    assert "Run the dedicated parameter-server ranks of a job." in result.stdout


@pytest.mark.parametrize(("world", "servers"), [("3", "0..1"), ("2", "0..0")])
def test_ps_server_uses_the_default(world: str, servers: str) -> None:
    # The last rank is a worker either way; without a command it says which ranks serve.
    rank = str(int(world) - 1)
    env = {"NETDIST_RANK": rank, "NETDIST_WORLD_SIZE": world,
           "NETDIST_COORDINATOR": "127.0.0.1:1"}
    result = netdist("ps-server", env=env)
    one_line_usage_error(result, f"netdist ps-server: error: rank {rank} is a worker rank "
                                 f"(servers are ranks {servers}); give the worker command "
                                 "after '--', or start workers separately")


# --------------------------------------------------------------------------- issue 26, 4-5

BAD_SETTINGS = [
    ("NETDIST_TIMEOUT", "inf",
     "NETDIST_TIMEOUT='inf' is not a number of seconds (expected a finite number > 0)"),
    ("NETDIST_HEARTBEAT_INTERVAL", "nan", "NETDIST_HEARTBEAT_INTERVAL='nan' is not a number "
                                          "of seconds (expected a finite number > 0)"),
    ("NETDIST_SHM", "of", "NETDIST_SHM='of' is neither on (1, true, yes, on) nor off "
                          "(0, false, no, off)"),
]


@pytest.mark.parametrize(("variable", "value", "message"), BAD_SETTINGS)
def test_launch_checks_netdist_variables_before_starting_any_rank(
        tmp_path: Path, variable: str, value: str, message: str) -> None:
    marker = tmp_path / "rank-started"
    script = ("import os, sys; open(sys.argv[1] + '-' + os.environ['NETDIST_RANK'], 'w')"
              ".close()")
    result = netdist("launch", "-n", "2", "--", sys.executable, "-c", script, str(marker),
                     env={variable: value})
    one_line_usage_error(result, f"netdist launch: error: {message}")
    assert result.stdout == ""
    assert list(tmp_path.iterdir()) == []  # no rank was started


def test_launch_starts_ranks_when_the_variables_are_good(tmp_path: Path) -> None:
    # the counterpart of the test above: the same command does start its ranks
    marker = tmp_path / "rank-started"
    script = ("import os, sys; open(sys.argv[1] + '-' + os.environ['NETDIST_RANK'], 'w')"
              ".close()")
    result = netdist("launch", "-n", "2", "--", sys.executable, "-c", script, str(marker),
                     env={"NETDIST_TIMEOUT": "30", "NETDIST_SHM": "off"})
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-started-0", "rank-started-1"]


@pytest.mark.parametrize(("variable", "value", "message"), BAD_SETTINGS)
def test_worker_reports_a_bad_variable_in_one_line(variable: str, value: str,
                                                   message: str) -> None:
    env = {"NETDIST_RANK": "0", "NETDIST_WORLD_SIZE": "1",
           "NETDIST_COORDINATOR": "127.0.0.1:0", variable: value}
    result = netdist("worker", "--epochs", "1", env=env)
    one_line_usage_error(result, f"netdist worker: error: {message}")
    assert result.stdout == ""  # refused before joining the job


def test_demo_checks_netdist_variables_before_starting_any_rank() -> None:
    result = netdist("demo", "-n", "2", "--epochs", "1", env={"NETDIST_TIMEOUT": "1e999"})
    one_line_usage_error(result, "netdist demo: error: NETDIST_TIMEOUT='1e999' is not a "
                                 "number of seconds (expected a finite number > 0)")
    assert result.stdout == ""  # no rank was started


def test_a_bad_netdist_debug_is_one_line_too() -> None:
    result = netdist("worker", "--epochs", "1", env={"NETDIST_DEBUG": "maybe"})
    one_line_usage_error(result, "netdist worker: error: NETDIST_DEBUG='maybe' is neither on "
                                 "(1, true, yes, on) nor off (0, false, no, off)")


@pytest.mark.parametrize("value", ["inf", "1e999", "nan"])
@pytest.mark.parametrize("command", ["demo", "ps-server"])
def test_a_timeout_flag_must_be_finite(command: str, value: str) -> None:
    args = ["demo", "-n", "2", "--epochs", "1"] if command == "demo" else ["ps-server"]
    result = netdist(*args, "--timeout", value,
                     env={"NETDIST_RANK": "0", "NETDIST_WORLD_SIZE": "2"})
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    shown = "nan" if value == "nan" else "inf"  # what float() made of it
    assert "finite number of seconds > 0, got " + shown in result.stderr, result.stderr
    assert result.stdout == ""  # nothing was started
