"""A test cluster: H hosts (network namespaces) on one switch, R ranks on each.

The switch is a namespace of its own holding a Linux bridge; each host joins it through
a veth pair whose two ends are both shaped with ``tc tbf`` at ``rate_mbit``: the host's
end limits what it sends (its upload), the switch's end what it receives (its download).
So every host has a full-duplex link of that rate, like a switch port, and two hosts
sending to a third share its download. Hosts get ``10.78.C.(h+1)/24`` (C: the cluster's
number in its lab; ``NetLab.link`` uses ``10.77.*``), the interface on the host is
``Cluster.interface(h)``.

``rank_env`` gives each rank the environment netdist (and, with ``torch=True``,
torch.distributed and Gloo) reads; ``start`` runs one argv per rank in its host and
``wait`` waits for all with one deadline (``netdist.netlab.processes``). ``cut(h)``
makes host ``h`` silently drop everything it sends and everything sent to it (both ends
of its link get a queue that holds nothing, ``pfifo limit 0``: no error reaches a sender,
as when a cable is pulled); ``heal(h)`` restores its link (and flushes the hosts'
neighbour caches, so no address resolution left failing by the cut fails a new
connection).

Needs root (``netdist.netlab.netlab_missing``). A cluster only touches the namespaces its
lab created; ``close()`` (or leaving the ``with`` block, however it is left) kills the
ranks still running and, for a cluster made by ``Cluster.create``, deletes its lab.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from netdist.netlab.lab import Host, NetLab, rank_env
from netdist.netlab.layout import ClusterLayout
from netdist.netlab.processes import RankProcess, RankResult, start_rank, wait_all

__all__ = ["Cluster", "DEFAULT_PORT"]

DEFAULT_PORT = 29500
"""The coordinator's (and torch's store's) port on host 0; every cluster has its own
network stacks, so clusters in parallel never collide on it."""

_INHERITED_RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                             "GROUP_RANK", "GLOO_SOCKET_IFNAME", "TORCHELASTIC_RUN_ID")
"""Variables of this process that would tell a rank the wrong thing: never passed on."""


class Cluster:
    """Hosts on a switch for the ranks of ``layout``; see the module docstring."""

    def __init__(self, lab: NetLab, layout: ClusterLayout | str, *,
                 rate_mbit: float | None = None, index: int = 0,
                 owns_lab: bool = False) -> None:
        self.lab = lab
        self.layout = layout if isinstance(layout, ClusterLayout) else ClusterLayout.parse(layout)
        self.rate_mbit = rate_mbit
        self._owns_lab = owns_lab
        self._ranks: list[RankProcess] = []
        self._closed = False
        if self.layout.hosts > 253:
            raise ValueError(f"at most 253 hosts fit the cluster's /24, got {self.layout.hosts}")
        self.switch = lab.host(f"c{index}sw")
        self.bridge = lab.device_name("w")
        lab.exec(self.switch, "ip", "link", "add", self.bridge, "type", "bridge")
        lab.exec(self.switch, "ip", "link", "set", self.bridge, "up")
        self.hosts: list[Host] = []
        self._devices: list[tuple[str, str]] = []  # (host side, switch side) per host
        self._addresses: list[str] = []
        for h in range(self.layout.hosts):
            self._join(lab.host(f"c{index}h{h}"), f"10.78.{index}.{h + 1}")

    @classmethod
    def create(cls, layout: ClusterLayout | str, *, rate_mbit: float | None = None) -> Cluster:
        """A cluster in a lab of its own, deleted with it by ``close()``."""
        lab = NetLab()
        try:
            return cls(lab, layout, rate_mbit=rate_mbit, owns_lab=True)
        except BaseException:
            lab.close()
            raise

    def _join(self, host: Host, address: str) -> None:
        own, port = self.lab.device_name("h"), self.lab.device_name("s")
        self.lab.exec(self.switch, "ip", "link", "add", port, "type", "veth",
                      "peer", "name", own, "netns", host.name)
        self.lab.exec(self.switch, "ip", "link", "set", port, "master", self.bridge)
        self.lab.exec(self.switch, "ip", "link", "set", port, "up")
        self.lab.exec(host, "ip", "addr", "add", f"{address}/24", "dev", own)
        self.lab.exec(host, "ip", "link", "set", own, "up")
        self.hosts.append(host)
        self._devices.append((own, port))
        self._addresses.append(address)
        if self.rate_mbit is not None:
            self._shape(len(self.hosts) - 1)

    def _shape(self, h: int) -> None:
        own, port = self._devices[h]
        for where, device in ((self.hosts[h], own), (self.switch, port)):
            if self.rate_mbit is None:
                self.lab.unshape(where, device)
            else:
                self.lab.shape(where, device, self.rate_mbit)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- where things are ---------------------------------------------------------------

    def address(self, host: int) -> str:
        """Host ``host``'s address (what its ranks listen on and advertise)."""
        return self._addresses[host]

    def interface(self, host: int) -> str:
        """The name of host ``host``'s interface to the switch (``GLOO_SOCKET_IFNAME``)."""
        return self._devices[host][0]

    def host_of(self, rank: int) -> Host:
        """The namespace ``rank`` runs in."""
        return self.hosts[self.layout.host_of(rank)]

    # -- ranks --------------------------------------------------------------------------

    def rank_env(self, rank: int, port: int = DEFAULT_PORT, token: str | None = None, *,
                 torch: bool = False, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of ``rank``: this process's (less netdist's, torch's and
        Gloo's rank variables), with ``NETDIST_RANK``, ``NETDIST_WORLD_SIZE``,
        ``NETDIST_COORDINATOR`` (host 0's address and ``port``), ``NETDIST_ADVERTISE_ADDR``
        and ``NETDIST_LISTEN_HOST`` (its host's address), ``NETDIST_HOST_ID`` (its host's
        name) and ``NETDIST_TOKEN`` (when given).

        With ``torch``, also ``MASTER_ADDR``/``MASTER_PORT`` (host 0, ``port``), ``RANK``,
        ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``GLOO_SOCKET_IFNAME``
        (its host's interface); the netdist coordinator then takes ``port + 1``, as under
        torchrun, so a rank may use torch's store and ``netdist.init()`` both.
        ``extra`` is applied last.
        """
        layout = self.layout
        h = layout.host_of(rank)
        env = rank_env(self.hosts[h])
        for name in _INHERITED_RANK_VARIABLES:
            env.pop(name, None)
        head, own = self.address(0), self.address(h)
        env.update(NETDIST_RANK=str(rank), NETDIST_WORLD_SIZE=str(layout.world_size),
                   NETDIST_COORDINATOR=f"{head}:{port + 1 if torch else port}",
                   NETDIST_ADVERTISE_ADDR=own, NETDIST_LISTEN_HOST=own)
        if token is not None:
            env["NETDIST_TOKEN"] = token
        if torch:
            env.update(MASTER_ADDR=head, MASTER_PORT=str(port), RANK=str(rank),
                       WORLD_SIZE=str(layout.world_size),
                       LOCAL_RANK=str(layout.local_rank(rank)),
                       LOCAL_WORLD_SIZE=str(layout.ranks_per_host[h]),
                       GLOO_SOCKET_IFNAME=self.interface(h))
        env.update(extra or {})
        return env

    def start(self, argv_for_rank: Callable[[int], Sequence[str]], *,
              port: int = DEFAULT_PORT, token: str | None = None, torch: bool = False,
              extra: Mapping[str, str] | None = None, passthrough: Sequence[int] = (),
              cwd: str | None = None) -> list[subprocess.Popen[bytes]]:
        """Start ``argv_for_rank(r)`` for every rank in its host with ``rank_env``, each
        in a session of its own; their processes in rank order. The output of the ranks
        in ``passthrough`` goes to this process's, the others' is kept for ``wait``. A
        rank that fails to start kills those already started."""
        if self._ranks:
            raise RuntimeError("this cluster's ranks are running: wait() for them first")
        try:
            for rank in range(self.layout.world_size):
                env = self.rank_env(rank, port, token, torch=torch, extra=extra)
                self._ranks.append(start_rank(rank, self.host_of(rank).name,
                                              list(argv_for_rank(rank)), env,
                                              capture=rank not in passthrough,
                                              cwd=cwd or os.getcwd()))
        except BaseException:
            self._kill_ranks()
            raise
        return [r.process for r in self._ranks]

    def wait(self, timeout: float) -> list[RankResult]:
        """Wait up to ``timeout`` seconds for the ranks ``start`` started; when one fails
        or the deadline passes, the rest are killed. One result per rank, in rank order."""
        ranks, self._ranks = self._ranks, []
        return wait_all(ranks, timeout)

    def run(self, argv_for_rank: Callable[[int], Sequence[str]], timeout: float,
            **start_options: Any) -> list[RankResult]:
        """``start`` then ``wait``."""
        self.start(argv_for_rank, **start_options)
        return self.wait(timeout)

    def _kill_ranks(self) -> None:
        ranks, self._ranks = self._ranks, []
        if ranks:
            wait_all(ranks, 0.0)  # kills the running ones, reaps all, closes their files

    # -- faults -------------------------------------------------------------------------

    def cut(self, host: int) -> None:
        """Drop everything host ``host`` sends and everything sent to it, silently."""
        own, port = self._devices[host]
        self.lab.block(self.hosts[host], own)
        self.lab.block(self.switch, port)

    def heal(self, host: int) -> None:
        """Undo ``cut(host)``: its link carries traffic again, shaped as before.

        Every host also forgets its neighbours (``ip neigh flush``): an address
        resolution that was failing during the cut would otherwise fail the first
        connection attempts after it (the kernel reports "host unreachable" to packets
        queued on a resolution that gives up)."""
        self._shape(host)
        for h, peer in enumerate(self.hosts):
            self.lab.exec(peer, "ip", "neigh", "flush", "dev", self._devices[h][0])

    # -- teardown -----------------------------------------------------------------------

    def close(self) -> None:
        """Kill the ranks still running; delete the lab if this cluster made it."""
        if self._closed:
            return
        self._closed = True
        try:
            self._kill_ranks()
        finally:
            if self._owns_lab:
                self.lab.close()
