"""The test cluster's Slurm files, its reading of Slurm's output and its report of what is
missing, all without Slurm: ``tests.scheduler.slurm_conf`` and ``slurm_state`` are pure."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scheduler.slurm_conf import SlurmNode, SlurmPaths, SlurmSpec, hosts_file, slurm_conf
from tests.scheduler.slurm_state import parse_job, parse_node_states

SPEC = SlurmSpec(head="head", head_address="10.78.0.1",
                 nodes=(SlurmNode("n1", "10.78.0.2"), SlurmNode("n2", "10.78.0.3")))

# `scontrol show job --oneliner` of a requeued job (Slurm 22.05), shortened
REQUEUED = ("JobId=6 JobName=netdist UserId=root(0) GroupId=root(0) MCS_label=N/A "
            "Priority=4294901754 Nice=0 Account=(null) QOS=(null) JobState=PENDING "
            "Reason=BeginTime Dependency=(null) Requeue=1 Restarts=1 BatchFlag=1 Reboot=0 "
            "ExitCode=0:0 RunTime=00:00:00 TimeLimit=UNLIMITED NodeList=(null) "
            "Command=/tmp/t/netdist_job.sbatch python3 slurm_train.py --pause 0.25")


def test_conf_keeps_every_file_under_the_root(tmp_path: Path) -> None:
    paths = SlurmPaths(tmp_path)
    conf = slurm_conf(SPEC, paths)
    assert "SlurmctldHost=head(10.78.0.1)\n" in conf
    assert "NodeName=n1 NodeAddr=10.78.0.2 NodeHostname=n1 CPUs=2 RealMemory=1000" in conf
    assert "PartitionName=debug Nodes=n1,n2 Default=YES" in conf
    assert f"AuthInfo=socket={tmp_path}/munge/munge.socket\n" in conf
    assert "ProctrackType=proctrack/pgid\n" in conf and "TaskPlugin=task/none\n" in conf
    for line in conf.splitlines():
        if "/" in line and not line.startswith(("#", "ProctrackType", "TaskPlugin",
                                                "JobAcctGatherType", "AccountingStorageType",
                                                "JobCompType", "SchedulerType", "SelectType=",
                                                "MailProg", "AuthType", "CredType")):
            assert str(tmp_path) in line, line  # no path outside the cluster's root
    assert set(paths.directories(SPEC)) >= {tmp_path / "spool" / "n1", tmp_path / "spool" / "n2"}


def test_hosts_file_names_every_machine() -> None:
    assert hosts_file(SPEC).splitlines() == [
        "127.0.0.1\tlocalhost", "10.78.0.1\thead", "10.78.0.2\tn1", "10.78.0.3\tn2"]


def test_spec_refuses_what_slurm_would() -> None:
    with pytest.raises(ValueError, match="at least one node"):
        SlurmSpec(head="head", head_address="10.0.0.1", nodes=())
    with pytest.raises(ValueError, match="distinct"):
        SlurmSpec(head="n1", head_address="10.0.0.1", nodes=(SlurmNode("n1", "10.0.0.2"),))


def test_parse_job_reads_state_restarts_and_exit() -> None:
    job = parse_job(REQUEUED)
    assert (job.job_id, job.name, job.state, job.reason, job.restarts) == (
        6, "netdist", "PENDING", "BeginTime", 1)
    assert not job.finished
    failed = parse_job(REQUEUED.replace("JobState=PENDING", "JobState=FAILED")
                       .replace("ExitCode=0:0", "ExitCode=143:15"))
    assert failed.finished and (failed.exit_code, failed.exit_signal) == (143, 15)
    with pytest.raises(ValueError, match="no ExitCode="):
        parse_job("JobId=1 JobName=x JobState=RUNNING")


def test_parse_node_states() -> None:
    assert parse_node_states("n1 idle\nn2 allocated\n") == {"n1": "idle", "n2": "allocated"}
    with pytest.raises(ValueError, match="NODE STATE"):
        parse_node_states("n1 idle extra")


def test_slurm_missing_names_the_programs_and_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the Slurm tests skip (or, in CI, fail) with when Slurm is not installed."""
    from tests.scheduler import slurm_cluster

    monkeypatch.setattr(slurm_cluster, "netlab_missing", lambda: None)
    monkeypatch.setattr(slurm_cluster.shutil, "which",
                        lambda name: None if name in ("slurmd", "munged") else f"/x/{name}")
    assert slurm_cluster.slurm_missing() == (
        "slurmd, munged not found: apt-get install slurmctld slurmd slurm-client munge "
        "(Debian/Ubuntu; .ci/run installs them)")
    monkeypatch.setattr(slurm_cluster, "netlab_missing", lambda: "network namespaces need root")
    assert slurm_cluster.slurm_missing() == "network namespaces need root"
