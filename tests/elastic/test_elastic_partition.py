"""A real partition: five members on two hosts (network namespaces on one switch, 3 + 2),
and the link of the two-member host is cut. The side with a strict majority of the last
membership (3 of 5) carries on and finishes bitwise in step with every sample used once;
the other side reaches nobody and stops with ``QuorumLostError``."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from netdist.netlab import Cluster, rank_env
from tests.elastic.cluster import ROOT, ElasticCluster
from tests.elastic.test_elastic_processes import assert_in_step
from tests.netlab import require_netlab

pytestmark = pytest.mark.slow

PORT = 29710


def test_partition_majority_carries_on_minority_stops(tmp_path: Path) -> None:
    require_netlab()
    with Cluster.create("3,2") as cluster:
        slots = range(5)
        seeds = ",".join(f"{cluster.address(cluster.layout.host_of(s))}:{PORT + s}"
                         for s in slots)
        token = secrets.token_hex(16)
        view = ElasticCluster.__new__(ElasticCluster)  # reads the members' files
        view.dir, view.timeout, view.procs, view.logs = tmp_path, 90.0, {}, []
        for slot in slots:
            host = cluster.host_of(slot)
            env = rank_env(host, NETDIST_TOKEN=token, NETDIST_JOB_ID="partition",
                           NETDIST_WORLD_SIZE="5", NETDIST_RANK=str(slot),
                           NETDIST_ELASTIC="1", NETDIST_ELASTIC_SLOT=str(slot),
                           NETDIST_ELASTIC_SEEDS=seeds, NETDIST_ELASTIC_TIMEOUT="2",
                           NETDIST_TIMEOUT="60", ELASTIC_TEST_DIR=str(tmp_path),
                           ELASTIC_TEST_STEPS="80", ELASTIC_TEST_STEP_SECONDS="0.03",
                           PYTHONPATH=str(ROOT), ELASTIC_TEST_LOG="1")
            log = tmp_path / f"slot{slot}.0.log"
            view.logs.append(log)
            with open(log, "wb") as sink:
                view.procs[slot] = cluster.lab.popen(
                    host, [sys.executable, "-m", "tests.elastic._member"], env=env,
                    cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
        try:
            view.wait_step(0, 5)
            view.wait_step(4, 5)
            cluster.cut(1)  # slots 3 and 4 are on host 1
            codes = view.wait_all([3, 4], timeout=90)
            assert all(code != 0 for code in codes.values()), codes
            for slot in (3, 4):
                log = (tmp_path / f"slot{slot}.0.log").read_text()
                assert "QuorumLostError" in log and "not a strict majority" in log, log[-3000:]
            assert view.wait_all([0, 1, 2], timeout=90) == {0: 0, 1: 0, 2: 0}
            assert_in_step(view, [0, 1, 2], 80)
            assert view.final(0)["changes"][-1][1] == [0, 1, 2]
        finally:
            for proc in view.procs.values():
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(10)
