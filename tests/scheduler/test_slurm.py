"""netdist jobs placed by a real Slurm (22.05): 2 nodes x 2 CPUs, each node a host of its
own (``tests.scheduler.slurm_cluster``), jobs submitted with ``sbatch``, ``salloc`` and
``srun`` exactly as docs/slurm.md shows them.

- the docs' job script runs netdist's own API (an all-reduce, data-parallel training
  checkpointed every step), the digits demo (``netdist worker``) and torch DDP on the
  ``netdist`` backend, each on 2 nodes x 2 tasks;
- the tasks of one node move a large all-reduce through shared memory and only the
  other node's bytes cross TCP, the bound's worth of them;
- a task killed mid-step ends the step, and every survivor's error names it, with and
  without ``--kill-on-bad-exit``;
- a requeued job resumes from its checkpoint and ends as an uninterrupted run does.

The cluster starts once for the module (about 2 s); every test cancels what it left
running. ``.ci/run`` installs Slurm and munge, and with ``CI=true`` a missing piece fails
these tests; elsewhere they skip, saying what is missing.
"""

from __future__ import annotations

import json
import re
import secrets
import shlex
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from netdist.checkpoint import list_checkpoints
from tests.conftest import require_in_ci
from tests.scheduler.ddp_reference import parse_ddp_lines, reference_weights_sum
from tests.scheduler.slurm_cluster import SlurmCluster, slurm_missing

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DOCS_PAGE = REPO / "docs" / "slurm.md"
JOB_FILES = REPO / "examples" / "slurm"
# The command lines docs/slurm.md shows, run as written (test_docs_show_what_runs checks
# each is a line of a sh block there).
SUBMIT_TRAIN = "sbatch netdist_job.sbatch python3 slurm_train.py"
SUBMIT_DDP = "sbatch netdist_job.sbatch python3 ddp_train.py"
INTERACTIVE = (
    "salloc --nodes=2 --ntasks-per-node=2",
    'export NETDIST_COORDINATOR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'
    ':29400"',
    "export NETDIST_TOKEN=\"$(python3 -c 'import secrets; print(secrets.token_hex(32))')\"",
    "srun --kill-on-bad-exit=1 netdist worker",
)
JOB_TIMEOUT = 90.0
TRAIN_LINE = re.compile(r"^rank (\d) on (n\d): step 20 loss ([0-9.]+), replicas identical: "
                        r"True, weights ([0-9a-f]{16})$", re.M)


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    missing = slurm_missing()
    if missing is not None:
        require_in_ci(missing)
    with SlurmCluster.start(nodes=2, cpus=2, timeout=60.0) as cluster:
        yield cluster


@pytest.fixture
def cluster(slurm: SlurmCluster) -> Iterator[SlurmCluster]:
    """The module's cluster; whatever a test leaves running is cancelled after it."""
    yield slurm
    slurm.cancel_all()


def _job_dir(path: Path) -> Path:
    """A submit directory holding the docs' job files, as a user copies them."""
    for file in JOB_FILES.iterdir():
        shutil.copy2(file, path / file.name)
    return path


@dataclass(frozen=True, slots=True)
class TrainRun:
    """The docs' training job, run once without interruption."""

    job_id: int
    output: str

    def final_lines(self) -> dict[int, tuple[str, str, str]]:
        return _final_lines(self.output)


def _final_lines(output: str) -> dict[int, tuple[str, str, str]]:
    """rank -> (host, loss, weights) from the ranks' last lines."""
    return {int(m[1]): (m[2], m[3], m[4]) for m in TRAIN_LINE.finditer(output)}


def _submit(cluster: SlurmCluster, command: str, where: Path, *extra: str) -> int:
    argv = shlex.split(command)
    assert argv[0] == "sbatch"
    return cluster.sbatch([*argv[1:], *extra], cwd=where)


@pytest.fixture(scope="module")
def uninterrupted(slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> TrainRun:
    where = _job_dir(tmp_path_factory.mktemp("train"))
    job_id = _submit(slurm, SUBMIT_TRAIN, where)
    job = slurm.wait_finished(job_id, JOB_TIMEOUT)
    output = (where / f"netdist-{job_id}.out").read_text()
    assert (job.state, job.exit_code) == ("COMPLETED", 0), output
    return TrainRun(job_id, output)


def _sh_lines(page: Path) -> set[str]:
    blocks = re.findall(r"^```sh\n(.*?)^```", page.read_text(encoding="utf-8"), re.M | re.S)
    return {line.strip() for block in blocks for line in block.splitlines()}


def test_docs_show_what_runs() -> None:
    """The page includes the job files the tests run and shows the command lines they
    run, character for character."""
    text = DOCS_PAGE.read_text(encoding="utf-8")
    for name in ("netdist_job.sbatch", "slurm_train.py", "ddp_train.py"):
        assert f'--8<-- "examples/slurm/{name}"' in text, name
    lines = _sh_lines(DOCS_PAGE)
    for command in (SUBMIT_TRAIN, SUBMIT_DDP, *INTERACTIVE):
        assert command in lines, f"docs/slurm.md shows no line {command!r}"


def test_nodes_are_hosts_of_their_own(cluster: SlurmCluster) -> None:
    """sinfo shows both nodes idle; srun gives every task its rank, local rank and node,
    and the nodes their own names and addresses (what netdist sees as two hosts)."""
    assert cluster.run("sinfo").stdout.splitlines() == [
        "PARTITION AVAIL  TIMELIMIT  NODES  STATE NODELIST",
        "debug*       up   infinite      2   idle n[1-2]"]
    probe = ('echo "$SLURM_PROCID $SLURM_LOCALID $SLURM_NODEID $SLURM_NTASKS '
             '$(hostname) $(getent hosts n1 | cut -d" " -f1) $(readlink /proc/self/ns/mnt)"')
    result = cluster.run("srun", "--nodes=2", "--ntasks=4", "sh", "-c", probe)
    rows = sorted(line.split() for line in result.stdout.splitlines())
    assert [row[:5] for row in rows] == [["0", "0", "0", "4", "n1"], ["1", "1", "0", "4", "n1"],
                                          ["2", "0", "1", "4", "n2"], ["3", "1", "1", "4", "n2"]]
    assert cluster.spec is not None
    assert {row[5] for row in rows} == {cluster.spec.nodes[0].address}  # n1 resolves
    mounts: dict[str, set[str]] = {row[4]: set() for row in rows}
    for row in rows:
        mounts[row[4]].add(row[6])
    assert all(len(m) == 1 for m in mounts.values()) and mounts["n1"] != mounts["n2"]


def test_docs_job_script_trains_on_two_hosts(uninterrupted: TrainRun) -> None:
    """``sbatch netdist_job.sbatch python3 slurm_train.py``: 4 ranks on 2 hosts, the
    all-reduce right, every replica the same weights, and the output the page shows."""
    output = uninterrupted.output
    assert f"run 0 of job {uninterrupted.job_id} on n[1-2]: python3 slurm_train.py\n" in output
    assert ("4 ranks on 2 hosts (n1: ranks [0, 1], n2: ranks [2, 3]); "
            "all-reduce of rank + 1 = 10\n") in output
    final = uninterrupted.final_lines()
    assert sorted(final) == [0, 1, 2, 3], output
    assert [final[r][0] for r in range(4)] == ["n1", "n1", "n2", "n2"]
    assert len({weights for _, _, weights in final.values()}) == 1
    assert _masked(output, uninterrupted.job_id) == _masked(_docs_output("netdist-1.out"), 1)


def _docs_output(name: str) -> str:
    """The text block docs/slurm.md shows after ``cat NAME``."""
    text = DOCS_PAGE.read_text(encoding="utf-8")
    match = re.search(rf"^```text\n\$ cat {re.escape(name)}\n(.*?)^```", text, re.M | re.S)
    assert match, f"docs/slurm.md shows no text block starting with '$ cat {name}'"
    return match.group(1)


def _masked(output: str, job_id: int) -> list[str]:
    """The lines, sorted, with what differs between runs and machines masked: the job id,
    the losses and the weights' digest (float rounding may differ across CPUs)."""
    lines = []
    for line in output.splitlines():
        line = line.replace(f"job {job_id} ", "job J ")
        line = re.sub(r"loss [0-9.]+", "loss L", line)
        lines.append(re.sub(r"weights [0-9a-f]{16}", "weights W", line))
    return sorted(lines)


def test_netdist_worker_demo_under_srun(cluster: SlurmCluster, tmp_path: Path) -> None:
    """The page's interactive lines: salloc, the two exports, ``srun netdist worker``;
    the demo reaches its usual accuracy (>= 95% after its 20 epochs)."""
    salloc = shlex.split(INTERACTIVE[0])
    result = cluster.run(*salloc, "bash", "-euo", "pipefail", "-c", "\n".join(INTERACTIVE[1:]),
                         cwd=tmp_path, timeout=JOB_TIMEOUT)
    out = result.stdout
    assert "netdist demo: 4 training ranks, aggregator ring" in out, out + result.stderr
    assert re.search(r"^epoch 20/20  step   240/240  loss ", out, re.M), out
    match = re.search(r"^final test accuracy: (\d+\.\d)%$", out, re.M)
    assert match and float(match.group(1)) >= 95.0, out


def test_torch_ddp_matches_one_process(cluster: SlurmCluster, tmp_path: Path) -> None:
    """``sbatch netdist_job.sbatch python3 ddp_train.py``: DDP on backend netdist, 2 nodes
    x 2 tasks; the replicas agree bitwise and match one process trained on every batch."""
    where = _job_dir(tmp_path)
    job_id = _submit(cluster, SUBMIT_DDP, where)
    job = cluster.wait_finished(job_id, JOB_TIMEOUT)
    output = (where / f"netdist-{job_id}.out").read_text()
    assert (job.state, job.exit_code) == ("COMPLETED", 0), output
    lines = parse_ddp_lines(output)
    assert [(line.rank, line.world, line.host, line.backend) for line in lines] == [
        (0, 4, "n1", "netdist"), (1, 4, "n1", "netdist"), (2, 4, "n2", "netdist"),
        (3, 4, "n2", "netdist")], output
    assert all(line.identical for line in lines)
    assert len({line.weights_sum for line in lines}) == 1
    assert lines[0].weights_sum == pytest.approx(reference_weights_sum(4), abs=1e-4)


def _srun_env(cluster: SlurmCluster) -> dict[str, str]:
    """What the page's job script exports, for an srun started from the head (a 2-node
    step on this cluster always starts on n1, where rank 0 runs)."""
    return cluster.environment(NETDIST_COORDINATOR="n1:29400",
                               NETDIST_TOKEN=secrets.token_hex(32), NETDIST_TIMEOUT="30")


def test_shared_memory_inside_a_node_tcp_across(cluster: SlurmCluster, tmp_path: Path) -> None:
    """A 4 MiB all-reduce: each node's two tasks share memory (no payload byte between
    them on TCP) and each task sends exactly half the array to the other node, so each
    node's link carries 2(H-1)/H x S = S, the bound."""
    size = 4 << 20
    result = cluster.run("srun", "--nodes=2", "--ntasks-per-node=2", "python3", "-m",
                         "tests.scheduler.hosts_worker", str(size // 4), cwd=tmp_path,
                         env=_srun_env(cluster), timeout=JOB_TIMEOUT)
    reports = sorted((json.loads(line) for line in result.stdout.splitlines()),
                     key=lambda r: r["rank"])
    assert [(r["rank"], r["host"]) for r in reports] == [(0, "n1"), (1, "n1"), (2, "n2"),
                                                          (3, "n2")], result.stdout
    for report in reports:
        assert report["correct"] and report["local_mode"] == "hierarchical", report
        assert report["own_host_sent"] < 1024, report  # control messages only
        assert report["other_hosts_sent"] == [size // 2], report


@pytest.mark.parametrize("kill_on_bad_exit", [1, 0])
def test_killed_task_ends_the_step_naming_it(cluster: SlurmCluster, tmp_path: Path,
                                             kill_on_bad_exit: int) -> None:
    """Task 3 SIGKILLs itself in the middle of the all-reduces. Every survivor's
    PeerLostError names rank 3; with --kill-on-bad-exit=1 Slurm also terminates the step
    at the first bad exit, with 0 the survivors end it themselves. Either way the step
    ends in seconds and the job is FAILED."""
    name = f"kill-{kill_on_bad_exit}"
    started = time.monotonic()
    result = cluster.run("srun", f"--job-name={name}", "--nodes=2", "--ntasks-per-node=2",
                         "--label", f"--kill-on-bad-exit={kill_on_bad_exit}", "python3", "-m",
                         "tests.scheduler.kill_worker", "3", cwd=tmp_path,
                         env=_srun_env(cluster), timeout=JOB_TIMEOUT, check=False)
    elapsed = time.monotonic() - started
    report = f"exit {result.returncode}\n{result.stdout}{result.stderr}"
    assert result.returncode != 0 and elapsed < 30.0, report
    assert "srun: error: n2: task 3: Killed" in result.stderr, report
    for survivor in (0, 1, 2):
        assert re.search(rf"^{survivor}: LOST rank 3: ", result.stdout, re.M), report
    terminated = "Terminating StepId" in result.stderr
    assert terminated == bool(kill_on_bad_exit), report
    if not kill_on_bad_exit:  # the survivors ended themselves: nothing was terminated
        assert not re.search(r"tasks? [\d,-]+: Terminated", result.stderr), report
        assert "Exited with exit code 1" in result.stderr, report
    job = max((j for j in cluster.jobs() if j.name == name), key=lambda j: j.job_id)
    job = cluster.wait_finished(job.job_id, 30.0)
    assert job.state == "FAILED", job


def test_requeued_job_resumes_from_its_checkpoint(cluster: SlurmCluster, tmp_path: Path,
                                                  uninterrupted: TrainRun) -> None:
    """The docs' job, slowed by ``--pause``, is requeued (``scontrol requeue``) once a few
    steps are checkpointed: Slurm ends the run, queues the job again with
    SLURM_RESTART_COUNT=1 and, released at once (``scontrol update StartTime=now``, as
    Slurm otherwise waits its cred_expire, 120 s), the script resumes from the newest
    checkpoint and ends with the uninterrupted run's losses and weights."""
    where = _job_dir(tmp_path)
    job_id = _submit(cluster, SUBMIT_TRAIN, where, "--pause", "0.25")
    checkpoints = where / f"ckpt-{job_id}"
    deadline = time.monotonic() + JOB_TIMEOUT
    while not any(step >= 2 for step, _ in list_checkpoints(checkpoints)):
        assert time.monotonic() < deadline, f"no step 2 checkpoint: {cluster.job(job_id)}"
        assert not cluster.job(job_id).finished, cluster.job(job_id)
        time.sleep(0.1)
    cluster.run("scontrol", "requeue", str(job_id))
    queued = cluster.wait_job(job_id, lambda j: j.state == "PENDING", JOB_TIMEOUT,
                              "back to the queue")
    assert (queued.restarts, queued.reason) == (1, "BeginTime"), queued
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    job = cluster.wait_finished(job_id, JOB_TIMEOUT)
    output = (where / f"netdist-{job_id}.out").read_text()
    assert (job.state, job.exit_code, job.restarts) == ("COMPLETED", 0, 1), output
    assert f"run 0 of job {job_id} " in output and f"run 1 of job {job_id} " in output
    assert f"*** JOB {job_id} ON n1 CANCELLED AT" in output and "DUE TO JOB REQUEUE" in output
    resumed = re.search(rf"^restart 1: resuming after step (\d+) from ckpt-{job_id}$", output,
                        re.M)
    assert resumed and 2 <= int(resumed.group(1)) < 20, output
    assert _final_lines(output) == uninterrupted.final_lines(), output
