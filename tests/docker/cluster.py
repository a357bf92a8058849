"""Drive the docker-compose cluster from tests and benchmarks: one compose project each.

Everything here is bounded: every ``docker`` / compose call has a subprocess timeout,
waiting for a container to exit uses ``docker wait`` under a timeout, waiting for a
log line follows the log stream (``docker logs --follow``) until a deadline, and waiting
for a server watches its listening socket appear (``ss`` in its container). Nothing
sleeps to synchronise.

Works with ``docker compose`` (v2) and ``docker-compose`` 1.29: containers, networks and
volumes are found by their compose labels, never by generated names.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
IMAGE = os.environ.get("NETDIST_IMAGE", "netdist:local")
BASE_IMAGE = os.environ.get("NETDIST_BASE_IMAGE", "netdist-base:local")
# Service names say role and index; the rank is what docker/node.sh logs. Without the ps
# profile worker-I is rank I; with it the servers are ranks 0-1 and worker-I is rank 2+I.
WORKERS = ("worker-0", "worker-1", "worker-2", "worker-3")
SERVERS = ("ps-server-0", "ps-server-1")
RANK0 = WORKERS[0]    # the default profile's rank 0, which hosts the coordinator
COORDINATOR_PORT = 29400
UP_SCRIPT = REPO / "docker" / "up.sh"
NODE_RE = re.compile(r"^netdist-node: (\S+) is rank (\d+) of (\d+) \((worker|server) (\d+)\)",
                     re.M)

ACCURACY_RE = re.compile(r"final test accuracy: ([0-9.]+)%")
EPOCH_RE = re.compile(r"^epoch\s+(\d+)/(\d+)\s+step\s+(\d+)/(\d+)\s+loss\s+([0-9.]+)", re.M)
CHECKPOINT_RE = re.compile(r"^checkpoint: step (\d+) ->", re.M)
RESUMED_RE = re.compile(r"^resumed from \S+ at step (\d+)", re.M)


class DockerUnavailable(RuntimeError):
    """No reachable Docker engine or no compose implementation."""


def docker(*args: str, timeout: float = 60.0, check: bool = True,
           input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``docker ARGS`` (bounded); raise with its output when ``check`` and it fails."""
    result = subprocess.run(["docker", *args], capture_output=True, text=True,
                            timeout=timeout, input=input)
    if check and result.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)} failed ({result.returncode}):\n"
                           f"{result.stdout}{result.stderr}")
    return result


def compose_command() -> list[str]:
    """``docker compose`` when the v2 plugin is there, else ``docker-compose``."""
    override = os.environ.get("NETDIST_COMPOSE")
    if override:
        return override.split()
    if shutil.which("docker") is None:
        raise DockerUnavailable("the docker CLI is not installed")
    try:
        v2 = subprocess.run(["docker", "compose", "version"], capture_output=True,
                            text=True, timeout=30)
        if v2.returncode == 0:
            return ["docker", "compose"]
    except subprocess.TimeoutExpired:
        pass
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise DockerUnavailable("neither `docker compose` (v2) nor `docker-compose` is installed")


def check_engine() -> None:
    """Raise ``DockerUnavailable`` unless a Docker engine answers."""
    if shutil.which("docker") is None:
        raise DockerUnavailable("the docker CLI is not installed")
    try:
        info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"],
                              capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        raise DockerUnavailable("`docker info` did not answer within 30 s") from None
    if info.returncode != 0 or not info.stdout.strip():
        reason = (info.stderr.strip().splitlines() or ["no server version"])[-1]
        raise DockerUnavailable(f"no Docker engine reachable: {reason}")


def build_images(timeout: float = 1800.0) -> None:
    """``docker/build-offline.sh``: seconds when nothing changed, minutes the first time."""
    result = subprocess.run([str(REPO / "docker" / "build-offline.sh")], cwd=REPO,
                            capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"docker/build-offline.sh failed ({result.returncode}):\n"
                           f"{result.stdout}{result.stderr}")


def wait_for_listener(container: str, port: int, timeout: float, *, what: str = "") -> None:
    """Wait (at most ``timeout`` s) until a socket in ``container`` listens on ``port``:
    from then on connections to it are accepted.

    Watched from inside the container (``ss -Htln``, iproute2 is in the image) rather than
    by connecting: a probe connection would itself be a stranger that netdist's
    coordinator logs and drops. Each probe is a ``docker exec`` (tens of milliseconds or
    more), so the poll paces itself. Raises ``TimeoutError`` (with the container's log)
    when the port does not open in time or the container stops first.
    """
    what = what or container[:12]
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            probe = docker("exec", container, "ss", "-Htln", f"sport = :{port}",
                           timeout=remaining, check=False)
        except subprocess.TimeoutExpired:
            break
        last = (probe.stdout + probe.stderr).strip()
        if probe.returncode == 0 and probe.stdout.strip():
            return
        state = docker("inspect", "--format", "{{.State.Running}}", container,
                       check=False).stdout.strip()
        if state != "true":
            break
    log = subprocess.run(["docker", "logs", container], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=60).stdout
    raise TimeoutError(f"{what}: nothing listens on port {port} within {timeout:g} s "
                       f"(last probe: {last!r}); log:\n{log[-4000:]}")


@dataclass(frozen=True, slots=True)
class Exit:
    """How a container ended."""

    code: int
    oom_killed: bool
    finished_at: str


# A tool run inside the image with the checkpoint volume mounted: lists complete and
# incomplete checkpoints, verifies the latest one with `netdist ckpt verify`, loads it
# (consolidate with checksum verification) and prints a digest of every tensor as JSON.
_CKPT_TOOL = r"""
import hashlib, json, os, subprocess, sys, tempfile
import numpy as np
from safetensors.numpy import load_file
from netdist.checkpoint import consolidate, list_checkpoints, resolve_checkpoint

root = sys.argv[1]
out = {"complete": [], "incomplete": [], "temporary": [], "latest": None,
       "verify": None, "tensors": {}, "load_error": None}
if os.path.isdir(root):
    out["complete"] = [step for step, _ in list_checkpoints(root)]
    for entry in sorted(os.listdir(root)):
        path = os.path.join(root, entry)
        if os.path.isfile(path) and ".tmp." in entry:
            out["temporary"].append(path)
        if entry.startswith("step_") and os.path.isdir(path) \
                and not os.path.isfile(os.path.join(path, "metadata.json")):
            out["incomplete"].append(entry)
        for dirpath, _, files in os.walk(path) if os.path.isdir(path) else ():
            out["temporary"] += [os.path.join(dirpath, f) for f in files if ".tmp." in f]
if out["complete"]:
    latest = resolve_checkpoint(root)
    out["latest"] = latest.name
    v = subprocess.run(["netdist", "ckpt", "verify", str(latest)],
                       capture_output=True, text=True, timeout=120)
    out["verify"] = {"code": v.returncode, "output": (v.stdout + v.stderr)[-2000:]}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            target = consolidate(latest, os.path.join(tmp, "all.safetensors"), verify=True)
            for name, array in sorted(load_file(str(target)).items()):
                out["tensors"][name] = hashlib.sha256(
                    np.ascontiguousarray(array).tobytes()).hexdigest()
    except Exception as exc:
        out["load_error"] = f"{type(exc).__name__}: {exc}"
print("CKPT-JSON " + json.dumps(out))
"""


class Cluster:
    """One compose project of the netdist cluster; ``down()`` removes it with its volume."""

    def __init__(self, name: str, env: Mapping[str, str] | None = None) -> None:
        self.project = f"nd{name}{uuid.uuid4().hex[:6]}".lower().replace("_", "")
        self.compose = compose_command()
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("NETDIST_", "COMPOSE_"))}
        base.update({"NETDIST_IMAGE": IMAGE, "NETDIST_BASE_IMAGE": BASE_IMAGE,
                     "NETDIST_JOB_ID": "test", "NETDIST_TIMEOUT": "10"})
        base.update(env or {})
        self.env = base
        self._marks: dict[str, float] = {}

    # -- compose ------------------------------------------------------------------------

    def run(self, *args: str, timeout: float = 120.0, check: bool = True,
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """``compose -p PROJECT -f docker-compose.yml ARGS`` (bounded)."""
        cmd = [*self.compose, "-p", self.project, "-f", str(COMPOSE_FILE), *args]
        merged = dict(self.env)
        merged.update(env or {})
        result = subprocess.run(cmd, cwd=REPO, env=merged, capture_output=True, text=True,
                                timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n"
                               f"{result.stdout}{result.stderr}")
        return result

    def up(self, *services: str, env: Mapping[str, str] | None = None,
           timeout: float = 180.0) -> None:
        """Start ``services`` (all default ones when empty) detached, never building or pulling."""
        self.run("up", "-d", "--no-build", *services, env=env, timeout=timeout)

    def down(self) -> None:
        """Remove containers, network and volume; bounded, never raises."""
        try:
            self.run("down", "-v", "--remove-orphans", "-t", "5", timeout=180, check=False)
        except subprocess.TimeoutExpired:
            pass
        for kind in ("container", "network", "volume"):  # anything compose left behind
            try:
                ids = docker(kind, "ls", "-q", *(["-a"] if kind == "container" else []),
                             "--filter", f"label=com.docker.compose.project={self.project}",
                             check=False).stdout.split()
                if ids:
                    docker(kind, "rm", *(["-f"] if kind != "network" else []), *ids,
                           check=False, timeout=120)
            except subprocess.TimeoutExpired:
                pass

    # -- containers ---------------------------------------------------------------------

    def container(self, service: str) -> str:
        """Id of ``service``'s container (raises if there is none)."""
        ids = docker("ps", "-a", "-q", "--no-trunc",
                     "--filter", f"label=com.docker.compose.project={self.project}",
                     "--filter", f"label=com.docker.compose.service={service}").stdout.split()
        if len(ids) != 1:
            raise RuntimeError(f"expected one container for {service}, found {ids}")
        return ids[0]

    def services(self) -> list[str]:
        """The services that have a container in this project, sorted."""
        out = docker("ps", "-a", "--format", '{{.Label "com.docker.compose.service"}}',
                     "--filter", f"label=com.docker.compose.project={self.project}").stdout
        return sorted(set(out.split()))

    def state(self, service: str) -> dict:
        out = docker("inspect", "--format", "{{json .State}}", self.container(service)).stdout
        return json.loads(out)

    def running(self, service: str) -> bool:
        return bool(self.state(service).get("Running"))

    def wait_exit(self, services: Iterable[str], timeout: float) -> dict[str, Exit]:
        """Wait (at most ``timeout`` s overall) until every service's container has exited
        for good (a container its restart policy brings back is waited for again)."""
        services = list(services)
        deadline = time.monotonic() + timeout
        result: dict[str, Exit] = {}
        for service in services:
            cid = self.container(service)
            while True:
                remaining = deadline - time.monotonic()
                try:
                    if remaining <= 0:
                        raise subprocess.TimeoutExpired("docker wait", timeout)
                    docker("wait", cid, timeout=remaining)
                except subprocess.TimeoutExpired:
                    states = {s: self.state(s).get("Status") for s in services}
                    raise TimeoutError(f"{service} still running after {timeout:g} s "
                                       f"(states: {states})") from None
                state = self.state(service)
                if not (state.get("Running") or state.get("Restarting")):
                    break
            result[service] = Exit(int(state["ExitCode"]), bool(state.get("OOMKilled")),
                                   str(state.get("FinishedAt")))
        return result

    def restart_count(self, service: str) -> int:
        out = docker("inspect", "--format", "{{.RestartCount}}", self.container(service)).stdout
        return int(out.strip())

    def _logs_cmd(self, service: str, since_mark: bool, follow: bool = False) -> list[str]:
        cmd = ["docker", "logs"]
        if follow:
            cmd.append("--follow")
        if since_mark and service in self._marks:
            cmd += ["--since", f"{self._marks[service]:.6f}"]
        return [*cmd, self.container(service)]

    def logs(self, service: str, *, since_mark: bool = False) -> str:
        """Everything ``service`` wrote (stdout + stderr), or only what it wrote after the
        last ``mark()`` (a restarted container keeps its earlier output)."""
        result = subprocess.run(self._logs_cmd(service, since_mark), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, timeout=60)
        return result.stdout

    def mark(self, *services: str) -> None:
        """Remember now, for ``logs(since_mark=True)``; call it while the services are
        stopped, before starting them again."""
        now = time.time()
        for service in services:
            self._marks[service] = now

    def wait_for_log(self, service: str, pattern: str | re.Pattern[str], timeout: float, *,
                     accept: Callable[[re.Match[str]], bool] | None = None,
                     since_mark: bool = False) -> re.Match[str]:
        """Follow ``service``'s log until ``pattern`` matches a line (and ``accept`` likes
        the match), at most ``timeout`` s; with ``since_mark`` only lines after ``mark()``.

        Raises ``TimeoutError`` (with the log) when it does not appear in time or the
        container stops first.
        """
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        text = ""
        while True:  # one pass per run of the container (a restart policy may restart it)
            text, match = self._follow(service, regex, accept, since_mark, deadline)
            if match is not None:
                return match
            state = self.state(service)
            if time.monotonic() >= deadline or not (state.get("Running") or state.get("Restarting")):
                break
        raise TimeoutError(f"{service}: no line matching {regex.pattern!r} within "
                           f"{timeout:g} s; log:\n{text[-4000:]}")

    def _follow(self, service: str, regex: re.Pattern[str],
                accept: Callable[[re.Match[str]], bool] | None, since_mark: bool,
                deadline: float) -> tuple[str, re.Match[str] | None]:
        """Follow the log until a match, the deadline or the container stopping."""
        proc = subprocess.Popen(self._logs_cmd(service, since_mark, follow=True),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        buffer = b""
        try:
            assert proc.stdout is not None
            fd = proc.stdout.fileno()
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                ready, _, _ = select.select([fd], [], [], remaining)
                if not ready:
                    break
                chunk = os.read(fd, 65536)
                if not chunk:
                    break  # the container stopped
                buffer += chunk
                for line in buffer.decode("utf-8", "replace").splitlines():
                    match = regex.search(line)
                    if match and (accept is None or accept(match)):
                        return "", match
        finally:
            proc.kill()
            proc.wait(timeout=30)
            if proc.stdout is not None:
                proc.stdout.close()
        return buffer.decode("utf-8", "replace"), None

    def wait_for_listener(self, service: str, port: int, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until ``service``'s container listens on ``port``
        (see :func:`wait_for_listener`)."""
        wait_for_listener(self.container(service), port, timeout, what=service)

    def run_job(self, *args: str, env: Mapping[str, str] | None = None) -> JobRun:
        """Start ``docker/up.sh ARGS`` (the README's command) on this project."""
        merged = dict(self.env, COMPOSE_PROJECT_NAME=self.project,
                      NETDIST_COMPOSE=" ".join(self.compose))
        merged.update(env or {})
        return JobRun(subprocess.Popen([str(UP_SCRIPT), *args], cwd=REPO, env=merged,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       start_new_session=True))

    def kill(self, *services: str) -> None:
        """SIGKILL the services' containers, all in one ``docker kill``."""
        docker("kill", *(self.container(s) for s in services), timeout=60)

    def exec(self, service: str, *cmd: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return docker("exec", self.container(service), *cmd, timeout=timeout, check=False)

    # -- network and volume ------------------------------------------------------------

    def _labelled(self, kind: str, label: str, value: str) -> str:
        names = docker(kind, "ls", "-q" if kind == "volume" else "--format={{.Name}}",
                       "--filter", f"label=com.docker.compose.project={self.project}",
                       "--filter", f"label=com.docker.compose.{label}={value}").stdout.split()
        if len(names) != 1:
            raise RuntimeError(f"expected one {kind} {value} of {self.project}, found {names}")
        return names[0]

    @property
    def network(self) -> str:
        return self._labelled("network", "network", "netdist")

    @property
    def volume(self) -> str:
        return self._labelled("volume", "volume", "checkpoints")

    def run_in_network(self, *cmd: str, env: Mapping[str, str] | None = None,
                       timeout: float = 90.0, name: str | None = None) -> subprocess.CompletedProcess[str]:
        """A one-off container of the image on the cluster's network (not a compose
        service, so not part of the job)."""
        args = ["run", "--rm", "--network", self.network]
        if name:
            args += ["--name", f"{self.project}-{name}"]
        for key, value in (env or {}).items():
            args += ["-e", f"{key}={value}"]
        return docker(*args, IMAGE, *cmd, timeout=timeout, check=False)

    def checkpoints(self, job_id: str = "test") -> dict:
        """State of ``/checkpoints/JOB`` in the volume (see ``_CKPT_TOOL``)."""
        result = docker("run", "--rm", "--network", "none", "-v", f"{self.volume}:/checkpoints",
                        "--entrypoint", "python3", IMAGE, "-c", _CKPT_TOOL,
                        f"/checkpoints/{job_id}", timeout=180, check=False)
        for line in result.stdout.splitlines():
            if line.startswith("CKPT-JSON "):
                return json.loads(line[len("CKPT-JSON "):])
        raise RuntimeError(f"checkpoint tool failed ({result.returncode}):\n"
                           f"{result.stdout}{result.stderr}")


class JobRun:
    """A running ``docker/up.sh``: its output (stdout and stderr together) read as it
    comes, every wait bounded."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self._data = b""

    @property
    def output(self) -> str:
        return self._data.decode("utf-8", "replace")

    def wait_for(self, pattern: str | re.Pattern[str], timeout: float) -> re.Match[str]:
        """Read the output until a line matches ``pattern``, at most ``timeout`` s;
        ``TimeoutError`` (with the output) when it does not, or the script ends first."""
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            match = regex.search(self.output)
            if match:
                return match
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                break
            chunk = os.read(fd, 65536)
            if not chunk:
                break  # the script ended
            self._data += chunk
        raise TimeoutError(f"docker/up.sh printed no line matching {regex.pattern!r} within "
                           f"{timeout:g} s; output:\n{self.output[-4000:]}")

    def finish(self, timeout: float) -> int:
        """Wait (at most ``timeout`` s) for the script to end; its exit code."""
        try:
            rest, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            rest, _ = self.proc.communicate(timeout=30)
            self._data += rest or b""
            raise TimeoutError(f"docker/up.sh still running after {timeout:g} s; output:\n"
                               f"{self.output[-4000:]}") from None
        self._data += rest or b""
        return self.proc.returncode

    def close(self) -> None:
        """Kill the script and its children (log followers, ``docker wait``) if it still
        runs; the containers are the cluster's to remove."""
        if self.proc.stdout is None or self.proc.stdout.closed:
            return  # finish() read it to the end
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: see run_job
        self.proc.communicate(timeout=30)


def accuracy(log: str) -> float:
    """The final test accuracy (percent) a rank-0 log reports; raises if absent."""
    matches = ACCURACY_RE.findall(log)
    if not matches:
        raise AssertionError(f"no final accuracy in the log:\n{log[-3000:]}")
    return float(matches[-1])


def epoch_losses(log: str) -> dict[int, str]:
    """``{epoch: loss text}`` from the progress lines (last occurrence wins)."""
    return {int(m.group(1)): m.group(5) for m in EPOCH_RE.finditer(log)}


def exit_codes(exits: Mapping[str, Exit]) -> dict[str, int]:
    return {service: e.code for service, e in exits.items()}


def services_logs(cluster: Cluster, services: Sequence[str]) -> str:
    """The end of every service's log, with timestamps, for failure messages."""
    parts = []
    for service in services:
        result = subprocess.run(["docker", "logs", "--timestamps", cluster.container(service)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                timeout=60)
        parts.append(f"--- {service}\n{result.stdout[-3000:]}")
    return "\n".join(parts)
