"""PURE: the pods two Kubernetes controllers would create from a manifest, as plain data.

No kubelet runs here, so the tests do the controllers' part: read the manifest, make one
``Pod`` per replica with the command, working directory and environment the controller
gives it, and start the command as a local process.

- **Indexed Job** (``batch/v1`` Job, ``completionMode: Indexed``): ``completions`` pods;
  pod ``i`` gets ``JOB_COMPLETION_INDEX=i`` after the container's own ``env`` and the
  hostname ``<job>-<i>``, reachable as ``<job>-<i>.<subdomain>`` through the headless
  Service named by ``spec.template.spec.subdomain`` (Kubernetes' Job documentation).
- **PyTorchJob** (Kubeflow training-operator v1, ``kubeflow.org/v1``): one pod per
  replica of ``Master`` then ``Worker``, named ``<job>-master-0``, ``<job>-worker-<i>``
  (a Service of the same name each). After the container's ``env`` the operator appends,
  in this order (pkg/controller.v1/pytorch/envvar.go and master.go, v1.9):
  ``PYTHONUNBUFFERED=1``; ``MASTER_PORT`` and ``PET_MASTER_PORT`` (the master container's
  port named ``pytorchjob-port``); ``MASTER_ADDR`` and ``PET_MASTER_ADDR``
  (``<job>-master-0``); ``WORLD_SIZE`` (replicas x ``nprocPerNode``, 1 unless set);
  ``RANK`` and ``PET_NODE_RANK`` (0 for the master, ``i + 1`` for worker ``i``);
  ``PET_NPROC_PER_NODE`` when ``nprocPerNode`` is set; ``PET_NNODES`` (replicas; no
  ``elasticPolicy``). The operator reads the container named ``pytorch``.

Only what the manifests here use is supported (``value``, and ``valueFrom.secretKeyRef``
resolved from ``secrets``); anything else raises ``ValueError`` naming the variable, so a
manifest never runs with a value the tests made up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Pod", "indexed_job_pods", "pytorchjob_pods", "PYTORCHJOB_PORT_NAME"]

PYTORCHJOB_PORT_NAME = "pytorchjob-port"
PYTORCHJOB_CONTAINER = "pytorch"
_REPLICA_TYPES = ("Master", "Worker")


@dataclass(frozen=True, slots=True)
class Pod:
    """One pod as its controller creates it."""

    name: str
    hostname: str
    """The name other pods reach it by (DNS through a headless Service)."""
    command: tuple[str, ...]
    working_dir: str | None
    env: Mapping[str, str]
    """The container's environment, later entries overriding earlier ones as in a pod."""


def _container_env(container: Mapping[str, Any], secrets: Mapping[tuple[str, str], str],
                   where: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for entry in container.get("env") or ():
        name = entry["name"]
        if "value" in entry:
            value = str(entry["value"])
        elif "secretKeyRef" in (entry.get("valueFrom") or {}):
            ref = entry["valueFrom"]["secretKeyRef"]
            key = (ref["name"], ref["key"])
            if key not in secrets:
                raise ValueError(f"{where}: {name} reads secret {key[0]!r} key {key[1]!r}, "
                                 "which the test did not create")
            value = secrets[key]
        else:
            raise ValueError(f"{where}: {name} is neither a value nor a secretKeyRef: {entry}")
        if "$(" in value:
            raise ValueError(f"{where}: {name}={value!r} refers to another variable; "
                             "expanding $(VAR) is not implemented here")
        env[name] = value
    return env


def _documents(documents: list[Any], kind: str) -> list[Mapping[str, Any]]:
    return [d for d in documents if isinstance(d, Mapping) and d.get("kind") == kind]


def _one(documents: list[Any], kind: str) -> Mapping[str, Any]:
    found = _documents(documents, kind)
    if len(found) != 1:
        raise ValueError(f"expected one {kind} in the manifest, found {len(found)}")
    return found[0]


def _the_container(template: Mapping[str, Any], name: str | None, where: str
                   ) -> Mapping[str, Any]:
    containers = template["spec"]["containers"]
    if name is not None:
        containers = [c for c in containers if c.get("name") == name]
    if len(containers) != 1:
        raise ValueError(f"{where}: expected one container{f' named {name!r}' if name else ''},"
                         f" found {len(containers)}")
    return containers[0]


def indexed_job_pods(documents: list[Any], secrets: Mapping[tuple[str, str], str]
                     ) -> list[Pod]:
    """The pods of the manifest's indexed Job, by completion index."""
    job = _one(documents, "Job")
    name, spec = job["metadata"]["name"], job["spec"]
    if spec.get("completionMode") != "Indexed":
        raise ValueError(f"Job {name} is not indexed (completionMode: Indexed)")
    template = spec["template"]
    subdomain = template["spec"].get("subdomain")
    services = {s["metadata"]["name"]: s for s in _documents(documents, "Service")}
    if subdomain not in services or services[subdomain]["spec"].get("clusterIP") != "None":
        raise ValueError(f"Job {name}: subdomain {subdomain!r} is not a headless Service of "
                         "the manifest, so its pods' names would not resolve")
    container = _the_container(template, None, f"Job {name}")
    pods = []
    for index in range(int(spec["completions"])):
        env = _container_env(container, secrets, f"Job {name}")
        env["JOB_COMPLETION_INDEX"] = str(index)
        pods.append(Pod(f"{name}-{index}", f"{name}-{index}.{subdomain}",
                        tuple(container["command"]), container.get("workingDir"), env))
    return pods


def pytorchjob_pods(documents: list[Any], secrets: Mapping[tuple[str, str], str]
                    ) -> list[Pod]:
    """The pods of the manifest's PyTorchJob: the master, then the workers."""
    job = _one(documents, "PyTorchJob")
    name, spec = job["metadata"]["name"], job["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    if spec.get("elasticPolicy") is not None:
        raise ValueError(f"PyTorchJob {name}: elasticPolicy (PET_NNODES as a range, "
                         "PET_RDZV_*) is not modelled here")
    if "Master" not in replicas:
        raise ValueError(f"PyTorchJob {name} has no Master replica (it sets MASTER_ADDR)")
    master = _the_container(replicas["Master"]["template"], PYTORCHJOB_CONTAINER,
                            f"PyTorchJob {name} Master")
    ports = [p["containerPort"] for p in master.get("ports") or ()
             if p.get("name") == PYTORCHJOB_PORT_NAME]
    if len(ports) != 1:
        raise ValueError(f"PyTorchJob {name}: the master container has no port named "
                         f"{PYTORCHJOB_PORT_NAME!r}")
    nproc = spec.get("nprocPerNode")
    total = sum(int(replicas[kind]["replicas"]) for kind in _REPLICA_TYPES if kind in replicas)
    world = total * (int(nproc) if nproc is not None and str(nproc).isdigit() else 1)
    master_addr = f"{name}-master-0"
    pods = []
    for kind in _REPLICA_TYPES:
        if kind not in replicas:
            continue
        container = _the_container(replicas[kind]["template"], PYTORCHJOB_CONTAINER,
                                   f"PyTorchJob {name} {kind}")
        for index in range(int(replicas[kind]["replicas"])):
            rank = index + 1 if kind == "Worker" else index
            env = _container_env(container, secrets, f"PyTorchJob {name} {kind}")
            env.update(PYTHONUNBUFFERED="1", MASTER_PORT=str(ports[0]),
                       PET_MASTER_PORT=str(ports[0]), MASTER_ADDR=master_addr,
                       PET_MASTER_ADDR=master_addr, WORLD_SIZE=str(world), RANK=str(rank),
                       PET_NODE_RANK=str(rank))
            if nproc is not None:
                env["PET_NPROC_PER_NODE"] = str(nproc)
            env["PET_NNODES"] = str(total)
            pod = f"{name}-{kind.lower()}-{index}"
            pods.append(Pod(pod, pod, tuple(container["command"]),
                            container.get("workingDir"), env))
    return pods
