"""A real Slurm cluster for tests: a head and N compute nodes, each a host of its own.

Every machine of the cluster is a network namespace on one switch (``netdist.netlab``:
``NetLab.cluster``), so each has its own address and Slurm's node names resolve to
different hosts. A daemon starts on its machine through ``nsenter --net`` (that host's
network) and ``unshare --mount --uts``: a hostname of its own (``n1``) and a private
mount table in which the cluster's hosts file is bind-mounted over ``/etc/hosts`` (the
machine's own ``/etc/hosts`` is never touched). Slurm's tasks inherit all three from
their node's slurmd, so the tasks of one node share a host key (same mount namespace:
netdist moves their bytes through shared memory) and the tasks of different nodes do
not (TCP between them), as on real machines.

- munged runs with a key of its own (a fresh random key under the cluster's root) and
  listens on a socket there; Slurm finds it through ``AuthInfo=socket=...``. The socket
  is a file, reachable from every namespace.
- slurmctld runs on the head, one slurmd per node (``slurmd -N NAME``); the client
  commands (``sinfo``, ``sbatch``, ``srun``, ``scontrol``) run on the head's network
  with ``SLURM_CONF`` naming the generated ``slurm.conf`` (``tests.scheduler.slurm_conf``).
- ``start`` waits, bounded, for munge to answer, for slurmctld to answer ``scontrol
  ping`` and for ``sinfo`` to show every node idle, polling the real state; a daemon that
  exits meanwhile fails the start with the end of its log.
- ``close`` (also when a start fails) cancels every job, stops the daemons, kills what
  is left in the cluster's namespaces (a job's tasks outlive a stopped slurmd), stops
  munged and deletes the namespaces and the cluster's directory.

Needs Linux, root, iproute2 and util-linux (``netlab_missing``) and Debian's
``slurmctld slurmd slurm-client munge`` packages (Slurm 22.05 on bookworm):
``slurm_missing()`` says what is absent.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from netdist.netlab import Cluster, Host, NetLab, netlab_missing
from netdist.netlab.processes import enter_host
from tests.scheduler.slurm_conf import SlurmNode, SlurmPaths, SlurmSpec, hosts_file, slurm_conf
from tests.scheduler.slurm_state import SlurmJob, parse_job, parse_node_states

__all__ = ["SlurmCluster", "slurm_missing", "job_environment", "APT_PACKAGES"]

REPO = Path(__file__).resolve().parents[2]
APT_PACKAGES = "slurmctld slurmd slurm-client munge"
_PROGRAMS = ("slurmctld", "slurmd", "srun", "sbatch", "scontrol", "sinfo", "squeue",
             "scancel", "munged", "munge", "unshare", "mount")
_COMMAND_TIMEOUT = 30.0
"""Bound on one client command (sinfo, sbatch, scontrol, ...)."""
_POLL = 0.2
"""Seconds between two looks at the real state while waiting for it."""
_STOP_TIMEOUT = 15.0
"""How long a daemon may take to exit after SIGTERM before it is killed."""
_INHERITED_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                 "JOB_COMPLETION_INDEX")


def slurm_missing() -> str | None:
    """Why a Slurm test cluster cannot run here, or ``None`` when it can."""
    missing = netlab_missing()
    if missing is not None:
        return missing
    absent = [program for program in _PROGRAMS if shutil.which(program) is None]
    if absent:
        return (f"{', '.join(absent)} not found: apt-get install {APT_PACKAGES} "
                f"(Debian/Ubuntu; .ci/run installs them)")
    return None


def job_environment(conf: Path, **extra: str) -> dict[str, str]:
    """The environment to submit jobs with (sbatch and srun pass it on to the tasks):
    this process's, less every launcher's variables (``NETDIST_*``, ``MASTER_*``,
    ``SLURM_*``, ``RANK``...), with ``SLURM_CONF``, this interpreter's directory first on
    ``PATH`` (the job scripts say ``python3`` and ``netdist``) and this checkout on
    ``PYTHONPATH``; ``extra`` last."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NETDIST_", "MASTER_", "SLURM_", "TORCHELASTIC_", "OMPI_"))
           and k not in _INHERITED_LAUNCHER_VARIABLES}
    env["SLURM_CONF"] = str(conf)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = "1"
    env.update(extra)
    return env


@dataclass(slots=True)
class _Daemon:
    """A daemon this cluster started: its process and where its output goes."""

    name: str
    process: subprocess.Popen[bytes]
    output: Path

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.output.read_text(errors="replace").splitlines()
        except OSError as exc:
            return f"({self.output}: {exc})"
        return "\n".join(text[-lines:])

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``_STOP_TIMEOUT``; reaped either way."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(_STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(_STOP_TIMEOUT)


class SlurmCluster:
    """A head and ``nodes`` compute nodes running Slurm; see the module docstring.

    Use ``SlurmCluster.start()`` (which cleans up after itself if the start fails) as a
    context manager, or call ``close()``.
    """

    def __init__(self, nodes: int = 2, cpus: int = 2) -> None:
        if nodes < 1:
            raise ValueError(f"a Slurm cluster needs at least one node, got {nodes}")
        # directly under the temporary directory: munge's socket path must fit a
        # sockaddr_un (108 bytes), which a pytest tmp_path may not
        self.paths = SlurmPaths(Path(tempfile.mkdtemp(prefix="ndslurm-")))
        self._node_count, self._cpus = nodes, cpus
        self._lab: NetLab | None = None
        self._machines: Cluster | None = None
        self._daemons: list[_Daemon] = []
        self._closed = False
        self.spec: SlurmSpec | None = None

    @classmethod
    def start(cls, nodes: int = 2, cpus: int = 2, *, timeout: float = 60.0) -> SlurmCluster:
        """A running cluster whose nodes are all idle, within ``timeout`` seconds."""
        cluster = cls(nodes, cpus)
        try:
            cluster._start(timeout)
        except BaseException:
            cluster.close()
            raise
        return cluster

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- start-up -----------------------------------------------------------------------

    def _start(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._lab = NetLab()
        self._machines = self._lab.cluster(f"{self._node_count + 1}x1")
        self.spec = SlurmSpec(
            head="head", head_address=self._machines.address(0),
            nodes=tuple(SlurmNode(f"n{i}", self._machines.address(i), cpus=self._cpus)
                        for i in range(1, self._node_count + 1)))
        self._write_files()
        self._start_munge(deadline)
        self._daemons.append(self._on_machine(0, "slurmctld", ["slurmctld", "-D", "-c"]))
        self._wait("slurmctld to answer scontrol ping", deadline, self._controller_up)
        for i, node in enumerate(self.spec.nodes, start=1):
            self._daemons.append(self._on_machine(i, f"slurmd-{node.name}",
                                                  ["slurmd", "-D", "-N", node.name]))
        self._wait("every node to be idle in sinfo", deadline, self._all_idle)

    def _started(self) -> tuple[Cluster, SlurmSpec]:
        """The machines and the spec, once ``start`` has made them."""
        if self._machines is None or self.spec is None:
            raise RuntimeError("the Slurm cluster is not started")
        return self._machines, self.spec

    def _write_files(self) -> None:
        _, spec = self._started()
        for directory in self.paths.directories(spec):
            directory.mkdir(parents=True, exist_ok=True)
        self.paths.munge.chmod(0o755)  # the socket's directory: reachable by every user
        self.paths.munge_key_dir.chmod(0o700)
        key = self.paths.munge_key
        key.touch(mode=0o600)
        key.write_bytes(secrets.token_bytes(1024))  # this cluster's own munge key
        self.paths.conf.write_text(slurm_conf(spec, self.paths))
        self.paths.plugstack.write_text("")
        self.paths.hosts.write_text(hosts_file(spec))

    def _start_munge(self, deadline: float) -> None:
        p = self.paths
        self._daemons.append(self._spawn("munged", [
            "munged", "--foreground", "--force", f"--socket={p.munge_socket}",
            f"--key-file={p.munge_key}", f"--pid-file={p.munge / 'munged.pid'}",
            f"--seed-file={p.munge / 'munged.seed'}", f"--log-file={p.log('munged')}"]))
        self._wait("munged to answer on its socket", deadline, self._munge_up)

    def _spawn(self, name: str, argv: Sequence[str]) -> _Daemon:
        output = self.paths.logs / f"{name}.out"
        with open(output, "wb") as sink:
            process = subprocess.Popen(list(argv), env=self._daemon_env(), stdin=subprocess.DEVNULL,
                                       stdout=sink, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        return _Daemon(name, process, output)

    def _on_machine(self, index: int, name: str, argv: Sequence[str]) -> _Daemon:
        """Start ``argv`` on machine ``index`` (0 is the head): its network namespace, its
        hostname and its ``/etc/hosts`` (a private mount table)."""
        machines, spec = self._started()
        hostname = spec.head if index == 0 else spec.nodes[index - 1].name
        script = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'
        inner = ["unshare", "--mount", "--uts", "--propagation", "private",
                 "sh", "-c", script, "sh", str(self.paths.hosts), hostname, *argv]
        return self._spawn(name, enter_host(machines.hosts[index].name, inner))

    def _daemon_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.paths.conf)
        return env

    def _wait(self, what: str, deadline: float, ready: Callable[[], bool]) -> None:
        """Poll ``ready`` until it holds; fail when a daemon exits or at ``deadline``."""
        while True:
            for daemon in self._daemons:
                code = daemon.process.poll()
                if code is not None:
                    raise RuntimeError(f"{daemon.name} exited with {code} while waiting for "
                                       f"{what}; the end of {daemon.output}:\n{daemon.tail()}")
            if ready():
                return
            if time.monotonic() >= deadline:
                logs = "\n".join(f"--- {d.name}:\n{d.tail(5)}" for d in self._daemons)
                raise TimeoutError(f"timed out waiting for {what}\n{logs}")
            time.sleep(_POLL)

    def _munge_up(self) -> bool:
        socket = str(self.paths.munge_socket)
        result = subprocess.run(["munge", "--no-input", f"--socket={socket}"],
                                capture_output=True, timeout=_COMMAND_TIMEOUT)
        return result.returncode == 0

    def _controller_up(self) -> bool:
        result = self.run("scontrol", "ping", check=False)
        return result.returncode == 0 and "is UP" in result.stdout

    def _all_idle(self) -> bool:
        states = self.node_states()
        return all(states.get(node) == "idle" for node in self._started()[1].node_names)

    # -- using it -----------------------------------------------------------------------

    @property
    def conf(self) -> Path:
        """The ``slurm.conf`` every daemon and client reads (``SLURM_CONF``)."""
        return self.paths.conf

    def environment(self, **extra: str) -> dict[str, str]:
        """``job_environment`` for this cluster: what to submit jobs with."""
        return job_environment(self.paths.conf, **extra)

    def run(self, *argv: str, cwd: Path | None = None, env: Mapping[str, str] | None = None,
            timeout: float = _COMMAND_TIMEOUT, check: bool = True
            ) -> subprocess.CompletedProcess[str]:
        """Run a client command (``sinfo``, ``sbatch``, ``srun``...) on the head's network,
        bounded by ``timeout``; with ``check``, a non-zero exit raises with its output."""
        command = enter_host(self._started()[0].hosts[0].name, argv)
        result = subprocess.run(command, cwd=cwd, capture_output=True, text=True,
                                timeout=timeout,
                                env=dict(env) if env is not None else self.environment())
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited with {result.returncode}:\n"
                               f"{result.stdout}{result.stderr}")
        return result

    def node_states(self) -> dict[str, str]:
        """Node name -> state (``idle``, ``allocated``, ``down``...) as sinfo reports it."""
        result = self.run("sinfo", "--noheader", "--Node", "--format=%N %T", check=False)
        return parse_node_states(result.stdout) if result.returncode == 0 else {}

    def sbatch(self, argv: Sequence[str], *, cwd: Path,
               env: Mapping[str, str] | None = None) -> int:
        """Submit ``sbatch ARGV`` from ``cwd``; the job's id."""
        result = self.run("sbatch", "--parsable", *argv, cwd=cwd, env=env)
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> SlurmJob:
        """The job as ``scontrol show job`` reports it now."""
        result = self.run("scontrol", "show", "job", "--oneliner", str(job_id))
        return parse_job(result.stdout.strip())

    def jobs(self) -> list[SlurmJob]:
        """Every job slurmctld still knows (finished ones for ``MinJobAge`` seconds)."""
        result = self.run("scontrol", "show", "job", "--oneliner")
        return [parse_job(line) for line in result.stdout.splitlines()
                if line.startswith("JobId=")]

    def wait_job(self, job_id: int, until: Callable[[SlurmJob], bool], timeout: float,
                 what: str = "to finish") -> SlurmJob:
        """Poll job ``job_id`` until ``until(job)`` holds; ``TimeoutError`` naming its last
        state after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if until(job):
                return job
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} did not come {what} in {timeout:.0f}s: "
                                   f"it is {job.state} ({job.reason})")
            time.sleep(_POLL)

    def wait_finished(self, job_id: int, timeout: float) -> SlurmJob:
        """Wait until job ``job_id`` has finished (not ``COMPLETING``)."""
        return self.wait_job(job_id, lambda job: job.finished, timeout)

    def cancel_all(self, timeout: float = 30.0) -> None:
        """Cancel every job not finished yet and wait until none is left running."""
        live = [job.job_id for job in self.jobs() if not job.finished]
        if not live:
            return
        self.run("scancel", *map(str, live), check=False)
        deadline = time.monotonic() + timeout
        while any(not job.finished for job in self.jobs()):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"jobs {live} still not finished {timeout:.0f}s after "
                                   "scancel")
            time.sleep(_POLL)

    def describe(self) -> str:
        """The end of every daemon's output, for a failing test's message."""
        return "\n".join(f"--- {d.name} ({d.output}):\n{d.tail()}" for d in self._daemons)

    # -- teardown -----------------------------------------------------------------------

    def close(self) -> None:
        """Cancel the jobs, stop the daemons, kill what is left on the machines, delete
        the namespaces and the cluster's directory. Idempotent; every step runs even
        when an earlier one fails."""
        if self._closed:
            return
        self._closed = True
        try:
            if any(d.name == "slurmctld" and d.process.poll() is None for d in self._daemons):
                try:
                    self.cancel_all()
                except (RuntimeError, TimeoutError, subprocess.TimeoutExpired):
                    pass  # the machines are powered off below whatever the jobs do
        finally:
            try:
                for daemon in reversed(self._daemons):
                    daemon.stop()
                self._power_off()
            finally:
                if self._lab is not None:
                    self._lab.close()
                shutil.rmtree(self.paths.root, ignore_errors=True)

    def _power_off(self) -> None:
        """SIGKILL every process still in one of the cluster's namespaces (a job's tasks
        and slurmstepd outlive a stopped slurmd), each by its id, and reap nothing: they
        are not this process's children."""
        if self._machines is None:
            return
        for host in (*self._machines.hosts, self._machines.switch):
            for pid in _namespace_pids(host):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _namespace_pids(host: Host) -> list[int]:
    result = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True,
                            text=True, timeout=_COMMAND_TIMEOUT)
    return [int(word) for word in result.stdout.split() if word.isdigit()]
