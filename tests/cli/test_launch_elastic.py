"""``netdist launch --elastic``: a failed slot is restarted alone (issue 32, item 2).

Real launcher processes and real Python children. Every child writes
``start-SLOT-RESTART.json`` (its pid and its whole environment) as soon as it starts and
binds its ``NETDIST_ELASTIC_PORT``; children that must outlive a sibling's restart wait
for that sibling's file (a bounded poll of the file system, never a sleep). The pids in
the files tell which processes were started, so "the other slots were not restarted" is
checked on the processes themselves.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from netdist.errors import ConfigError
from netdist.launcher import launch
from tests.cli.test_launch import BOUND, REPO_ROOT, _read_until, assert_dead, netdist_cmd

pytestmark = pytest.mark.slow

PREFIX = "netdist launch: "

PRELUDE = r'''
import json, os, signal, socket, sys, time
SLOT = int(os.environ["NETDIST_ELASTIC_SLOT"])
RESTART = int(os.environ["NETDIST_RESTART_COUNT"])
TMP = sys.argv[1]

def wait_for(name, timeout=30.0):
    """Block, bounded, until the file TMP/name exists."""
    path = os.path.join(TMP, name)
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"slot {SLOT}: {name} never appeared")
        time.sleep(0.01)

# The slot's own endpoint: binding it proves nobody (the launcher included) holds it.
endpoint = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
endpoint.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
endpoint.bind((os.environ["NETDIST_ELASTIC_HOST"], int(os.environ["NETDIST_ELASTIC_PORT"])))
endpoint.listen()

path = os.path.join(TMP, f"start-{SLOT}-{RESTART}.json")
with open(path + ".tmp", "w") as f:
    json.dump({"pid": os.getpid(), "env": dict(os.environ)}, f)
os.replace(path + ".tmp", path)
print(f"started restart {RESTART}", flush=True)
'''


def run_elastic(tmp_path: Path, launch_args: list[str], body: str,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``netdist launch --elastic ARGS -- python -c PRELUDE+body TMP`` to its end."""
    full_env = dict(os.environ)
    for name in ("NETDIST_TOKEN", "NETDIST_JOB_ID", "MASTER_PORT", "MASTER_ADDR",
                 "NETDIST_ELASTIC_HOST"):
        full_env.pop(name, None)
    full_env.update(env or {})
    cmd = netdist_cmd("launch", "--elastic", *launch_args, "--",
                      sys.executable, "-c", PRELUDE + body, str(tmp_path))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=BOUND, env=full_env,
                          cwd=REPO_ROOT)


def starts(tmp_path: Path) -> dict[tuple[int, int], dict[str, Any]]:
    """``{(slot, restart): {"pid": ..., "env": {...}}}`` for every process that started."""
    found = {}
    for path in tmp_path.glob("start-*.json"):
        _, slot, restart = path.stem.split("-")
        found[int(slot), int(restart)] = json.loads(path.read_text())
    return found


def launcher_lines(stderr: str) -> list[str]:
    """The launcher's own lines, without the prefix (children's stderr is ``[slot N] ``)."""
    return [line[len(PREFIX):] for line in stderr.splitlines() if line.startswith(PREFIX)]


# --------------------------------------------------------------------------- restarts


def test_only_the_killed_slot_is_restarted_on_its_own_port(tmp_path: Path) -> None:
    # Slot 1 kills itself once every slot is up; slots 0 and 2 wait for its second start
    # (so they were running through the restart) and then exit 0.
    body = (
        "if SLOT == 1 and RESTART == 0:\n"
        "    wait_for('start-0-0.json'); wait_for('start-2-0.json')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "if SLOT != 1:\n"
        "    wait_for('start-1-1.json')\n"
    )
    result = run_elastic(tmp_path, ["-n", "3", "--max-restarts", "2"], body)
    assert result.returncode == 0, result.stderr
    started = starts(tmp_path)
    assert sorted(started) == [(0, 0), (1, 0), (1, 1), (2, 0)]  # 0 and 2: started once
    first, second = started[1, 0], started[1, 1]
    assert first["pid"] != second["pid"]
    assert launcher_lines(result.stderr) == [
        f"slot 1 (pid {first['pid']}) was killed by signal 9 (SIGKILL); "
        "restarting it (restart 1 of 2)",
    ]
    # Same slot, same port, same environment but the restart count.
    assert second["env"].pop("NETDIST_RESTART_COUNT") == "1"
    assert first["env"].pop("NETDIST_RESTART_COUNT") == "0"
    assert first["env"] == second["env"]
    assert second["env"]["NETDIST_ELASTIC_PORT"] == first["env"]["NETDIST_ELASTIC_PORT"]
    assert started[0, 0]["env"]["NETDIST_ELASTIC_MIN"] == "2"  # strict majority of 3
    # Output is prefixed per slot.
    assert sorted(result.stdout.splitlines()) == [
        "[slot 0] started restart 0", "[slot 1] started restart 0",
        "[slot 1] started restart 1", "[slot 2] started restart 0"]


def test_restarts_are_capped_per_slot(tmp_path: Path) -> None:
    # Slot 1 always fails; slot 0 fails once. Each slot has its own 2 restarts.
    body = (
        "if SLOT == 1:\n"
        "    sys.exit(4)\n"
        "if RESTART == 0:\n"
        "    sys.exit(5)\n"
        "wait_for('start-1-2.json')\n"
    )
    result = run_elastic(tmp_path, ["-n", "2", "--max-restarts", "2", "--min-nodes", "1"],
                         body)
    assert result.returncode == 0, result.stderr
    started = starts(tmp_path)
    assert sorted(started) == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    lines = launcher_lines(result.stderr)
    pid = {key: value["pid"] for key, value in started.items()}
    slot1 = [line for line in lines if line.startswith("slot 1 ")]
    assert slot1 == [
        f"slot 1 (pid {pid[1, 0]}) exited with code 4; restarting it (restart 1 of 2)",
        f"slot 1 (pid {pid[1, 1]}) exited with code 4; restarting it (restart 2 of 2)",
        f"slot 1 (pid {pid[1, 2]}) exited with code 4; it stays down, no restart left "
        "(2 of 2 used); 1 of 2 slots left (minimum 1)",
    ]
    assert [line for line in lines if line.startswith("slot 0 ")] == [
        f"slot 0 (pid {pid[0, 0]}) exited with code 5; restarting it (restart 1 of 2)"]
    assert lines[-1] == "job finished: slot 1 stayed down, every other slot exited 0"
    assert len(lines) == 5


def test_job_fails_when_fewer_than_min_nodes_slots_are_left(tmp_path: Path) -> None:
    body = (
        "if SLOT == 2:\n"
        "    wait_for('start-0-0.json'); wait_for('start-1-0.json')\n"
        "    sys.exit(3)\n"
        "while True:\n"
        "    time.sleep(3600)\n"
    )
    result = run_elastic(tmp_path, ["-n", "3", "--max-restarts", "1", "--min-nodes", "3"],
                         body)
    assert result.returncode == 3
    started = starts(tmp_path)
    assert sorted(started) == [(0, 0), (1, 0), (2, 0), (2, 1)]
    assert launcher_lines(result.stderr) == [
        f"slot 2 (pid {started[2, 0]['pid']}) exited with code 3; restarting it "
        "(restart 1 of 1)",
        f"slot 2 (pid {started[2, 1]['pid']}) exited with code 3; it stays down, no restart "
        "left (1 of 1 used); 2 of 3 slots left (minimum 3)",
        "job failed: slot 2 is down and only 2 of 3 slots are left, fewer than the minimum "
        "of 3; terminated slots 0, 1",
    ]
    for slot in (0, 1):
        assert_dead(started[slot, 0]["pid"])


def test_without_restarts_a_failed_slot_stays_down_and_the_job_goes_on(tmp_path: Path) -> None:
    body = (
        "if SLOT == 0:\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "wait_for('start-0-0.json')\n"
    )
    result = run_elastic(tmp_path, ["-n", "3"], body)  # default --min-nodes: 2 of 3
    assert result.returncode == 0, result.stderr
    started = starts(tmp_path)
    assert sorted(started) == [(0, 0), (1, 0), (2, 0)]
    assert launcher_lines(result.stderr) == [
        f"slot 0 (pid {started[0, 0]['pid']}) was killed by signal 9 (SIGKILL); it stays "
        "down, no restart left (0 of 0 used); 2 of 3 slots left (minimum 2)",
        "job finished: slot 0 stayed down, every other slot exited 0",
    ]


# --------------------------------------------------------------------------- environment


def test_environment_contract_for_slots_and_spares(tmp_path: Path) -> None:
    # Spare slot 2 is killed once: a spare is restarted like any slot.
    body = (
        "if SLOT == 2 and RESTART == 0:\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    result = run_elastic(
        tmp_path, ["-n", "2", "--spares", "2", "--min-nodes", "1", "--max-restarts", "1",
                   "--job-id", "elastic-7"],
        body, env={"RANK": "7", "NETDIST_RANK": "9", "LOCAL_RANK": "5",
                   "NETDIST_TOKEN": "t" * 32})
    assert result.returncode == 0, result.stderr
    started = starts(tmp_path)
    assert sorted(started) == [(0, 0), (1, 0), (2, 0), (2, 1), (3, 0)]
    envs = {key: value["env"] for key, value in started.items()}
    ports = [int(envs[slot, 0]["NETDIST_ELASTIC_PORT"]) for slot in range(4)]
    assert len(set(ports)) == 4
    seeds = ",".join(f"127.0.0.1:{port}" for port in ports)
    coordinator = envs[0, 0]["NETDIST_COORDINATOR"]
    host, coordinator_port = coordinator.rsplit(":", 1)
    assert host == "127.0.0.1"
    master_port = envs[0, 0]["MASTER_PORT"]
    assert not {int(coordinator_port), int(master_port)} & set(ports)
    for (slot, restart), env in envs.items():
        assert env["NETDIST_ELASTIC"] == "1"
        assert env["NETDIST_ELASTIC_SLOT"] == str(slot)
        assert env["NETDIST_ELASTIC_PORT"] == str(ports[slot])
        assert env["NETDIST_ELASTIC_HOST"] == "127.0.0.1"
        assert env["NETDIST_ELASTIC_SEEDS"] == seeds
        assert env["NETDIST_ELASTIC_MIN"] == "1"
        assert env["NETDIST_RESTART_COUNT"] == str(restart)
        assert env["NETDIST_WORLD_SIZE"] == env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["NETDIST_COORDINATOR"] == coordinator
        assert env["MASTER_PORT"] == master_port
        assert env["NETDIST_JOB_ID"] == "elastic-7"
        assert env["NETDIST_TOKEN"] == "t" * 32
        if slot < 2:
            assert env["NETDIST_RANK"] == env["RANK"] == env["LOCAL_RANK"] == str(slot)
        else:  # a spare has no rank (not even the launcher's own RANK=7)
            assert not {"NETDIST_RANK", "RANK", "LOCAL_RANK"} & set(env)
    assert launcher_lines(result.stderr) == [
        f"slot 2 (pid {started[2, 0]['pid']}) was killed by signal 9 (SIGKILL); "
        "restarting it (restart 1 of 1)"]


def test_elastic_host_is_taken_from_the_environment(tmp_path: Path) -> None:
    result = run_elastic(tmp_path, ["-n", "1"], "", env={"NETDIST_ELASTIC_HOST": "127.0.0.2"})
    assert result.returncode == 0, result.stderr
    env = starts(tmp_path)[0, 0]["env"]
    assert env["NETDIST_ELASTIC_HOST"] == "127.0.0.2"
    assert env["NETDIST_ELASTIC_SEEDS"] == f"127.0.0.2:{env['NETDIST_ELASTIC_PORT']}"
    assert env["NETDIST_ELASTIC_MIN"] == "1"


def test_library_launch_elastic(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    body = (
        "if RESTART == 0:\n"
        "    sys.exit(7)\n"
    )
    cmd = [sys.executable, "-c", PRELUDE + body, str(tmp_path)]
    status = launch(cmd, 1, elastic=True, spares=1, max_restarts=1, min_nodes=1)
    captured = capfd.readouterr()
    assert status == 0, captured.err
    started = starts(tmp_path)
    assert sorted(started) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert sorted(launcher_lines(captured.err)) == [
        f"slot {slot} (pid {started[slot, 0]['pid']}) exited with code 7; restarting it "
        "(restart 1 of 1)" for slot in (0, 1)]
    assert sorted(captured.out.splitlines()) == [
        f"[slot {slot}] started restart {restart}" for slot in (0, 1) for restart in (0, 1)]


# --------------------------------------------------------------------------- stopping


def test_timeout_stops_every_slot(tmp_path: Path) -> None:
    body = "while True:\n    time.sleep(3600)\n"
    result = run_elastic(tmp_path, ["-n", "2", "--spares", "1", "--timeout", "1"], body)
    assert result.returncode == 124
    assert "job timed out after 1 s; terminated slots 0, 1, 2" in launcher_lines(result.stderr)
    for start in starts(tmp_path).values():
        assert_dead(start["pid"])


def test_sigterm_to_the_launcher_stops_every_slot(tmp_path: Path) -> None:
    body = "while True:\n    time.sleep(3600)\n"
    env = dict(os.environ)
    env.pop("NETDIST_TOKEN", None)
    proc = subprocess.Popen(
        netdist_cmd("launch", "--elastic", "-n", "2", "--spares", "1", "--max-restarts", "3",
                    "--", sys.executable, "-c", PRELUDE + body, str(tmp_path)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO_ROOT)
    try:
        ready = _read_until(proc, 3, BOUND)
        assert sorted(ready) == [f"[slot {slot}] started restart 0" for slot in range(3)]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=BOUND)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=BOUND)
    assert proc.returncode == 143
    assert launcher_lines(err.decode()) == ["received SIGTERM; terminated slots 0, 1, 2"]
    started = starts(tmp_path)
    assert sorted(started) == [(0, 0), (1, 0), (2, 0)]  # terminated slots are not restarted
    for start in started.values():
        assert_dead(start["pid"])


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"elastic": True, "spares": -1}, "spares must be an integer >= 0, got -1"),
    ({"elastic": True, "spares": True}, "spares must be an integer >= 0, got True"),
    ({"elastic": True, "min_nodes": 0}, r"min_nodes must be .* \(3\), got 0"),
    ({"elastic": True, "min_nodes": 4}, r"min_nodes must be .* \(3\), got 4"),
    ({"elastic": "yes"}, "elastic must be True or False, got 'yes'"),
    ({"spares": 1}, "spares=1 and min_nodes=None need elastic=True"),
    ({"min_nodes": 2}, "spares=0 and min_nodes=2 need elastic=True"),
])
def test_launch_rejects_invalid_elastic_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        launch(["true"], 3, **kwargs)


@pytest.mark.parametrize(("args", "message"), [
    (["-n", "2", "--spares", "1", "--", "true"], "netdist launch: error: spares=1"),
    (["--elastic", "-n", "2", "--min-nodes", "3", "--", "true"],
     "netdist launch: error: min_nodes must be"),
    (["--elastic", "-n", "2", "--spares", "-2", "--", "true"],
     "netdist launch: error: spares must be"),
])
def test_cli_rejects_invalid_elastic_options(args: list[str], message: str) -> None:
    result = subprocess.run(netdist_cmd("launch", *args), capture_output=True, text=True,
                            timeout=BOUND, cwd=REPO_ROOT)
    assert result.returncode == 2
    assert result.stderr.startswith(message), result.stderr


def test_cli_refuses_an_elastic_host_it_cannot_bind() -> None:
    env = dict(os.environ, NETDIST_ELASTIC_HOST="192.0.2.1")  # TEST-NET-1: not this host
    result = subprocess.run(netdist_cmd("launch", "--elastic", "-n", "1", "--", "true"),
                            capture_output=True, text=True, timeout=BOUND, cwd=REPO_ROOT,
                            env=env)
    assert result.returncode == 2
    assert result.stderr.startswith(
        "netdist launch: error: NETDIST_ELASTIC_HOST='192.0.2.1': cannot bind a port there"), \
        result.stderr
