"""``docker/up.sh``, the README's command for the compose job (issue 12, item 18), against
real containers: it exits non-zero when any rank fails (plain ``docker-compose up`` exits
0 then), with the exit code of the first container that failed, naming every failed one
in the order they failed; and a second run of a finished job trains nothing and says so.

Each test runs its own compose project and removes it, volume included. Jobs are small
(2 workers, 1 epoch of batch 16: 45 steps) and every wait is bounded.
"""

from __future__ import annotations

import os
import re
import signal

import pytest

from tests.docker.cluster import CHECKPOINT_RE, REPO, Cluster, exit_codes, services_logs

pytestmark = [pytest.mark.docker, pytest.mark.timeout(600),
              pytest.mark.usefixtures("netdist_image")]

PAIR = ("worker-0", "worker-1")
SMALL = {"NETDIST_WORKERS": "2", "NETDIST_EPOCHS": "1", "NETDIST_BATCH_SIZE": "16",
         "NETDIST_CHECKPOINT_EVERY": "20"}
LONG = {**SMALL, "NETDIST_EPOCHS": "5000"}  # cannot finish while a test waits
RUN_TIMEOUT = 300.0  # a whole (small) training run, container start included
SUMMARY = "netdist up: "
KILLED = "(SIGKILL: docker kill, docker stop's timeout, or out of memory)"


def _summary(output: str) -> list[str]:
    """The lines the script itself prints about how the containers ended."""
    return [line[len(SUMMARY):] for line in output.splitlines() if line.startswith(SUMMARY)]


def _rank0_lines(output: str) -> list[str]:
    return [line.split(" | ", 1)[1] for line in output.splitlines()
            if line.startswith("worker-0 | ")]


def test_up_exits_with_the_code_of_the_failed_containers() -> None:
    """Every container exits 64 (network shaping that cannot be applied): so does the
    script, naming each container."""
    cluster = Cluster("upfail", {**SMALL, "NETDIST_NETEM": "no-such-option 1"})
    job = cluster.run_job("--no-build", *PAIR)
    try:
        code = job.finish(RUN_TIMEOUT)
        assert code == 64, job.output
        assert exit_codes(cluster.wait_exit(PAIR, 60)) == {s: 64 for s in PAIR}
        summary = _summary(job.output)
        assert summary[:2] == ["worker-0 exited 64 (network shaping could not be applied)",
                               "worker-1 exited 64 (network shaping could not be applied)"]
        assert re.fullmatch(r"job FAILED: worker-[01] exited 64 \(network shaping could not "
                            r"be applied\); then worker-[01] exited 64 \(.*\)", summary[2]), summary
        # each container's own output is streamed, prefixed with its service name
        assert "worker-1 | netdist-entrypoint: could not apply netem 'no-such-option 1'" \
            in job.output
    finally:
        job.close()
        cluster.down()


def test_up_fails_when_a_rank_is_killed_mid_training() -> None:
    """worker-1 SIGKILLed after the first checkpoint: worker-0 loses it and exits 1, and
    the script exits 137, the code of the container that failed first."""
    cluster = Cluster("upkill", LONG)
    job = cluster.run_job("--no-build", *PAIR)
    try:
        job.wait_for(r"(?m)^worker-0 \| checkpoint: step \d+", RUN_TIMEOUT)
        cluster.kill("worker-1")
        code = job.finish(120)
        assert code == 137, job.output
        assert exit_codes(cluster.wait_exit(PAIR, 60)) == {"worker-0": 1, "worker-1": 137}
        assert _summary(job.output) == [
            "worker-0 exited 1",
            f"worker-1 exited 137 {KILLED}",
            f"job FAILED: worker-1 exited 137 {KILLED}; then worker-0 exited 1"]
        assert re.search(r"(?m)^worker-0 \| netdist worker: error: .*rank 1", job.output), \
            job.output
        assert "final test accuracy" not in job.output
    finally:
        job.close()
        cluster.down()


def test_ctrl_c_stops_the_job_and_exits_130() -> None:
    """SIGINT to the script's process group (what Ctrl-C in a terminal sends) stops every
    container of the job, and the script reports how they ended and exits 130."""
    cluster = Cluster("upint", LONG)
    job = cluster.run_job("--no-build", *PAIR)
    try:
        job.wait_for(r"(?m)^worker-0 \| checkpoint: step \d+", RUN_TIMEOUT)
        os.killpg(job.proc.pid, signal.SIGINT)
        assert job.finish(120) == 130, job.output
        exits = cluster.wait_exit(PAIR, 60)
        assert all(e.code != 0 for e in exits.values()), exits  # stopped, not finished
        summary = _summary(job.output)
        assert summary[0] == "interrupted: stopping the job's containers", summary
        assert summary[-1] == ("job interrupted: its containers were stopped (run again to "
                               "resume from the latest checkpoint)"), summary
        assert "final test accuracy" not in job.output
    finally:
        job.close()
        cluster.down()


def test_a_second_up_of_a_finished_job_trains_nothing_and_says_so() -> None:
    """Run 1 trains and exits 0. Run 2 (same job, same checkpoint volume) finds the
    final checkpoint: rank 0 says there is nothing to train, reports the trained model's
    accuracy again, nothing is written, and every container exits 0. Run 3 asks for one
    more epoch and trains exactly that, from the finished checkpoint."""
    cluster = Cluster("upagain", SMALL)
    runs = []
    try:
        first = cluster.run_job("--no-build", *PAIR)
        runs.append(first)
        assert first.finish(RUN_TIMEOUT) == 0, first.output
        log = _rank0_lines(first.output)
        assert "no checkpoint in /checkpoints/test; starting from scratch" in log
        assert [int(s) for s in CHECKPOINT_RE.findall("\n".join(log))] == [20, 40, 45]
        accuracy_line = log[-1]
        assert accuracy_line.startswith("final test accuracy: "), log
        saved = cluster.checkpoints()
        assert saved["latest"] == "step_000045" and saved["tensors"], saved

        again = cluster.run_job("--no-build", *PAIR)
        runs.append(again)
        assert again.finish(RUN_TIMEOUT) == 0, again.output
        log = _rank0_lines(again.output)
        assert log[0].startswith("netdist-node: worker-0 is rank 0 of 2"), log  # this run only
        assert log[1] == ("nothing to train: the checkpoint in /checkpoints/test (step 45) is "
                          "the end of epoch 1 of 1; raise the epochs to train longer, or use "
                          "a new checkpoint directory to start over"), log
        assert not [line for line in log if line.startswith(("epoch", "checkpoint:"))], log
        assert log[-1] == accuracy_line
        assert _summary(again.output)[-1] == "job finished: all 2 containers exited 0"
        assert cluster.checkpoints() == saved  # nothing written, nothing replaced

        longer = cluster.run_job("--no-build", *PAIR, env={"NETDIST_EPOCHS": "2"})
        runs.append(longer)
        assert longer.finish(RUN_TIMEOUT) == 0, longer.output
        log = _rank0_lines(longer.output)
        assert "resumed from /checkpoints/test at step 45 (epoch 2, batch 0)" in log, log
        assert [line.split()[1] for line in log if line.startswith("epoch")] == ["2/2"], log
        assert cluster.checkpoints()["latest"] == "step_000090"
    except AssertionError:
        print(services_logs(cluster, PAIR))
        raise
    finally:
        for run in runs:
            run.close()
        cluster.down()


def test_readme_documents_the_command_for_both_composes() -> None:
    """The docs' Docker page (docs/docker.md, linked from the README) gives docker/up.sh
    (either Compose) and says what a second up does; the compose file names no container
    after a rank."""
    section = (REPO / "docs" / "docker.md").read_text(encoding="utf-8")
    assert section.startswith("# Docker compose\n")
    assert "(docs/docker.md)" in (REPO / "README.md").read_text(encoding="utf-8")
    assert "docker/up.sh --no-build" in section
    assert "docker-compose" in section and "docker compose" in section
    assert "nothing to train" in section
    compose = (REPO / "docker-compose.yml").read_text(encoding="utf-8")
    assert not re.search(r"(?m)^  (rank\d|ps\d|worker\d)\w*:", compose)
