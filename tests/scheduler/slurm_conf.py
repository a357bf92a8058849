"""PURE: the files a test Slurm cluster runs from (``slurm.conf``, the hosts file), as text.

A cluster is one head (slurmctld, and the client commands) and N compute nodes, each
with its own address (``SlurmSpec``); every file and directory Slurm or munge writes
lies under one root (``SlurmPaths``), so nothing outside it (``/etc``, ``/var``) is read
or written: the daemons and the clients find ``slurm.conf`` through ``SLURM_CONF`` and
munge's socket through ``AuthInfo=socket=...``.

No cgroup plugin is configured (``ProctrackType=proctrack/pgid``, ``TaskPlugin=task/none``,
``JobAcctGatherType=jobacct_gather/none``), so Slurm reads no ``cgroup.conf`` and needs no
cgroup hierarchy or systemd: it runs where the tests run, containers included.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["SlurmNode", "SlurmSpec", "SlurmPaths", "slurm_conf", "hosts_file"]

CONTROLLER_PORT = 6817
"""slurmctld's port on the head (Slurm's default)."""
NODE_PORT = 6818
"""slurmd's port on every node (Slurm's default): each node has its own address."""


@dataclass(frozen=True, slots=True)
class SlurmNode:
    """One compute node: its Slurm name (also its hostname) and address."""

    name: str
    address: str
    cpus: int = 2
    real_memory_mb: int = 1000
    """What Slurm schedules by; ``SlurmdParameters=config_overrides`` makes slurmd accept
    these numbers whatever the machine has, so a 1-CPU runner still gets 2 x 2 slots."""


@dataclass(frozen=True, slots=True)
class SlurmSpec:
    """A whole cluster: the head, the nodes and their one partition."""

    head: str
    head_address: str
    nodes: tuple[SlurmNode, ...]
    partition: str = "debug"
    cluster_name: str = "netdist"

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ValueError("a Slurm cluster needs at least one node")
        names = [self.head, *(n.name for n in self.nodes)]
        if len(set(names)) != len(names):
            raise ValueError(f"host names must be distinct, got {names}")

    @property
    def node_names(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.nodes)


@dataclass(frozen=True, slots=True)
class SlurmPaths:
    """Where one cluster keeps its configuration, state, logs and munge files."""

    root: Path

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def plugstack(self) -> Path:
        """An empty SPANK stack, so the package's ``/etc/slurm/plugstack.conf`` is not read."""
        return self.root / "plugstack.conf"

    @property
    def hosts(self) -> Path:
        """The hosts file each machine of the cluster sees as its ``/etc/hosts``."""
        return self.root / "hosts"

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def spool(self) -> Path:
        """Holds one ``SlurmdSpoolDir`` per node (``spool/<node>``)."""
        return self.root / "spool"

    @property
    def logs(self) -> Path:
        return self.root / "log"

    @property
    def munge(self) -> Path:
        """munged's socket, pid and seed files (its key lies in ``munge_key_dir``)."""
        return self.root / "munge"

    @property
    def munge_socket(self) -> Path:
        return self.munge / "munge.socket"

    @property
    def munge_key_dir(self) -> Path:
        return self.root / "munge-key"

    @property
    def munge_key(self) -> Path:
        return self.munge_key_dir / "munge.key"

    def log(self, name: str) -> Path:
        """The log file of daemon ``name`` (``slurmctld``, ``slurmd-n1``, ``munged``)."""
        return self.logs / f"{name}.log"

    def directories(self, spec: SlurmSpec) -> tuple[Path, ...]:
        """Every directory the daemons expect to exist before they start."""
        return (self.state, self.logs, self.munge, self.munge_key_dir,
                *(self.spool / node for node in spec.node_names))


def slurm_conf(spec: SlurmSpec, paths: SlurmPaths) -> str:
    """``slurm.conf`` for ``spec``, with every file under ``paths.root``.

    Root runs the daemons and submits the jobs (``SlurmUser=root``), as the tests run as
    root. ``KillWait`` is short so a requeued or cancelled job's tasks go within seconds;
    ``MinJobAge`` keeps a finished job visible to ``scontrol show job`` long enough to
    read its state.
    """
    nodes = "\n".join(
        f"NodeName={n.name} NodeAddr={n.address} NodeHostname={n.name} CPUs={n.cpus} "
        f"RealMemory={n.real_memory_mb} State=UNKNOWN" for n in spec.nodes)
    partition = (f"PartitionName={spec.partition} Nodes={','.join(spec.node_names)} "
                 "Default=YES MaxTime=INFINITE State=UP")
    return f"""\
# A test cluster: {len(spec.nodes)} nodes, every file under {paths.root}
ClusterName={spec.cluster_name}
SlurmctldHost={spec.head}({spec.head_address})
SlurmctldPort={CONTROLLER_PORT}
SlurmdPort={NODE_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={paths.munge_socket}
StateSaveLocation={paths.state}
SlurmdSpoolDir={paths.spool}/%n
SlurmctldPidFile={paths.root}/slurmctld.pid
SlurmdPidFile={paths.root}/slurmd-%n.pid
SlurmctldLogFile={paths.log("slurmctld")}
SlurmdLogFile={paths.logs}/slurmd-%n.log
PlugStackConfig={paths.plugstack}
MailProg=/bin/true
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=2
MinJobAge=600
InactiveLimit=0
{nodes}
{partition}
"""


def hosts_file(spec: SlurmSpec) -> str:
    """``/etc/hosts`` for every machine of the cluster: each name resolves to its own
    address, as a cluster's DNS would have it (``scontrol show hostnames`` gives names
    that the job script then hands to netdist)."""
    lines = ["127.0.0.1\tlocalhost", f"{spec.head_address}\t{spec.head}"]
    lines += [f"{n.address}\t{n.name}" for n in spec.nodes]
    return "\n".join(lines) + "\n"
