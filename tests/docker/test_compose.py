"""The docker-compose cluster (issue 8): real containers on a private bridge network.

Each test runs its own compose project (``-p``) and removes it, volume included, in a
``finally``. Every wait is bounded (``docker wait``, ``docker logs --follow``, a server's
listening socket watched with ``ss``, all under deadlines), and nothing connects to a
server before it listens (issue 12, item 20). The job is small so the whole file takes a few minutes on 2 cores:
6 epochs of batch 16 per rank (23 steps per epoch with 4 workers, 138 steps).
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.docker.cluster import (
    CHECKPOINT_RE,
    COORDINATOR_PORT,
    IMAGE,
    NODE_RE,
    RANK0,
    REPO,
    RESUMED_RE,
    SERVERS,
    WORKERS,
    Cluster,
    accuracy,
    docker,
    epoch_losses,
    exit_codes,
    services_logs,
    wait_for_listener,
)

pytestmark = [pytest.mark.docker, pytest.mark.timeout(600),
              pytest.mark.usefixtures("netdist_image")]

STEPS_PER_EPOCH = 23
TRAIN = {"NETDIST_EPOCHS": "6", "NETDIST_BATCH_SIZE": "16",
         "NETDIST_CHECKPOINT_EVERY": str(STEPS_PER_EPOCH)}
TIMEOUT = 10.0        # NETDIST_TIMEOUT of every test cluster
MARGIN = 25.0         # container teardown, heartbeat period, a loaded 2-core machine
RUN_TIMEOUT = 300.0   # a whole training run, container start included


def _error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "error:" in line]


@pytest.fixture(scope="module")
def reference(netdist_image: str) -> dict:
    """One uninterrupted run of the test job: exit codes, rank 0's log, final checkpoint."""
    cluster = Cluster("ref", TRAIN)
    try:
        cluster.up()
        exits = cluster.wait_exit(WORKERS, RUN_TIMEOUT)
        logs = {s: cluster.logs(s) for s in WORKERS}
        ckpt = cluster.checkpoints()
        return {"exits": exits, "logs": logs, "ckpt": ckpt, "services": cluster.services()}
    finally:
        cluster.down()


def test_happy_path_trains_to_95_percent_and_every_container_exits_0(reference: dict) -> None:
    codes = exit_codes(reference["exits"])
    log = reference["logs"][RANK0]
    assert reference["services"] == sorted(WORKERS)  # the ps profile's servers stay off
    assert codes == {s: 0 for s in WORKERS}, "\n".join(reference["logs"].values())
    assert "no checkpoint in /checkpoints/test; starting from scratch" in log
    assert "4 training ranks" in log
    losses = epoch_losses(log)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6], log
    assert float(losses[6]) < float(losses[1])
    assert re.search(rf"step\s+{6 * STEPS_PER_EPOCH}/{6 * STEPS_PER_EPOCH}\s", log), log
    assert accuracy(log) >= 95.0, log
    # one checkpoint per epoch, the last one complete, verified and loadable
    assert [int(s) for s in CHECKPOINT_RE.findall(log)] == [
        STEPS_PER_EPOCH * e for e in range(1, 7)]
    ckpt = reference["ckpt"]
    assert ckpt["latest"] == f"step_{6 * STEPS_PER_EPOCH:06d}"
    assert ckpt["verify"]["code"] == 0, ckpt["verify"]
    assert ckpt["load_error"] is None and ckpt["tensors"], ckpt
    for service in WORKERS[1:]:  # only rank 0 reports
        assert "final test accuracy" not in reference["logs"][service]
    # without the ps profile worker-I is rank I (the names say role and index)
    for index, service in enumerate(WORKERS):
        node = NODE_RE.search(reference["logs"][service])
        assert node and node.groups() == (service, str(index), "4", "worker", str(index)), \
            reference["logs"][service]


def test_node_loss_stops_everyone_then_resumes_on_the_same_trajectory(reference: dict) -> None:
    cluster = Cluster("loss", TRAIN)
    try:
        cluster.up()
        cluster.wait_for_log(RANK0, CHECKPOINT_RE, RUN_TIMEOUT)
        killed_at = time.monotonic()
        cluster.kill("worker-2")
        survivors = (RANK0, "worker-1", "worker-3")
        exits = cluster.wait_exit(survivors, TIMEOUT + MARGIN)
        stopped_after = time.monotonic() - killed_at
        first = {s: cluster.logs(s) for s in survivors}
        assert "final test accuracy" not in first[RANK0], "the kill landed after training"
        for service in survivors:
            assert exits[service].code != 0, first[service]
            errors = _error_lines(first[service])
            assert errors and re.search(r"\brank 2\b", errors[-1]), (service, first[service])
            assert "Traceback" not in first[service], first[service]
        assert stopped_after <= TIMEOUT + MARGIN
        # the newest complete checkpoint on disk is where the restart must resume: the
        # one rank 0 announced last, or the next one if the kill landed between its
        # commit and rank 0's announcement of it
        announced = max(int(s) for s in CHECKPOINT_RE.findall(first[RANK0]))
        on_disk = cluster.checkpoints()
        assert on_disk["verify"]["code"] == 0, on_disk["verify"]
        saved = int(on_disk["latest"].removeprefix("step_"))
        assert saved in (announced, announced + STEPS_PER_EPOCH), (saved, first[RANK0])

        cluster.mark(*WORKERS)
        cluster.up()
        exits = cluster.wait_exit(WORKERS, RUN_TIMEOUT)
        log = cluster.logs(RANK0, since_mark=True)
        assert exit_codes(exits) == {s: 0 for s in WORKERS}, services_logs(cluster, WORKERS)
        resumed = RESUMED_RE.search(log)
        assert resumed and int(resumed.group(1)) == saved, log
        # the same trajectory as the uninterrupted run from the resumed step on: every
        # epoch's loss after it, the final accuracy and the final parameters, bit for bit
        reference_losses = epoch_losses(reference["logs"][RANK0])
        losses = epoch_losses(log)
        after = [e for e in reference_losses if e > saved // STEPS_PER_EPOCH]
        assert after and {e: losses.get(e) for e in after} == {
            e: reference_losses[e] for e in after}, (log, reference["logs"][RANK0])
        assert accuracy(log) == accuracy(reference["logs"][RANK0])
        ckpt = cluster.checkpoints()
        assert ckpt["latest"] == reference["ckpt"]["latest"]
        assert ckpt["tensors"] == reference["ckpt"]["tensors"]
    finally:
        cluster.down()


def test_partition_times_out_cleanly_on_every_rank() -> None:
    cluster = Cluster("part", TRAIN)
    try:
        cluster.up()
        cluster.wait_for_log(RANK0, r"^epoch\s+1/", RUN_TIMEOUT)
        cut_at = time.monotonic()
        docker("network", "disconnect", cluster.network, cluster.container("worker-2"))
        exits = cluster.wait_exit(WORKERS, TIMEOUT + MARGIN)
        stopped_after = time.monotonic() - cut_at
        logs = {s: cluster.logs(s) for s in WORKERS}
        assert stopped_after <= TIMEOUT + MARGIN
        for service in WORKERS:
            assert exits[service].code == 1, (service, logs[service])  # a NetdistError
            assert _error_lines(logs[service]), logs[service]
            assert "Traceback" not in logs[service], logs[service]
        assert "final test accuracy" not in logs[RANK0]
        # the cut-off rank knows it lost everybody, the others name it or time out
        assert re.search(r"time|lost|rank", _error_lines(logs["worker-2"])[-1])
    finally:
        cluster.down()


# Prints what a save in progress has left in the checkpoint root: a step directory without
# metadata.json yet, or a temporary file (temp sibling, fsync, rename).
_SAVE_IN_PROGRESS = r"""
cd "$1" 2>/dev/null || exit 0
for d in step_*; do
    if [ -d "$d" ] && [ ! -f "$d/metadata.json" ]; then echo "partial $d"; fi
done
find . -name '*.tmp.*' | sed 's/^/temporary /'
"""


def test_kill_during_checkpoint_save_keeps_the_previous_checkpoint() -> None:
    """SIGKILL every rank in the middle of a save: the previous checkpoint still verifies
    and loads, and the job resumes from it and finishes.

    The job saves every step. To land the kill inside a save rather than near one, the
    cluster is frozen (`docker pause`, instantaneous), the checkpoint root inspected from
    a helper container, and the frozen ranks killed (`docker kill` works on paused
    containers: they never run another instruction) only when a save is caught in
    progress; otherwise they are thawed and the next moment is tried.
    """
    cluster = Cluster("ckill", {**TRAIN, "NETDIST_CHECKPOINT_EVERY": "1"})
    helper = ""
    try:
        cluster.up()
        cluster.wait_for_log(RANK0, CHECKPOINT_RE, RUN_TIMEOUT,
                             accept=lambda m: int(m.group(1)) >= 5)
        helper = docker("run", "-d", "--rm", "--network", "none",
                        "-v", f"{cluster.volume}:/checkpoints", "--entrypoint", "sleep",
                        IMAGE, "600").stdout.strip()
        ranks = [cluster.container(s) for s in WORKERS]
        caught = ""
        deadline = time.monotonic() + 120
        while not caught and time.monotonic() < deadline:
            docker("pause", *ranks)
            caught = docker("exec", helper, "sh", "-c", _SAVE_IN_PROGRESS, "probe",
                            "/checkpoints/test").stdout.strip()
            docker("kill" if caught else "unpause", *ranks)
        assert caught, "no freeze caught a save in progress within 120 s"
        print(f"killed during a save: {' '.join(caught.split())}")
        exits = cluster.wait_exit(WORKERS, 60)
        assert all(e.code == 137 for e in exits.values()), exits  # killed, not finished

        state = cluster.checkpoints()
        assert state["incomplete"] or state["temporary"], (caught, state)
        assert state["complete"], state
        latest = int(state["latest"].removeprefix("step_"))
        # `latest` names the newest complete step (or the one before it, had the kill
        # fallen between a save's commit and the update of `latest`)
        assert latest in state["complete"][-2:], state
        assert state["verify"]["code"] == 0, state["verify"]
        assert state["load_error"] is None and state["tensors"], state

        cluster.mark(*WORKERS)
        cluster.up()
        exits = cluster.wait_exit(WORKERS, RUN_TIMEOUT)
        log = cluster.logs(RANK0, since_mark=True)
        assert exit_codes(exits) == {s: 0 for s in WORKERS}, services_logs(cluster, WORKERS)
        resumed = RESUMED_RE.search(log)
        assert resumed and int(resumed.group(1)) == latest, log
        assert accuracy(log) >= 95.0, log
        assert not cluster.checkpoints()["incomplete"]  # the next save cleaned up
    finally:
        if helper:
            docker("rm", "-f", helper, check=False)
        cluster.down()


def test_scale_change_reshards_on_resume() -> None:
    """4 workers save, 3 resume (and continue), then 4 again."""
    cluster = Cluster("scale", {**TRAIN, "NETDIST_EPOCHS": "2"})
    try:
        cluster.up()
        exits = cluster.wait_exit(WORKERS, RUN_TIMEOUT)
        assert exit_codes(exits) == {s: 0 for s in WORKERS}, services_logs(cluster, WORKERS)
        saved = max(int(s) for s in CHECKPOINT_RE.findall(cluster.logs(RANK0)))
        assert saved == 2 * STEPS_PER_EPOCH

        three = WORKERS[:3]
        cluster.up(*three, env={"NETDIST_WORKERS": "3", "NETDIST_EPOCHS": "4"})
        exits = cluster.wait_exit(three, RUN_TIMEOUT)
        log = cluster.logs(RANK0)
        assert exit_codes(exits) == {s: 0 for s in three}, services_logs(cluster, three)
        assert "3 training ranks" in log, log
        resumed = RESUMED_RE.search(log)
        assert resumed and int(resumed.group(1)) == saved, log
        assert sorted(epoch_losses(log)) == [3, 4], log
        saved3 = max(int(s) for s in CHECKPOINT_RE.findall(log))
        assert saved3 > saved

        cluster.up(*WORKERS, env={"NETDIST_EPOCHS": "6"})
        exits = cluster.wait_exit(WORKERS, RUN_TIMEOUT)
        log = cluster.logs(RANK0)
        assert exit_codes(exits) == {s: 0 for s in WORKERS}, services_logs(cluster, WORKERS)
        resumed = RESUMED_RE.search(log)
        assert resumed and int(resumed.group(1)) == saved3, log
        assert sorted(epoch_losses(log)) == [5, 6], log
        assert accuracy(log) >= 95.0, log
    finally:
        cluster.down()


def test_restart_policy_resumes_the_job_after_a_crash(reference: dict) -> None:
    """NETDIST_RESTART=on-failure:5: a rank that crashes (exits non-zero by itself, not
    `docker kill`, which Docker treats as a manual stop) brings the job down; Docker
    restarts every failed container and the job resumes from the latest complete
    checkpoint, ending with the uninterrupted run's parameters."""
    cluster = Cluster("restart", {**TRAIN, "NETDIST_RESTART": "on-failure:5"})
    try:
        cluster.up()
        cluster.wait_for_log(RANK0, CHECKPOINT_RE, RUN_TIMEOUT)
        cluster.mark(*WORKERS)
        crash = cluster.exec("worker-2", "kill", "-INT", "1")  # KeyboardInterrupt: exit 130
        assert crash.returncode == 0, crash.stderr
        try:
            resumed = cluster.wait_for_log(RANK0, RESUMED_RE, RUN_TIMEOUT, since_mark=True)
            exits = cluster.wait_exit(WORKERS, RUN_TIMEOUT)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{services_logs(cluster, WORKERS)}") from None
        assert exit_codes(exits) == {s: 0 for s in WORKERS}, services_logs(cluster, WORKERS)
        assert cluster.restart_count("worker-2") >= 1
        assert cluster.restart_count(RANK0) >= 1
        log = cluster.logs(RANK0, since_mark=True)
        assert int(resumed.group(1)) >= STEPS_PER_EPOCH
        assert accuracy(log) == accuracy(reference["logs"][RANK0])
        assert cluster.checkpoints()["tensors"] == reference["ckpt"]["tensors"]
    finally:
        cluster.down()


_JUNK = r"""
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
s.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(range(256)) * 64)
try:
    print("junk answered", len(s.recv(65536)), "bytes, then closed")
except (ConnectionError, socket.timeout) as exc:
    print("junk refused:", type(exc).__name__)
"""


def test_a_container_without_the_token_cannot_join_or_disturb() -> None:
    """Strangers on the job's network: garbage bytes and ranks with a wrong or no token, at
    the coordinator before the job forms and at rank 0's peer listener mid-training. Each
    is refused quickly with a clear error, and the job trains on undisturbed."""
    # a longer job (40 epochs, no checkpoints: ~10-20 s of training) so that the
    # mid-training attacks really happen mid-training
    # rank 0's coordinator waits for ranks 1-3 while the strangers knock, however long a
    # loaded machine takes to run them (NETDIST_CONNECT_TIMEOUT bounds the rendezvous)
    cluster = Cluster("stranger", {**TRAIN, "NETDIST_EPOCHS": "40",
                                   "NETDIST_CHECKPOINT_DIR": "none",
                                   "NETDIST_CONNECT_TIMEOUT": str(RUN_TIMEOUT)})
    stranger_env = {"NETDIST_RANK": "1", "NETDIST_WORLD_SIZE": "4",
                    "NETDIST_COORDINATOR": f"{RANK0}:{COORDINATOR_PORT}",
                    "NETDIST_JOB_ID": "test", "NETDIST_TIMEOUT": "10",
                    "NETDIST_CONNECT_TIMEOUT": "10"}
    try:
        cluster.up(RANK0)
        # the coordinator accepting connections, not a log line printed before it listens
        cluster.wait_for_listener(RANK0, COORDINATOR_PORT, 120)
        # a rank with the wrong token, then one with none, then garbage at the coordinator
        for token in ("not-the-token", None):
            env = dict(stranger_env, **({"NETDIST_TOKEN": token} if token else {}))
            started = time.monotonic()
            stranger = cluster.run_in_network("netdist", "worker", "--epochs", "1", env=env)
            assert stranger.returncode == 1, stranger.stdout + stranger.stderr
            assert re.search(r"authentication failed", stranger.stderr), stranger.stderr
            assert time.monotonic() - started < 30.0  # refused, not timed out
        # the coordinator says so too (a burst of refusals is logged once in full, then
        # counted: the wrong token goes first so that it is the one logged in full)
        assert "authentication failed" in cluster.logs(RANK0)
        junk = cluster.run_in_network("python3", "-c", _JUNK, RANK0, str(COORDINATOR_PORT))
        assert junk.returncode == 0, junk.stdout + junk.stderr

        cluster.up(*WORKERS[1:])
        cluster.wait_for_log(RANK0, r"^epoch\s+1/", RUN_TIMEOUT)
        # mid-training: junk and a wrong-token handshake at rank 0's peer listener
        listening = cluster.exec(RANK0, "ss", "-Htln").stdout
        # (Docker's embedded DNS also listens, on 127.0.0.11: not ours)
        ports = sorted({int(local.rsplit(":", 1)[1]) for local in
                        (line.split()[3] for line in listening.splitlines() if line.strip())
                        if not local.startswith("127.")} - {COORDINATOR_PORT})
        assert ports, f"rank 0 listens on no peer port during training:\n{listening}"
        for port in ports:
            junk = cluster.run_in_network("python3", "-c", _JUNK, RANK0, str(port))
            assert junk.returncode == 0, junk.stdout + junk.stderr
            attack = cluster.run_in_network(
                "netdist", "worker", "--epochs", "1",
                env={**stranger_env, "NETDIST_COORDINATOR": f"{RANK0}:{port}",
                     "NETDIST_TOKEN": "not-the-token"})
            assert attack.returncode == 1, attack.stdout + attack.stderr
            assert re.search(r"authentication failed|refused|rejected", attack.stderr), attack.stderr
        assert cluster.running(RANK0), "training ended before the attacks: lengthen the job"

        exits = cluster.wait_exit(WORKERS, RUN_TIMEOUT)
        log = cluster.logs(RANK0)
        assert exit_codes(exits) == {s: 0 for s in WORKERS}, services_logs(cluster, WORKERS)
        assert accuracy(log) >= 95.0, log
    finally:
        cluster.down()


def _names_and_ranks(cluster: Cluster, services: tuple[str, ...]) -> dict[str, tuple]:
    """``{service: (container name, hostname, what netdist-node logged)}``."""
    found = {}
    for service in services:
        cid = cluster.container(service)
        name, hostname = docker("inspect", "--format", "{{.Name}} {{.Config.Hostname}}",
                                cid).stdout.split()
        node = NODE_RE.search(cluster.logs(service))
        found[service] = (name.lstrip("/"), hostname,
                          node.group(1, 2, 3, 4, 5) if node else cluster.logs(service))
    return found


def test_ps_profile_trains_with_parameter_servers() -> None:
    """COMPOSE_PROFILES=ps with the README's command (docker/up.sh): ps-server-0 and
    ps-server-1 hold the parameter shards (ranks 0-1, ps-server-0 hosts the coordinator),
    worker-0..worker-3 are ranks 2-5. Every container is named after its role and index
    (no container called rank0 that is rank 2), and each one's log says its rank."""
    services = (*SERVERS, *WORKERS)
    cluster = Cluster("ps", {**TRAIN, "COMPOSE_PROFILES": "ps"})
    job = cluster.run_job("--no-build")
    try:
        code = job.finish(RUN_TIMEOUT)
        exits = cluster.wait_exit(services, 60)
        assert exit_codes(exits) == {s: 0 for s in services}, services_logs(cluster, services)
        assert code == 0, job.output
        assert job.output.rstrip().endswith("netdist up: job finished: all 6 containers exited 0")
        assert cluster.services() == sorted(services)
        separator = "_" if cluster.compose == ["docker-compose"] else "-"
        want = {service: (f"{cluster.project}{separator}{service}{separator}1", service,
                          (service, str(rank), "6", role, service[-1]))
                for rank, (service, role) in enumerate(
                    [(s, "server") for s in SERVERS] + [(w, "worker") for w in WORKERS])}
        assert _names_and_ranks(cluster, services) == want
        assert "coordinator ps-server-0:29400" in cluster.logs("worker-3")
        reports = [cluster.logs(s) for s in services if "final test accuracy" in cluster.logs(s)]
        assert len(reports) == 1, services_logs(cluster, services)
        assert "aggregator ps-sharded" in reports[0]
        assert accuracy(reports[0]) >= 95.0, reports[0]
    finally:
        job.close()
        cluster.down()


_SINK = r"""
import socket
srv = socket.create_server(("", 5001))
while True:
    conn, _ = srv.accept()
    with conn:
        while conn.recv(1 << 20):
            pass
        conn.sendall(b"done")
"""

_PROBE = r"""
import socket, sys, time
host = sys.argv[1]
rtts = []
for _ in range(5):
    t = time.perf_counter()
    socket.create_connection((host, 5001), timeout=10).close()
    rtts.append(time.perf_counter() - t)
payload = b"x" * (4 << 20)
s = socket.create_connection((host, 5001), timeout=30)
t = time.perf_counter()
s.sendall(payload)
s.shutdown(socket.SHUT_WR)
s.recv(16)
elapsed = time.perf_counter() - t
print(f"PROBE rtt_ms={min(rtts) * 1e3:.2f} mbit={len(payload) * 8 / elapsed / 1e6:.1f}")
"""


def test_netdist_netem_shapes_each_container() -> None:
    """NETDIST_NETEM="delay 20ms rate 100mbit" on one container: its connections see the
    delay and its sends the rate (netem, or its emulation on kernels without netem)."""
    cluster = Cluster("netem", {})
    sink = f"{cluster.project}-sink"
    try:
        cluster.run("run", "-d", "--name", sink, "worker-1", "python3", "-c", _SINK,
                    timeout=120)
        wait_for_listener(sink, 5001, 60)  # `run -d` returns before the sink listens
        probe = cluster.run("run", "--rm", "-T", "-e", "NETDIST_NETEM=delay 20ms rate 100mbit",
                            RANK0, "python3", "-c", _PROBE, sink, timeout=120)
        match = re.search(r"PROBE rtt_ms=([0-9.]+) mbit=([0-9.]+)", probe.stdout)
        assert match, probe.stdout + probe.stderr
        rtt_ms, mbit = float(match.group(1)), float(match.group(2))
        assert "shaped with" in probe.stderr, probe.stderr
        assert 20.0 <= rtt_ms < 200.0, (rtt_ms, probe.stderr)
        assert 20.0 < mbit <= 110.0, (mbit, probe.stderr)
        plain = cluster.run("run", "--rm", "-T", RANK0, "python3", "-c", _PROBE, sink,
                            timeout=120)
        plain_match = re.search(r"PROBE rtt_ms=([0-9.]+) mbit=([0-9.]+)", plain.stdout)
        assert plain_match and float(plain_match.group(1)) < 20.0, plain.stdout + plain.stderr
    finally:
        docker("rm", "-f", sink, check=False)
        cluster.down()


def test_compose_file_is_valid_for_this_compose(tmp_path: Path) -> None:
    """`config` accepts the file and interpolates the token from .env; without a token
    it refuses to run."""
    cluster = Cluster("config", {})
    config = cluster.run("config").stdout
    assert "NETDIST_TOKEN: netdist-compose-simulation-token" in config
    for service in (*WORKERS, *SERVERS):
        assert re.search(rf"^\s+{service}:\s*$", config, re.M)
    assert re.search(r"profiles:\s*\n\s*- ps\s", config)
    assert "NET_ADMIN" in config
    empty = tmp_path / "empty.env"
    empty.write_text("")
    missing = subprocess.run(
        [*cluster.compose, "-p", cluster.project, "-f", "docker-compose.yml",
         "--env-file", str(empty), "config"],
        cwd=REPO,
        env={k: v for k, v in cluster.env.items() if k != "NETDIST_TOKEN"},
        capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "NETDIST_TOKEN" in missing.stderr
