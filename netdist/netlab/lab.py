"""Test hosts with their own network stacks and links: Linux network namespaces.

A ``NetLab`` makes namespaces ("hosts") and joins them with links:

- ``link(a, b, rate_mbit=...)``: a veth pair, each end's egress limited with ``tc tbf``
  (the kernel's token bucket; it exists where ``netem`` may not);
- ``lossy_link(a, b, loss=..., delay=...)``: a pair of TUN devices and a forwarder
  process (``netdist.netlab.lossy_link``) that drops and delays packets, for kernels
  without ``netem``;
- ``cluster(layout, rate_mbit=...)``: H hosts on one switch (``netdist.netlab.cluster``).

Processes run in a host with ``lab.popen(host, argv)`` (``ip netns exec``). Every
namespace, device and forwarder is removed by ``close()`` (the lab is a context
manager); namespaces left by a lab process that died are removed by the next lab.
Needs root, ``ip`` and ``tc`` (iproute2) and ``/dev/net/tun``: ``netlab_missing()``
says which is absent. A lab only touches namespaces it created (named ``ndt<pid>p<n>``),
and the devices in them: the machine's own interfaces, routes and firewall are left
alone, and traffic stays inside the namespaces the lab made.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from netdist.netlab.processes import enter_host

if TYPE_CHECKING:
    from netdist.netlab.cluster import Cluster
    from netdist.netlab.layout import ClusterLayout

__all__ = ["NetLab", "Host", "Link", "netlab_missing", "rank_env", "burst_bytes"]

_PREFIX = "ndt"
_COMMAND_TIMEOUT = 20.0
_PACKAGE_PARENT = Path(__file__).resolve().parents[2]
"""The folder holding ``netdist/``: the forwarder runs ``python -m`` from it."""
_labs = itertools.count()


@dataclass(frozen=True, slots=True)
class Host:
    """One network namespace."""

    name: str
    """The namespace's name (``ip netns exec NAME ...``)."""


@dataclass(slots=True)
class Link:
    """A link between two hosts: each end's address, and what carries it."""

    a: Host
    b: Host
    address_a: str
    address_b: str
    devices: tuple[str, str]
    forwarder: subprocess.Popen[bytes] | None = field(default=None, repr=False)


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): "
                           f"{result.stderr.strip()}")
    return result


def burst_bytes(rate_mbit: float) -> int:
    """The token bucket's depth at ``rate_mbit``: about 2 ms of traffic, at least 2 MTUs.
    A shaped link may pass this many bytes at once above its rate (a lower bound on a
    transfer's time is ``(bytes - burst_bytes) / rate``)."""
    return max(3200, int(rate_mbit * 1e6 / 8 / 500))


def netlab_missing() -> str | None:
    """Why namespaces with shaped links cannot be made here, or None when they can."""
    if sys.platform != "linux":
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "network namespaces and tc need root (run the tests as root, as CI does)"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("nsenter", "util-linux")):
        if shutil.which(tool) is None:
            return f"{tool} not found: apt-get install {package}"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing (the lossy link's TUN devices need it)"
    probe = f"{_PREFIX}probe{os.getpid()}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def rank_env(host: Host, **extra: str) -> dict[str, str]:
    """The environment for a rank started in ``host``: this process's, less any
    ``NETDIST_*`` / ``MASTER_*`` it carries, with ``NETDIST_HOST_ID`` naming the host (so
    ranks in different namespaces never share memory) and unbuffered output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NETDIST_", "MASTER_"))}
    env.update(NETDIST_HOST_ID=host.name, PYTHONUNBUFFERED="1", **extra)
    return env


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_namespaces() -> None:
    """Delete namespaces named by a lab whose process no longer exists."""
    listing = _run("ip", "netns", "list", check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(_PREFIX) or "p" not in name:
            continue
        pid_text = name[len(_PREFIX):].split("p", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            _run("ip", "netns", "del", name, check=False)


class NetLab:
    """Hosts and links for one test; see the module docstring."""

    def __init__(self) -> None:
        _remove_stale_namespaces()
        self._tag = f"{_PREFIX}{os.getpid()}p{next(_labs)}"
        self._hosts: list[Host] = []
        self._links: list[Link] = []
        self._devices = itertools.count()
        self._clusters = 0
        self._closed = False

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def host(self, label: str) -> Host:
        """A new namespace with its loopback up."""
        host = Host(f"{self._tag}{label}")
        _run("ip", "netns", "add", host.name)
        self._hosts.append(host)
        self.exec(host, "ip", "link", "set", "lo", "up")
        return host

    def exec(self, host: Host, *argv: str) -> subprocess.CompletedProcess[str]:
        """Run a short setup command in ``host``; raises if it fails."""
        return _run("ip", "netns", "exec", host.name, *argv)

    def device_name(self, kind: str) -> str:
        """A device name unique to this lab, at most 15 characters (Linux's limit): the
        tag's last 6 characters (its pid and lab number), ``kind`` (one letter) and a
        counter."""
        name = f"{self._tag[-6:]}{kind}{next(self._devices)}"
        if len(name) > 15:
            raise RuntimeError(f"device name {name!r} is longer than 15 characters")
        return name

    def _subnet(self) -> str:
        return f"10.77.{len(self._links)}"

    def link(self, a: Host, b: Host, *, rate_mbit: float | None = None) -> Link:
        """A veth pair between ``a`` and ``b``; each end sends at most ``rate_mbit``."""
        index = len(self._links)
        dev_a, dev_b = f"{self._tag[-6:]}a{index}", f"{self._tag[-6:]}b{index}"
        _run("ip", "link", "add", dev_a, "netns", a.name, "type", "veth",
             "peer", "name", dev_b, "netns", b.name)
        subnet = self._subnet()
        link = Link(a, b, f"{subnet}.1", f"{subnet}.2", (dev_a, dev_b))
        for host, dev, address in ((a, dev_a, link.address_a), (b, dev_b, link.address_b)):
            self.exec(host, "ip", "addr", "add", f"{address}/24", "dev", dev)
            self.exec(host, "ip", "link", "set", dev, "up")
            if rate_mbit is not None:
                self.shape(host, dev, rate_mbit)
        self._links.append(link)
        return link

    def shape(self, host: Host, device: str, rate_mbit: float) -> None:
        """Limit ``device``'s egress to ``rate_mbit`` with a token bucket (``tc tbf``)."""
        self.exec(host, "tc", "qdisc", "replace", "dev", device, "root", "tbf",
                  "rate", f"{rate_mbit}mbit", "burst", str(burst_bytes(rate_mbit)),
                  "latency", "100ms")

    def block(self, host: Host, device: str) -> None:
        """Drop every packet ``device`` sends: a FIFO queue that holds none (``pfifo limit
        0``). Silent, like a cut cable: senders see no error, only no answer."""
        self.exec(host, "tc", "qdisc", "replace", "dev", device, "root", "pfifo", "limit", "0")

    def unshape(self, host: Host, device: str) -> None:
        """Give ``device`` back its default queue (no limit, nothing dropped)."""
        _run("ip", "netns", "exec", host.name, "tc", "qdisc", "del", "dev", device, "root",
             check=False)  # no root qdisc of ours is not an error

    def cluster(self, layout: ClusterLayout | str, *, rate_mbit: float | None = None) -> Cluster:
        """Hosts on one switch, as ``layout`` says (``netdist.netlab.cluster.Cluster``);
        removed with the lab."""
        from netdist.netlab.cluster import Cluster

        self._clusters += 1
        return Cluster(self, layout, rate_mbit=rate_mbit, index=self._clusters - 1)

    def lossy_link(self, a: Host, b: Host, *, loss: float, delay: float,
                   seed: int | None = None) -> Link:
        """A TUN link that drops ``loss`` of the packets each way and delays the rest by
        ``delay`` seconds each way (``netdist.netlab.lossy_link``)."""
        index = len(self._links)
        dev_a, dev_b = f"{self._tag[-6:]}t{index}", f"{self._tag[-6:]}u{index}"
        argv = [sys.executable, "-m", "netdist.netlab.lossy_link", a.name, dev_a, b.name, dev_b,
                "--loss", str(loss), "--delay", str(delay), "--max-seconds", "3600"]
        if seed is not None:
            argv += ["--seed", str(seed)]
        forwarder = subprocess.Popen(argv, cwd=_PACKAGE_PARENT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        # bounded: the forwarder prints or exits (stdout is a pipe: never None here)
        ready = b"" if forwarder.stdout is None else forwarder.stdout.readline()
        if ready.strip() != b"READY":
            forwarder.kill()
            forwarder.wait(_COMMAND_TIMEOUT)
            raise RuntimeError(f"lossy link forwarder did not start (exit {forwarder.poll()})")
        subnet = self._subnet()
        link = Link(a, b, f"{subnet}.1", f"{subnet}.2", (dev_a, dev_b), forwarder)
        self._links.append(link)
        for host, dev, here, there in ((a, dev_a, link.address_a, link.address_b),
                                       (b, dev_b, link.address_b, link.address_a)):
            self.exec(host, "ip", "addr", "add", here, "peer", there, "dev", dev)
            self.exec(host, "ip", "link", "set", dev, "up")
        return link

    def popen(self, host: Host, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in ``host`` (``processes.enter_host``: the network namespace
        only); the caller bounds and reaps it."""
        return subprocess.Popen(enter_host(host.name, argv),
                                env=None if env is None else dict(env),
                                **kwargs)  # type: ignore[call-overload]

    def close(self) -> None:
        """Stop the forwarders and delete every namespace (their devices go with them)."""
        if self._closed:
            return
        self._closed = True
        for link in self._links:
            if link.forwarder is not None:
                link.forwarder.terminate()
                try:
                    link.forwarder.wait(_COMMAND_TIMEOUT)
                except subprocess.TimeoutExpired:
                    link.forwarder.kill()
                    link.forwarder.wait(_COMMAND_TIMEOUT)
                for stream in (link.forwarder.stdin, link.forwarder.stdout):
                    if stream is not None:
                        stream.close()
        for host in self._hosts:
            _run("ip", "netns", "del", host.name, check=False)
