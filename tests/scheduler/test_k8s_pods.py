"""The pods ``tests.scheduler.k8s_pods`` makes of a manifest, and what it refuses (pure)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.scheduler.k8s_pods import indexed_job_pods, pytorchjob_pods

SECRETS = {("tok", "token"): "s3cret-token-value"}
CONTAINER = {"name": "pytorch", "image": "x", "command": ["python3", "train.py"],
             "ports": [{"name": "pytorchjob-port", "containerPort": 23456}],
             "env": [{"name": "A", "value": "1"},
                     {"name": "NETDIST_TOKEN",
                      "valueFrom": {"secretKeyRef": {"name": "tok", "key": "token"}}}]}
PYTORCHJOB: dict[str, Any] = {
    "kind": "PyTorchJob", "metadata": {"name": "j"},
    "spec": {"pytorchReplicaSpecs": {
        "Master": {"replicas": 1, "template": {"spec": {"containers": [CONTAINER]}}},
        "Worker": {"replicas": 2, "template": {"spec": {"containers": [CONTAINER]}}}}}}
INDEXED: list[Any] = [
    {"kind": "Service", "metadata": {"name": "svc"}, "spec": {"clusterIP": "None"}},
    {"kind": "Job", "metadata": {"name": "job"},
     "spec": {"completionMode": "Indexed", "completions": 3, "template": {"spec": {
         "subdomain": "svc", "containers": [{"name": "c", "command": ["netdist", "worker"],
                                             "env": [{"name": "B", "value": 2}]}]}}}}]


def test_pytorchjob_env_is_the_operators() -> None:
    pods = pytorchjob_pods([PYTORCHJOB], SECRETS)
    assert [p.name for p in pods] == ["j-master-0", "j-worker-0", "j-worker-1"]
    assert [p.env["RANK"] for p in pods] == ["0", "1", "2"]
    assert pods[2].env == {
        "A": "1", "NETDIST_TOKEN": "s3cret-token-value", "PYTHONUNBUFFERED": "1",
        "MASTER_PORT": "23456", "PET_MASTER_PORT": "23456", "MASTER_ADDR": "j-master-0",
        "PET_MASTER_ADDR": "j-master-0", "WORLD_SIZE": "3", "RANK": "2",
        "PET_NODE_RANK": "2", "PET_NNODES": "3"}
    with_nproc = copy.deepcopy(PYTORCHJOB)
    with_nproc["spec"]["nprocPerNode"] = "4"
    pod = pytorchjob_pods([with_nproc], SECRETS)[0]
    assert (pod.env["WORLD_SIZE"], pod.env["PET_NPROC_PER_NODE"], pod.env["PET_NNODES"]) == (
        "12", "4", "3")


def test_indexed_job_pods_get_their_index_and_name() -> None:
    pods = indexed_job_pods(INDEXED, {})
    assert [(p.name, p.hostname, p.env["JOB_COMPLETION_INDEX"]) for p in pods] == [
        ("job-0", "job-0.svc", "0"), ("job-1", "job-1.svc", "1"), ("job-2", "job-2.svc", "2")]
    assert pods[0].env["B"] == "2" and pods[0].command == ("netdist", "worker")


def test_what_the_controllers_would_not_run_is_refused() -> None:
    with pytest.raises(ValueError, match="did not create"):
        pytorchjob_pods([PYTORCHJOB], {})
    no_port = copy.deepcopy(PYTORCHJOB)
    del no_port["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0][
        "ports"]
    with pytest.raises(ValueError, match="no port named 'pytorchjob-port'"):
        pytorchjob_pods([no_port], SECRETS)
    elastic = copy.deepcopy(PYTORCHJOB)
    elastic["spec"]["elasticPolicy"] = {"minReplicas": 1}
    with pytest.raises(ValueError, match="elasticPolicy"):
        pytorchjob_pods([elastic], SECRETS)
    not_headless = copy.deepcopy(INDEXED)
    not_headless[0]["spec"]["clusterIP"] = "10.0.0.1"
    with pytest.raises(ValueError, match="not a headless Service"):
        indexed_job_pods(not_headless, {})
    expanding = copy.deepcopy(INDEXED)
    expanding[1]["spec"]["template"]["spec"]["containers"][0]["env"] = [
        {"name": "C", "value": "$(B)x"}]
    with pytest.raises(ValueError, match=r"\$\(VAR\)"):
        indexed_job_pods(expanding, {})
