"""Elastic training with real processes over real sockets: members are SIGKILLed at every
phase of a step, during the agreement and during a joiner's state fetch, two at a time,
and a minority is cut off; the job carries on, every member ends bitwise equal, and every
sample is used exactly once per data epoch (counted through the all-reduce itself)."""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest

from tests.elastic.cluster import ElasticCluster

STEP_SECONDS = "0.03"


@pytest.fixture
def cluster_factory(tmp_path: Path):  # type: ignore[no-untyped-def]
    made: list[ElasticCluster] = []

    def make(n: int, **kwargs):  # type: ignore[no-untyped-def]
        env = {"ELASTIC_TEST_STEP_SECONDS": STEP_SECONDS, **kwargs.pop("env", {})}
        cluster = ElasticCluster(tmp_path, n, env=env, **kwargs)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.close()


def assert_in_step(cluster: ElasticCluster, slots: list[int], steps: int) -> None:
    """Every slot finished all steps with bitwise-equal weights; samples used once."""
    finals = {slot: cluster.final(slot) for slot in slots}
    reference = finals[slots[0]]
    for slot, final in finals.items():
        assert int(final["step"]) == int(reference["step"]) >= steps, slot
        assert np.array_equal(final["w"], reference["w"]), f"slot {slot} diverged"
        assert np.array_equal(final["used"], reference["used"]), slot
    used = reference["used"]
    epoch, cursor = int(reference["data_epoch"]), int(reference["cursor"])
    assert (used[:epoch] == 1).all(), "a sample was used twice or never in a full epoch"
    partial = used[epoch]
    handed_back = int(reference["deferred"])  # ids of a resumed step, still to be used
    assert int(partial.sum()) == cursor - handed_back and set(np.unique(partial)) <= {0, 1}
    assert not used[epoch + 1:].any()


def run_with_failure(make, n: int, victim: int, *, die: str = "",  # type: ignore[no-untyped-def]
                     restart: bool = True, steps: int = 60) -> ElasticCluster:
    cluster = make(n, steps=steps, env={"ELASTIC_TEST_UNTIL_WORLD": str(n)} if restart else {})
    extra = {f"s{victim}": {"ELASTIC_TEST_DIE": die}} if die else {}
    cluster.start_all(**extra)
    if die:
        cluster.wait_until(f"slot {victim} to die at {die}",
                           lambda: cluster.procs[victim].poll() is not None)
    else:
        cluster.wait_step(victim, 6)
        cluster.kill(victim)
    survivor = (victim + 1) % n
    before = cluster.wait_until("a survivor's progress", lambda: cluster.progress(survivor))
    after = cluster.wait_step(survivor, before["step"] + 1)
    assert after["world_size"] == n - 1 or after["epoch"] > before["epoch"]
    if restart:
        cluster.start(victim)
    codes = cluster.wait_all()
    assert codes[victim] == 0 if restart else True
    assert all(code == 0 for slot, code in codes.items() if slot != victim or restart), codes
    return cluster


@pytest.mark.parametrize("victim, die", [
    (2, ""),                 # killed from outside, wherever it was
    (0, ""),                 # the first member, which leads agreements
    (1, "compute:6"),        # before its all-reduce
    (3, "reduce:6"),         # after the gradient all-reduce, before the vote
    (2, "vote:6"),           # after the vote: the step committed everywhere else
])
def test_killed_member_is_replaced_and_the_job_stays_in_step(cluster_factory, victim: int,
                                                             die: str) -> None:
    cluster = run_with_failure(cluster_factory, 4, victim, die=die)
    assert_in_step(cluster, [0, 1, 2, 3], 60)
    rejoined = cluster.final(victim)["changes"]
    epoch, slots, _, fetched, donors = rejoined[0]
    assert fetched > 0 and donors == 2, rejoined  # two of the three survivors donate
    survivor = cluster.final((victim + 1) % 4)
    assert [len(c[1]) for c in survivor["changes"]] == [4, 3, 4], survivor["changes"]
    if die.startswith("compute"):
        # every survivor was waiting in the step's all-reduce: the step went on without
        # the lost member's share instead of starting over (its ids were handed back)
        assert int(survivor["resumed"]) >= 1


def test_two_members_killed_at_once_majority_carries_on(cluster_factory) -> None:
    cluster = cluster_factory(5, steps=50)
    cluster.start_all()
    cluster.wait_step(1, 6)
    cluster.procs[1].send_signal(signal.SIGKILL)
    cluster.kill(3)
    cluster.procs[1].wait(10)
    codes = cluster.wait_all([0, 2, 4])
    assert codes == {0: 0, 2: 0, 4: 0}
    assert_in_step(cluster, [0, 2, 4], 50)
    assert [len(c[1]) for c in cluster.final(0)["changes"]][-1] == 3


def test_member_killed_while_agreeing(cluster_factory) -> None:
    cluster = cluster_factory(5, steps=50)
    cluster.start_all(s2={"ELASTIC_TEST_DIE": "agree:1"})
    cluster.wait_step(4, 6)
    cluster.kill(4)  # slot 2 dies as soon as it asks for the next agreement
    cluster.wait_until("slot 2 to die", lambda: cluster.procs[2].poll() is not None)
    codes = cluster.wait_all([0, 1, 3])
    assert codes == {0: 0, 1: 0, 3: 0}
    assert_in_step(cluster, [0, 1, 3], 50)


def test_donor_killed_during_a_joiners_fetch(cluster_factory) -> None:
    cluster = cluster_factory(4, steps=70, env={"ELASTIC_TEST_UNTIL_WORLD": "3"})
    cluster.start_all(s1={"ELASTIC_TEST_DIE": "fetch:1"})
    cluster.wait_step(3, 6)
    cluster.kill(3)
    cluster.start(3)  # its fetch meets slot 1 dying mid-transfer; it fetches again
    codes = cluster.wait_all([0, 2, 3])
    assert codes == {0: 0, 2: 0, 3: 0}
    assert cluster.procs[1].wait(30) == -signal.SIGKILL  # it died sending the state
    assert_in_step(cluster, [0, 2, 3], 70)


def test_minority_side_stops_with_a_named_error(cluster_factory) -> None:
    cluster = cluster_factory(3, steps=100000)
    cluster.start_all()
    cluster.wait_step(0, 3)
    for slot in (1, 2):  # cut off from slot 0: stopped, silent, never answering
        cluster.procs[slot].send_signal(signal.SIGSTOP)
    try:
        code = cluster.procs[0].wait(60)
    finally:
        for slot in (1, 2):
            cluster.kill(slot)
    assert code != 0
    log = (cluster.dir / "slot0.0.log").read_text()
    assert "QuorumLostError" in log and "not a strict majority" in log, log[-2000:]


def test_replacement_with_a_wrong_token_is_refused(cluster_factory) -> None:
    cluster = cluster_factory(3, steps=60)
    cluster.start_all()
    cluster.wait_step(2, 4)
    cluster.kill(2)
    cluster.start(2, NETDIST_TOKEN="f" * 32)  # not this job's token
    assert cluster.procs[2].wait(60) != 0
    log = cluster.logs[-1].read_text()
    assert "AuthenticationError" in log, log[-2000:]
    assert cluster.wait_all([0, 1]) == {0: 0, 1: 0}
    assert_in_step(cluster, [0, 1], 60)


@pytest.mark.parametrize("stopped", [2, 0])  # 0: the leader, which then leads nobody
def test_stopped_member_is_dropped_then_rejoins_when_it_resumes(cluster_factory,
                                                                stopped: int) -> None:
    cluster = cluster_factory(4, steps=90, env={"ELASTIC_TEST_UNTIL_WORLD": "4"})
    cluster.start_all()
    cluster.wait_step(stopped, 5)
    cluster.procs[stopped].send_signal(signal.SIGSTOP)
    other = (stopped + 1) % 4
    before = cluster.wait_until("progress", lambda: cluster.progress(other))
    # detected by silence (NETDIST_ELASTIC_TIMEOUT=3 s): the others go on without it
    cluster.wait_until("three members", lambda: (
        (p := cluster.progress(other)) is not None and p["world_size"] == 3
        and p["step"] > before["step"] and p))
    cluster.procs[stopped].send_signal(signal.SIGCONT)
    # it finds its epoch gone (a stopped leader finds no majority behind it), asks in
    # as a joiner and fetches the state it missed
    cluster.wait_until("four members again", lambda: (
        (p := cluster.progress(stopped)) is not None and p["world_size"] == 4
        and p["epoch"] > 2 and p))
    assert cluster.wait_all() == {0: 0, 1: 0, 2: 0, 3: 0}
    assert_in_step(cluster, [0, 1, 2, 3], 90)
    assert cluster.restarts == {0: 0, 1: 0, 2: 0, 3: 0}  # nobody was restarted


def test_netdist_launch_elastic_restarts_only_the_dead_slot(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from tests.elastic.cluster import ROOT, ElasticCluster

    env = {**os.environ, "PYTHONPATH": str(ROOT), "ELASTIC_TEST_DIR": str(tmp_path),
           "ELASTIC_TEST_STEPS": "60", "ELASTIC_TEST_STEP_SECONDS": STEP_SECONDS,
           "ELASTIC_TEST_DIE": "reduce:5", "ELASTIC_TEST_DIE_SLOT": "1",
           "NETDIST_ELASTIC_TIMEOUT": "3", "ELASTIC_TEST_UNTIL_WORLD": "4"}
    result = subprocess.run(
        [sys.executable, "-m", "netdist", "launch", "--elastic", "-n", "4",
         "--max-restarts", "1", "--timeout", "120", "--", sys.executable, "-m",
         "tests.elastic._member"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "slot 1" in result.stderr and "restarting it (restart 1 of 1)" in result.stderr
    assert result.stderr.count("restarting it") == 1
    view = ElasticCluster.__new__(ElasticCluster)
    view.dir = tmp_path
    assert_in_step(view, [0, 1, 2, 3], 60)
    assert view.final(1)["changes"][0][3] > 0  # the restarted slot fetched the state
