"""``netdist launch`` / ``netdist.launcher.launch`` with real child processes.

Children are ``sys.executable -c SCRIPT TMPDIR``. Where a test needs ranks to be set up
before something happens (a rank fails only once its siblings are running, a signal is
sent once every rank is up), ranks synchronise through a FIFO, never by sleeping.
Every launcher run is bounded by a subprocess timeout well above what it should take,
and the tests assert the time it did take.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from netdist.errors import ConfigError
from netdist.launcher import launch

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
BOUND = 60.0  # hard subprocess timeout for one launcher run
FAST = 20.0  # what a run that terminates ranks must stay well under

PRELUDE = r'''
import json, os, signal, subprocess, sys, time
RANK = int(os.environ["NETDIST_RANK"])
WORLD = int(os.environ["NETDIST_WORLD_SIZE"])
ATTEMPT = int(os.environ["NETDIST_RESTART_COUNT"])
TMP = sys.argv[1]
FIFO = os.path.join(TMP, "fifo")

def write_pid(name, pid):
    path = os.path.join(TMP, name)
    with open(path + ".tmp", "w") as f:
        f.write(str(pid))
    os.replace(path + ".tmp", path)

def signal_ready():
    """Tell the rank blocked in wait_for_ranks() that this rank is set up."""
    with open(FIFO, "w") as f:
        f.write(f"{RANK}\n")

def wait_for_ranks(count):
    """Block until `count` ranks called signal_ready() (O_RDWR: never a spurious EOF)."""
    with os.fdopen(os.open(FIFO, os.O_RDWR), "r") as f:
        for _ in range(count):
            f.readline()

def sleep_forever():
    while True:
        time.sleep(3600)
'''


def netdist_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "netdist.cli.main", *args]


def child(body: str, tmp_path: Path) -> list[str]:
    """The command every rank runs: the prelude plus ``body``."""
    return [sys.executable, "-c", PRELUDE + body, str(tmp_path)]


def run_launch(tmp_path: Path, launch_args: list[str], body: str,
               env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``netdist launch ARGS -- child(body)``; return the result and the elapsed time."""
    full_env = dict(os.environ)
    full_env.pop("NETDIST_TOKEN", None)
    full_env.pop("NETDIST_JOB_ID", None)
    full_env.update(env or {})
    if not (tmp_path / "fifo").exists():
        os.mkfifo(tmp_path / "fifo")
    start = time.monotonic()
    result = subprocess.run(netdist_cmd("launch", *launch_args, "--", *child(body, tmp_path)),
                            capture_output=True, text=True, timeout=BOUND, env=full_env,
                            cwd=REPO_ROOT)
    return result, time.monotonic() - start


LINE = re.compile(r"^\[rank (\d+)\] (.*)$")


def by_rank(output: str) -> dict[int, list[str]]:
    """Split prefixed output into each rank's lines; every line must carry a prefix."""
    lines: dict[int, list[str]] = {}
    for line in output.splitlines():
        match = LINE.match(line)
        assert match is not None, f"unprefixed line: {line!r}"
        lines.setdefault(int(match.group(1)), []).append(match.group(2))
    return lines


def assert_dead(pid: int) -> None:
    """``pid`` (a direct child of the launcher, so reaped by it) no longer exists."""
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def wait_dead(pid: int, timeout: float = 10.0) -> None:
    """Wait, bounded, until ``pid`` is gone or a zombie (a grandchild reaped by init)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (ProcessLookupError, FileNotFoundError):
            return
        if state == "Z":
            return
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"process {pid} still alive (state {state}) {timeout} s later")
        time.sleep(0.01)


def read_pids(tmp_path: Path, prefix: str) -> dict[str, int]:
    return {p.name: int(p.read_text()) for p in tmp_path.glob(prefix + "*")
            if not p.name.endswith(".tmp")}


# --------------------------------------------------------------------------- environment


ENV_KEYS = ("NETDIST_RANK", "NETDIST_WORLD_SIZE", "NETDIST_COORDINATOR", "NETDIST_JOB_ID",
            "NETDIST_TOKEN", "NETDIST_RESTART_COUNT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
            "LOCAL_WORLD_SIZE")

PRINT_ENV = f"print(json.dumps({{k: os.environ.get(k) for k in {ENV_KEYS!r}}}))\n"


def test_each_rank_gets_its_environment(tmp_path: Path) -> None:
    result, _ = run_launch(tmp_path, ["-n", "3"], PRINT_ENV, env={"RANK": "7", "NETDIST_RANK": "9"})
    assert result.returncode == 0, result.stderr
    lines = by_rank(result.stdout)
    assert sorted(lines) == [0, 1, 2]
    envs = {rank: json.loads(out[0]) for rank, out in lines.items()}
    for rank, env in envs.items():
        assert env["NETDIST_RANK"] == env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["NETDIST_WORLD_SIZE"] == env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3"
        assert env["NETDIST_RESTART_COUNT"] == "0"
    coordinators = {env["NETDIST_COORDINATOR"] for env in envs.values()}
    job_ids = {env["NETDIST_JOB_ID"] for env in envs.values()}
    tokens = {env["NETDIST_TOKEN"] for env in envs.values()}
    assert len(coordinators) == len(job_ids) == len(tokens) == 1
    host, port = coordinators.pop().rsplit(":", 1)
    assert host == "127.0.0.1" and 1 <= int(port) <= 65535
    assert job_ids.pop()
    token = tokens.pop()
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    assert token not in result.stderr


def test_given_coordinator_job_id_and_token_are_passed_through(tmp_path: Path) -> None:
    # Nothing listens on this address: the launcher only hands it to the ranks.
    result, _ = run_launch(tmp_path, ["-n", "2", "--coordinator", "[::1]:29999",
                                      "--job-id", "exp-42"],
                           PRINT_ENV, env={"NETDIST_TOKEN": "s3cret"})
    assert result.returncode == 0, result.stderr
    envs = [json.loads(out[0]) for out in by_rank(result.stdout).values()]
    assert len(envs) == 2
    for env in envs:
        assert env["NETDIST_COORDINATOR"] == "[::1]:29999"
        assert env["NETDIST_JOB_ID"] == "exp-42"
        assert env["NETDIST_TOKEN"] == "s3cret"
    assert "s3cret" not in result.stderr


def test_library_launch_reads_job_id_from_env_and_merges_env(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NETDIST_JOB_ID", "from-environment")
    monkeypatch.delenv("NETDIST_TOKEN", raising=False)
    os.mkfifo(tmp_path / "fifo")
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    body = "print(os.environ['NETDIST_JOB_ID'], os.environ['EXTRA'], os.environ['NETDIST_TOKEN'])\n"
    status = launch(child(body, tmp_path), 2, env={"EXTRA": "x1", "NETDIST_TOKEN": "tok"})
    out = capfd.readouterr().out
    assert status == 0
    assert sorted(out.splitlines()) == ["[rank 0] from-environment x1 tok",
                                        "[rank 1] from-environment x1 tok"]
    # The launcher restored the handlers it replaced.
    assert {signum: signal.getsignal(signum) for signum in handlers} == handlers


def test_library_launch_from_a_worker_thread(tmp_path: Path,
                                             capfd: pytest.CaptureFixture[str]) -> None:
    # Signal handlers can only be installed in the main thread; launch() must still work.
    os.mkfifo(tmp_path / "fifo")
    statuses: list[int] = []
    thread = threading.Thread(target=lambda: statuses.append(
        launch(child("print('from thread'); sys.exit(RANK * 6)\n", tmp_path), 2)))
    thread.start()
    thread.join(timeout=BOUND)
    assert not thread.is_alive()
    assert statuses == [6]
    captured = capfd.readouterr()
    assert "[rank 1] from thread" in captured.out.splitlines()
    assert "netdist launch: rank 1 exited with code 6" in captured.err


def test_library_launch_without_prefix_inherits_output(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    os.mkfifo(tmp_path / "fifo")
    # One write(2) per line: unprefixed ranks share the terminal, so only whole writes
    # stay whole (print() under PYTHONUNBUFFERED writes each piece separately).
    body = "os.write(1, f'plain {RANK}\\n'.encode())\n"
    status = launch(child(body, tmp_path), 2, prefix_output=False)
    assert status == 0
    assert sorted(capfd.readouterr().out.splitlines()) == ["plain 0", "plain 1"]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"cmd": [], "nprocs": 1}, "non-empty list"),
    ({"cmd": ["true", 3], "nprocs": 1}, "non-empty list"),
    ({"cmd": ["true"], "nprocs": 0}, ">= 1, got 0"),
    ({"cmd": ["true"], "nprocs": True}, "integer >= 1"),
    ({"cmd": ["true"], "nprocs": 1, "max_restarts": -1}, "max_restarts"),
    ({"cmd": ["true"], "nprocs": 1, "timeout": 0}, "timeout"),
    ({"cmd": ["true"], "nprocs": 1, "timeout": float("nan")}, "timeout"),
    ({"cmd": ["true"], "nprocs": 1, "grace_period": -1.0}, "grace_period"),
    ({"cmd": ["true"], "nprocs": 1, "job_id": ""}, "job_id"),
    ({"cmd": ["true"], "nprocs": 1, "coordinator": "host:port"}, "not a number"),
    ({"cmd": ["true"], "nprocs": 1, "coordinator": "host:70000"}, "out of range"),
])
def test_launch_rejects_invalid_arguments(kwargs: dict, message: str) -> None:
    cmd = kwargs.pop("cmd")
    nprocs = kwargs.pop("nprocs")
    with pytest.raises(ConfigError, match=message):
        launch(cmd, nprocs, **kwargs)


# --------------------------------------------------------------------------- output


def test_output_is_prefixed_complete_and_not_interleaved(tmp_path: Path) -> None:
    # 20000 lines per stream per rank is several pipe buffers full: a launcher that does
    # not drain every pipe continuously deadlocks here.
    body = (
        "for i in range(20000):\n"
        "    print(f'out {RANK} {i} ' + 'x' * 40)\n"
        "    print(f'err {RANK} {i}', file=sys.stderr)\n"
        "print('long ' + 'y' * 10000)\n"
        "sys.stdout.write('no newline at the end')\n"
    )
    result, _ = run_launch(tmp_path, ["-n", "3"], body)
    assert result.returncode == 0, result.stderr[-2000:]
    out, err = by_rank(result.stdout), by_rank(result.stderr)
    for rank in range(3):
        expected = [f"out {rank} {i} " + "x" * 40 for i in range(20000)]
        assert out[rank] == expected + ["long " + "y" * 10000, "no newline at the end"]
        assert err[rank] == [f"err {rank} {i}" for i in range(20000)]


# --------------------------------------------------------------------------- failures


def test_failing_rank_exit_code_propagates_and_siblings_are_terminated(tmp_path: Path) -> None:
    body = (
        "if RANK == 2:\n"
        "    wait_for_ranks(WORLD - 1)\n"
        "    print('failing now', flush=True)\n"
        "    sys.exit(3)\n"
        "write_pid(f'pid-{RANK}', os.getpid())\n"
        "signal_ready()\n"
        "sleep_forever()\n"
    )
    result, elapsed = run_launch(tmp_path, ["-n", "4"], body)
    assert result.returncode == 3
    assert ("netdist launch: rank 2 exited with code 3; terminated ranks 0, 1, 3"
            in result.stderr.splitlines())
    assert by_rank(result.stdout) == {2: ["failing now"]}
    assert elapsed < FAST
    pids = read_pids(tmp_path, "pid-")
    assert sorted(pids) == ["pid-0", "pid-1", "pid-3"]
    for pid in pids.values():
        assert_dead(pid)


def test_rank_killed_by_signal_gives_128_plus_signal(tmp_path: Path) -> None:
    body = (
        "if RANK == 1:\n"
        "    wait_for_ranks(1)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "signal_ready()\n"
        "sleep_forever()\n"
    )
    result, elapsed = run_launch(tmp_path, ["-n", "2"], body)
    assert result.returncode == 128 + signal.SIGKILL
    assert ("netdist launch: rank 1 was killed by signal 9 (SIGKILL); terminated rank 0"
            in result.stderr.splitlines())
    assert elapsed < FAST


def test_rank_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    body = (
        "if RANK == 1:\n"
        "    wait_for_ranks(1)\n"
        "    sys.exit(1)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "write_pid('pid-stubborn', os.getpid())\n"
        "signal_ready()\n"
        "sleep_forever()\n"
    )
    result, elapsed = run_launch(tmp_path, ["-n", "2", "--grace-period", "0.5"], body)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert "netdist launch: rank 1 exited with code 1; terminated rank 0" in lines
    assert "netdist launch: rank 0 still running 0.5 s after SIGTERM; sent SIGKILL" in lines
    assert 0.5 <= elapsed < FAST
    assert_dead(read_pids(tmp_path, "pid-stubborn")["pid-stubborn"])


def test_command_that_cannot_start(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-program")
    result = subprocess.run(netdist_cmd("launch", "-n", "2", "--", missing), capture_output=True,
                            text=True, timeout=BOUND, cwd=REPO_ROOT)
    assert result.returncode == 127
    assert f"netdist launch: cannot start rank 0: [Errno 2] No such file or directory: {missing!r}" \
        in result.stderr.splitlines()


def test_command_that_is_not_executable(tmp_path: Path) -> None:
    script = tmp_path / "not-executable.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    result = subprocess.run(netdist_cmd("launch", "-n", "1", "--", str(script)),
                            capture_output=True, text=True, timeout=BOUND, cwd=REPO_ROOT)
    assert result.returncode == 126
    assert "netdist launch: cannot start rank 0: [Errno 13] Permission denied" in result.stderr


def test_timeout_terminates_the_whole_job(tmp_path: Path) -> None:
    result, elapsed = run_launch(tmp_path, ["-n", "2", "--timeout", "1"],
                                 "print('started', flush=True)\nsleep_forever()\n")
    assert result.returncode == 124
    assert ("netdist launch: job timed out after 1 s; terminated ranks 0, 1"
            in result.stderr.splitlines())
    assert 1.0 <= elapsed < FAST


def test_leftover_background_process_does_not_hang_the_launcher(tmp_path: Path) -> None:
    # Rank 0 exits 0 but leaves a grandchild holding its stdout pipe open forever.
    body = (
        "if RANK == 0:\n"
        "    p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'])\n"
        "    write_pid('pid-orphan', p.pid)\n"
        "print('done', flush=True)\n"
    )
    try:
        result, elapsed = run_launch(tmp_path, ["-n", "2"], body)
        assert result.returncode == 0
        assert by_rank(result.stdout) == {0: ["done"], 1: ["done"]}
        assert "still held open by a leftover process" in result.stderr
        assert elapsed < FAST
    finally:
        for pid in read_pids(tmp_path, "pid-orphan").values():
            os.kill(pid, signal.SIGKILL)


# --------------------------------------------------------------------------- signals


def _read_until(proc: subprocess.Popen[bytes], needed: int, timeout: float) -> list[str]:
    """Read the launcher's stdout until ``needed`` lines arrived (bounded)."""
    assert proc.stdout is not None
    lines: list[str] = []
    buffer = b""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while len(lines) < needed:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sel.select(remaining):
                pytest.fail(f"only {lines} after {timeout} s")
            data = os.read(proc.stdout.fileno(), 65536)
            if not data:
                pytest.fail(f"launcher closed stdout after {lines}")
            buffer += data
            *complete, buffer = buffer.split(b"\n")
            lines += [line.decode() for line in complete]
    return lines


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_to_launcher_kills_every_rank_and_its_children(
        tmp_path: Path, signum: signal.Signals, status: int) -> None:
    body = (
        "gc = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'])\n"
        "write_pid(f'pid-rank-{RANK}', os.getpid())\n"
        "write_pid(f'pid-grandchild-{RANK}', gc.pid)\n"
        "print('ready', flush=True)\n"
        "sleep_forever()\n"
    )
    env = dict(os.environ)
    env.pop("NETDIST_TOKEN", None)
    start = time.monotonic()
    proc = subprocess.Popen(netdist_cmd("launch", "-n", "3", "--", *child(body, tmp_path)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            cwd=REPO_ROOT)
    try:
        ready = _read_until(proc, 3, BOUND)
        assert sorted(ready) == ["[rank 0] ready", "[rank 1] ready", "[rank 2] ready"]
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=BOUND)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=BOUND)
        for pipe in (proc.stdout, proc.stderr):  # closed here, not by a later test's GC
            if pipe is not None:
                pipe.close()
    assert proc.returncode == status
    assert (f"netdist launch: received {signum.name}; terminated ranks 0, 1, 2"
            in err.decode().splitlines())
    assert time.monotonic() - start < FAST
    ranks = read_pids(tmp_path, "pid-rank-")
    grandchildren = read_pids(tmp_path, "pid-grandchild-")
    assert len(ranks) == len(grandchildren) == 3
    for pid in ranks.values():
        assert_dead(pid)
    for pid in grandchildren.values():
        wait_dead(pid)


# --------------------------------------------------------------------------- restarts


def test_max_restarts_restarts_the_whole_job(tmp_path: Path) -> None:
    body = (
        "env = os.environ\n"
        "print('attempt', ATTEMPT, env['NETDIST_COORDINATOR'], env['NETDIST_JOB_ID'],"
        " env['NETDIST_TOKEN'], flush=True)\n"
        "if ATTEMPT == 0:\n"
        "    if RANK == 1:\n"
        "        sys.exit(5)\n"
        "    sleep_forever()\n"
    )
    result, elapsed = run_launch(tmp_path, ["-n", "2", "--max-restarts", "1"], body)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "netdist launch: rank 1 exited with code 5; terminated rank 0",
        "netdist launch: restarting the job (1 of 1)",
    ]
    lines = by_rank(result.stdout)
    seen = {(rank, int(line.split()[1])): line.split()[2:] for rank, out in lines.items()
            for line in out}
    assert {(0, 1), (1, 0), (1, 1)} <= set(seen) <= {(0, 0), (0, 1), (1, 0), (1, 1)}
    first, second = seen[1, 0], seen[1, 1]
    assert seen[0, 1] == second
    assert first[0] != second[0]  # a new coordinator port for the restart
    assert first[1:] == second[1:]  # same job id and token
    assert elapsed < FAST


def test_restarts_are_bounded(tmp_path: Path) -> None:
    body = "print('attempt', ATTEMPT, flush=True)\nsys.exit(4)\n"
    result, _ = run_launch(tmp_path, ["-n", "1", "--max-restarts", "2"], body)
    assert result.returncode == 4
    assert by_rank(result.stdout) == {0: ["attempt 0", "attempt 1", "attempt 2"]}
    assert result.stderr.splitlines() == [
        "netdist launch: rank 0 exited with code 4",
        "netdist launch: restarting the job (1 of 2)",
        "netdist launch: rank 0 exited with code 4",
        "netdist launch: restarting the job (2 of 2)",
        "netdist launch: rank 0 exited with code 4",
        "netdist launch: giving up after 2 restarts",
    ]


# --------------------------------------------------------------------------- CLI


def test_cli_launch_two_python_ranks() -> None:
    code = "import os; print('hello from', os.environ['NETDIST_RANK'], 'of', os.environ['NETDIST_WORLD_SIZE'])"
    result = subprocess.run(netdist_cmd("launch", "-n", "2", "--", sys.executable, "-c", code),
                            capture_output=True, text=True, timeout=BOUND, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[rank 0] hello from 0 of 2",
                                                  "[rank 1] hello from 1 of 2"]
    assert result.stderr == ""


def test_console_script(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "netdist"
    if not script.exists():
        pytest.skip(f"no console script next to {sys.executable} (package not pip-installed)")
    result = subprocess.run([str(script), "launch", "-n", "2", "--", sys.executable, "-c",
                             "print('ok')"], capture_output=True, text=True, timeout=BOUND)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[rank 0] ok", "[rank 1] ok"]


@pytest.mark.parametrize(("args", "message"), [
    (["-n", "2"], "netdist launch: error: no command given"),
    (["-n", "2", "--"], "netdist launch: error: no command given"),
    (["-n", "0", "--", "true"], "netdist launch: error: number of processes must be"),
    (["-n", "1", "--coordinator", "h:x", "--", "true"], "netdist launch: error: coordinator"),
    (["-n", "1", "--max-restarts", "-1", "--", "true"], "netdist launch: error: max_restarts"),
    (["-n", "1", "--timeout", "-3", "--", "true"], "netdist launch: error: timeout"),
])
def test_cli_usage_errors_exit_2_without_traceback(args: list[str], message: str) -> None:
    result = subprocess.run(netdist_cmd("launch", *args), capture_output=True, text=True,
                            timeout=BOUND, cwd=REPO_ROOT)
    assert result.returncode == 2
    assert result.stderr.startswith(message), result.stderr
    assert "Traceback" not in result.stderr
